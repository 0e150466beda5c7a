"""The shape of laminar-common: a core plus ``relay``, ``launch``, ``consume``, ``data`` and
``testing`` (test support, which may use any part and which no library module imports),
no cycles. And the libraries' shape: no tier imports ``laminar_common.launch`` or the
examples, no library imports ``laminar_examples`` or holds a demo module.

Reads every module's imports (module level and inside functions) with ``ast``, so the
check holds for lazy imports too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import laminar_common

ROOT = Path(laminar_common.__file__).parent


def _imports() -> dict[str, set[str]]:
    """laminar_common's own import graph: module -> the laminar_common modules it imports."""
    graph = _graph(ROOT)
    modules = set(graph)
    return {m: {d for d in deps if d in modules and d != m} for m, deps in graph.items()}


PARTS = ("laminar_common.relay", "laminar_common.launch", "laminar_common.consume",
         "laminar_common.data", "laminar_common.testing")


def test_the_core_never_imports_its_subpackages():
    core = {m: d for m, d in _imports().items() if not m.startswith(PARTS)}
    bad = {m: sorted(x for x in d if x.startswith(PARTS)) for m, d in core.items()}
    assert not {m: d for m, d in bad.items() if d}


def test_no_library_module_imports_the_test_support():
    offenders = {m: sorted(d) for m, d in _imports().items()
                 if not m.startswith("laminar_common.testing")
                 and any(x.startswith("laminar_common.testing") for x in d)}
    assert not offenders


def test_relay_and_launch_do_not_import_each_other():
    graph = _imports()
    for a, b in (("relay", "launch"), ("launch", "relay")):
        offenders = {m: sorted(d) for m, d in graph.items()
                     if m.startswith(f"laminar_common.{a}")
                     and any(x.startswith(f"laminar_common.{b}") for x in d)}
        assert not offenders, f"laminar_common.{a} imports laminar_common.{b}: {offenders}"


def test_data_imports_the_core_only():
    """Datasets, chat templates and rewards serve the rollout and the trainer alike: none of
    the relay client, the operator toolkit or the trainer's consumer comes with them."""
    graph = _imports()
    assert any(m.startswith("laminar_common.data.") for m in graph)
    others = tuple(p for p in PARTS if p not in ("laminar_common.data", "laminar_common.testing"))
    offenders = {m: sorted(x for x in d if x.startswith(others)) for m, d in graph.items()
                 if m.startswith("laminar_common.data")}
    assert not {m: d for m, d in offenders.items() if d}, offenders


def test_no_import_cycles():
    graph = {m: {d for d in deps if not (m.startswith(d + ".") or d == m.rpartition(".")[0])}
             for m, deps in _imports().items()}  # a module importing its own package is fine
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_subpackage_exports_what_it_lists():
    import laminar_common.consume
    import laminar_common.launch
    import laminar_common.relay

    for pkg in (laminar_common, laminar_common.relay, laminar_common.launch,
                laminar_common.consume):
        for name in pkg.__all__:
            assert getattr(pkg, name) is not None, f"{pkg.__name__}.{name}"


# -- the libraries and the examples ---------------------------------------------------
# Libraries hold library code: the example jobs' content (tasks, prompt files, demo models,
# warm starts) is the laminar-examples package's (examples/src/laminar_examples), which no
# library imports; and no tier imports the operator toolkit (laminar_common.launch).

REPO = Path(__file__).resolve().parents[3]
LIBRARIES = {"laminar_common": "laminar-common", "laminar_relay": "laminar-relay",
             "laminar_rollout": "laminar-rollout", "laminar_trainer": "laminar-trainer"}
DEMO_MODULES = {"tasks", "math_tasks", "warmstart", "chat_warmstart", "demo_model", "chat_model"}


def _package_dir(name: str) -> Path:
    """``name``'s source directory in this repository, or a skip saying why there is none."""
    path = REPO / "packages" / LIBRARIES[name] / "src" / name
    if not path.is_dir():
        pytest.skip(f"{path} is not here (the test reads the libraries' sources in the "
                    "repository it runs from; an installed laminar-common alone has none)")
    return path


def _absolute_imports(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports (module level and inside functions), relative ones
    made absolute (``package`` is the module's own package)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _graph(root: Path) -> dict[str, set[str]]:
    """Module name -> every module it imports, for each module of the package at ``root``
    (generated ``proto`` code left out)."""
    graph = {}
    for path in sorted(root.rglob("*.py")):
        if "proto" in path.relative_to(root).parts:
            continue
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        module = ".".join(parts)
        package = module if is_package else module.rpartition(".")[0]
        graph[module] = _absolute_imports(path, package)
    assert graph, f"no modules under {root}"
    return graph


def _library_imports(name: str) -> dict[str, set[str]]:
    """Module name -> the modules it imports, for every module of library ``name``."""
    return _graph(_package_dir(name))


def _importing(graph: dict[str, set[str]], *prefixes: str) -> dict[str, list[str]]:
    hits = {m: sorted(d for d in deps if any(d == p or d.startswith(p + ".") for p in prefixes))
            for m, deps in graph.items()}
    return {m: d for m, d in hits.items() if d}


@pytest.mark.parametrize("tier", ["laminar_relay", "laminar_rollout", "laminar_trainer"])
def test_no_tier_imports_the_operator_toolkit_or_the_examples(tier):
    offenders = _importing(_library_imports(tier), "laminar_common.launch", "laminar_examples")
    assert not offenders, f"{tier} imports the toolkit or the examples: {offenders}"


def test_laminar_common_imports_no_examples():
    offenders = _importing(_library_imports("laminar_common"), "laminar_examples")
    assert not offenders, f"laminar_common imports laminar_examples: {offenders}"


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_no_library_holds_demo_content(library):
    root = _package_dir(library)
    found = sorted(str(p.relative_to(root.parent)) for p in root.rglob("*")
                   if (p.suffix == ".py" or p.is_dir()) and p.stem in DEMO_MODULES)
    assert not found, (f"{library} holds demo modules {found}: they belong to laminar-examples "
                       "(examples/src/laminar_examples)")


SERVICES = {"laminar_relay": ("laminar_relay.service",),
            "laminar_rollout": ("laminar_rollout.worker", "laminar_rollout.manager"),
            "laminar_trainer": ("laminar_trainer.service",)}
"""Each tier's services: the composition roots that wire its components together."""


@pytest.mark.parametrize("tier", sorted(SERVICES))
def test_components_never_import_their_service(tier):
    """A component is wired by its service and never reaches back into it: only the
    package's ``__init__`` (its lazy exports) and its CLI import a service module."""
    services = SERVICES[tier]
    graph = _library_imports(tier)
    assert set(services) <= set(graph), f"{tier}: no module {set(services) - set(graph)}"
    allowed = {tier, f"{tier}.cli", *services}
    offenders = {m: d for m, d in _importing(graph, *services).items() if m not in allowed}
    assert not offenders, f"{tier}: components import a service: {offenders}"


SERVICE_MAX_LINES = 400
"""A composition root wires its parts and runs its loop; past this it is doing their work."""
FUNCTION_MAX_LINES = 80
"""Lines of a function's code (its docstring aside)."""


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    first = body[0]
    if len(body) > 1 and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        first = body[1]
    return fn.end_lineno - first.lineno + 1


def _long_functions(path: Path) -> list[str]:
    return [f"{path.name}:{node.lineno} {node.name} ({_code_lines(node)} lines)"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _code_lines(node) > FUNCTION_MAX_LINES]


@pytest.mark.parametrize("tier", sorted(SERVICES))
def test_services_stay_composition_roots(tier):
    """Each service module at most ``SERVICE_MAX_LINES`` lines."""
    root = _package_dir(tier)
    sizes = {m: len((root.parent / (m.replace(".", "/") + ".py")).read_text().splitlines())
             for m in SERVICES[tier]}
    assert all(n <= SERVICE_MAX_LINES for n in sizes.values()), \
        f"{tier}: a service over {SERVICE_MAX_LINES} lines: {sizes}"


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_no_function_is_over_the_limit(library):
    root = _package_dir(library)
    long = [f for path in sorted(root.rglob("*.py"))
            if "proto" not in path.relative_to(root).parts for f in _long_functions(path)]
    assert not long, f"{library}: functions over {FUNCTION_MAX_LINES} lines of code: {long}"


def test_the_layout_checks_see_what_they_forbid(tmp_path):
    """The checks catch a toolkit import inside a function, a relative import of the
    examples, and a demo module by its name."""
    mod = tmp_path / "mod.py"
    mod.write_text("def f():\n    from laminar_common.launch import tasks\n"
                   "from ..laminar_examples import tasks as t\n")
    graph = {"pkg.sub.mod": _absolute_imports(mod, "pkg.sub")}
    assert _importing(graph, "laminar_common.launch") == {
        "pkg.sub.mod": ["laminar_common.launch", "laminar_common.launch.tasks"]}
    assert _importing({"x": {"pkg.laminar_examples.tasks", "laminar_examples_other"}},
                      "laminar_examples") == {}
    assert _importing({"x": {"laminar_examples.tasks"}}, "laminar_examples") == {
        "x": ["laminar_examples.tasks"]}
    long = tmp_path / "long.py"
    long.write_text('def f():\n    """Doc."""\n' + "    x = 1\n" * 81 + "\n"
                    'def g():\n    """Doc."""\n' + "    x = 1\n" * 80)
    assert [f.split()[1] for f in _long_functions(long)] == ["f"]
