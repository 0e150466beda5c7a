"""The shape of laminar-common: a core plus ``relay``, ``launch``, ``consume``, ``data`` and
``testing`` (test support, which may use any part and which no library module imports),
no cycles.

Reads every module's imports (module level and inside functions) with ``ast``, so the
check holds for lazy imports too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import laminar_common

ROOT = Path(laminar_common.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if "proto" in path.parts:
            continue
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                if base.startswith("laminar_common"):
                    deps.add(base)
                    deps.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("laminar_common"))
        graph[name] = deps
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
