"""Property-test support for config loaders (needs the ``test`` extra: hypothesis).

Every tier's hostile-input tests feed its config loader arbitrary text, bytes,
mappings shaped like the config model, and ``--set`` strings, and check one
contract: the loader returns a complete, frozen model or raises
:class:`ConfigError` naming the unreadable file, the bad ``--set`` item or every
bad field path; no other exception escapes. This module holds the strategies
(derived from the pydantic model, so they follow it as fields change), that
check, and :func:`make_loader_tests`, which builds the standard property tests
for one model.

Imported only by tests; nothing in a tier imports it.
"""

from __future__ import annotations

import string
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from laminar_common.config import load_config
from laminar_common.errors import ConfigError
from laminar_common.testing.cli import (
    assert_completion,
    assert_help_lists_options,
    clear_laminar_env,
    complete,
    completion_script,
    option_envvars,
    run_fresh,
)

__all__ = [
    "assert_bad_field_named",
    "assert_bad_file_named",
    "assert_completion",
    "assert_help_lists_options",
    "assert_public_api",
    "clear_laminar_env",
    "complete",
    "completion_script",
    "option_envvars",
    "run_fresh",
    "assert_names_where",
    "check_load",
    "dotted_paths",
    "json_values",
    "make_loader_tests",
    "model_dicts",
    "overrides_for",
    "toml_texts_for",
]

json_scalars = (st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats()
                | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: (
    st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)
names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,10}", fullmatch=True)
override_values = st.sampled_from(
    ["0", "-1", "1", "2", "8", "3.5", "1e-3", "true", "null", "[a, b]", "{x: 1}", ".nan", ".inf",
     "''", "bad/name", "!!binary aGk=", "[", "{", "a: b: c", "x" * 300]
) | names | st.text(max_size=20)
toml_values = st.sampled_from(['1', '-1', '0', '"x"', 'true', '[1, 2]', '{a = 1}', '3.5', 'nan',
                               'inf', '1979-05-27', '"bad/name"']) | st.text(max_size=8)


def _submodels(annotation: object) -> list[type[BaseModel]]:
    candidates = (annotation, *typing.get_args(annotation))
    return [t for t in candidates if isinstance(t, type) and issubclass(t, BaseModel)]


def _rarely(usual: st.SearchStrategy, odd: st.SearchStrategy, one_in: int) -> st.SearchStrategy:
    """``odd`` about once in ``one_in`` draws, else ``usual``."""
    return st.integers(1, one_in).flatmap(lambda i: odd if i == 1 else usual)


def _fitting(annotation: object, depth: int) -> st.SearchStrategy:
    """Values of the annotated kind: often valid, sometimes out of bounds."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_fitting(a, depth) for a in args])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_dicts(annotation, depth - 1) if depth > 0 else st.just({})
    simple = {type(None): st.none(), bool: st.booleans(), int: st.integers(-1, 100),
              float: st.floats(0, 100), str: names}
    if annotation in simple:
        return simple[annotation]
    if origin is tuple:
        return st.lists(_fitting(args[0], depth), max_size=3)
    if origin is dict:
        return st.dictionaries(names, _fitting(args[1], depth), max_size=2)
    return json_values


def model_dicts(model: type[BaseModel], depth: int = 3) -> st.SearchStrategy[dict]:
    """Mappings shaped like ``model``: its field names (the required ones always) with values
    usually of the field's kind, sometimes any JSON-like value; now and then stray keys."""
    values = {name: _rarely(_fitting(info.annotation, depth), json_values, 8)
              for name, info in model.model_fields.items()}
    required = {name: values.pop(name) for name, info in model.model_fields.items()
                if info.is_required()}
    shaped = st.fixed_dictionaries(required, optional=values)
    stray = st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=2)
    return _rarely(shaped, st.builds(lambda d, extra: {**d, **extra}, shaped, stray), 6)


def dotted_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field path of ``model``, nested models included (``store.max_bytes``)."""
    out = []
    for name, info in model.model_fields.items():
        out.append(prefix + name)
        for sub in _submodels(info.annotation):
            out += dotted_paths(sub, f"{prefix}{name}.")
    return sorted(set(out))


def overrides_for(model: type[BaseModel]) -> st.SearchStrategy[list[str]]:
    """``--set`` items: mostly ``a.b=value`` on the model's own paths, some anything."""
    keys = (st.sampled_from(dotted_paths(model))
            | st.text(string.ascii_lowercase + "._", max_size=15))
    item = st.builds(lambda key, value: f"{key}={value}", keys, override_values)
    return st.lists(item | st.text(string.printable, max_size=30), max_size=4)


def toml_texts_for(model: type[BaseModel]) -> st.SearchStrategy[str]:
    """TOML-looking text: the model's table headers and keys with odd values."""
    paths = dotted_paths(model)
    keys = st.sampled_from([p.rsplit(".", 1)[-1] for p in paths]) | st.text(max_size=8)
    line = (st.sampled_from([f"[{p}]" for p in paths] + ["[[x]]", "[", "="])
            | st.builds(lambda key, value: f"{key} = {value}", keys, toml_values))
    return st.lists(line, max_size=8).map("\n".join)


Loader = Callable[[Path | None, list[str]], BaseModel]


def check_load(model: type[BaseModel], path: Path | None = None, items=(), *,
               load: Loader | None = None, origin: str | None = None) -> BaseModel | None:
    """Load through the real loader: a valid frozen model (returned), or a ConfigError that
    names where (None). Any other exception propagates and fails the test."""
    try:
        cfg = load(path, list(items)) if load else load_config(model, path, list(items), env={})
    except ConfigError as exc:
        assert_names_where(model, exc, path, items, origin)
        return None
    assert type(cfg) is model
    name = next(iter(model.model_fields))
    try:
        setattr(cfg, name, getattr(cfg, name))
    except ValidationError:
        pass  # frozen, as it must be
    else:
        raise AssertionError(f"{model.__name__} is not frozen")
    assert model.model_validate(cfg.model_dump()).model_dump_json() == cfg.model_dump_json()
    return cfg


def assert_names_where(model: type[BaseModel], exc: ConfigError, path, items,
                       origin: str | None = None) -> None:
    """The message names the unreadable file, the bad ``--set`` item, or every bad field path."""
    text = str(exc)
    cause = exc.__cause__
    if isinstance(cause, ValidationError):
        if origin is None:
            origin = "defaults and overrides" if path is None else f"file {str(path)!r}"
        assert text.startswith(f"invalid {model.__name__} ({origin}):"), text
        for err in cause.errors():
            loc = err["loc"]
            if loc and all(isinstance(p, int) or p.isidentifier() for p in loc):
                assert "\n  " + ".".join(map(str, loc)) + ": " in text, (loc, text)
            elif loc:  # odd keys may be quoted, but every part is there
                assert all(str(p) in text or repr(p) in text for p in loc), (loc, text)
            else:  # a whole-model check: its message names the field it is about
                assert any(name in err["msg"] for name in model.model_fields), text
        if all(err["loc"] for err in cause.errors()):
            assert "\n  <root>: " not in text, text
    elif path is not None and str(path) in text:
        return
    else:
        assert any(text.startswith(f"--set {item!r}") for item in items), text


def assert_bad_field_named(model: type[BaseModel], items, field: str) -> str:
    """``--set items`` on ``model`` fail with a :class:`ConfigError` whose list names
    ``field`` by its full path; returns the error text."""
    try:
        load_config(model, None, list(items), env={})
    except ConfigError as exc:
        text = str(exc)
    else:
        raise AssertionError(f"--set {list(items)} loaded as a {model.__name__}")
    assert f"\n  {field}: " in text, text
    return text


def assert_bad_file_named(model: type[BaseModel], path: Path, text: str,
                          lines: list[str]) -> str:
    """A config file ``path`` holding ``text`` fails with a :class:`ConfigError` that names
    the file and has each of ``lines`` (``"path: what"``, or its start) in its list;
    returns the error text."""
    path.write_text(text)
    try:
        load_config(model, path, env={})
    except ConfigError as exc:
        error = str(exc)
    else:
        raise AssertionError(f"{path} loaded as a {model.__name__}")
    assert str(path) in error, error
    for line in lines:
        assert f"\n  {line}" in error, (line, error)
    return error


def make_loader_tests(model: type[BaseModel], *, max_examples: int = 150,
                      load: Loader | None = None, origin: str | None = None,
                      good_text: str | None = None,
                      check: Callable[[Any], None] | None = None) -> dict[str, Callable]:
    """The standard hostile-input property tests for one config model, by test name
    (``test_any_text_file_<Model>`` ...).

    A test module takes them with ``globals().update(make_loader_tests(Model))``.
    ``load``/``origin`` replace the default loader (``load_config(model, path,
    items, env={})``) and the origin its errors name; ``good_text`` adds a test
    of arbitrary ``--set`` items on a valid file; ``check`` runs on every
    config that loads.
    """
    prop = settings(max_examples=max_examples, deadline=None)
    mappings, overrides, tomls = model_dicts(model), overrides_for(model), toml_texts_for(model)
    stem = model.__name__

    def run(path, items=()):
        cfg = check_load(model, path, items, load=load, origin=origin)
        if cfg is not None and check is not None:
            check(cfg)

    @prop
    @given(text=st.text(max_size=300), suffix=st.sampled_from([".yaml", ".toml"]))
    def test_any_text_file(tmp_path_factory, text, suffix):
        path = tmp_path_factory.getbasetemp() / f"{stem}-text{suffix}"
        path.write_text(text)
        run(path)

    @prop
    @given(raw=st.binary(max_size=200))
    def test_any_bytes_file(tmp_path_factory, raw):
        path = tmp_path_factory.getbasetemp() / f"{stem}-bytes.yaml"
        path.write_bytes(raw)
        run(path)

    @prop
    @given(text=tomls)
    def test_toml_shaped_text(tmp_path_factory, text):
        path = tmp_path_factory.getbasetemp() / f"{stem}-shaped.toml"
        path.write_text(text)
        run(path)

    @prop
    @given(data=mappings, items=overrides)
    def test_any_mapping_and_overrides(tmp_path_factory, data, items):
        path = tmp_path_factory.getbasetemp() / f"{stem}-mapping.yaml"
        path.write_text(yaml.safe_dump(data))
        run(path, items)

    tests = [test_any_text_file, test_any_bytes_file, test_toml_shaped_text,
             test_any_mapping_and_overrides]
    if good_text is not None:
        @prop
        @given(items=overrides)
        def test_any_overrides_on_a_good_file(tmp_path_factory, items):
            path = tmp_path_factory.getbasetemp() / f"{stem}-good.yaml"
            path.write_text(good_text)
            run(path, items)

        tests.append(test_any_overrides_on_a_good_file)
    else:
        @prop
        @given(items=overrides)
        def test_any_overrides(items):
            run(None, items)

        tests.append(test_any_overrides)
    return {f"{f.__name__}_{stem}": f for f in tests}


# -- command lines ---------------------------------------------------------------


def assert_public_api(package: str) -> None:
    """Every name in ``package.__all__`` imports (lazy ones included), none twice, and the
    package is typed (``py.typed``)."""
    import importlib

    module = importlib.import_module(package)
    assert module.__all__ and len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert (Path(module.__file__).parent / "py.typed").is_file()


def check_election_fencing(make: Callable[[], Any]) -> None:
    """The fencing contract every :class:`~laminar_common.membership.Coordinator` keeps
    (the etcd one and the in-memory twin run it): an election is held by the process
    that won it, not by its member id; only that process may publish a version fenced by
    it; a dead holder's lease can be revoked by value, never one's own.

    Args:
        make: returns a new, unregistered coordinator of one job each call.
    """
    from laminar_common.errors import FencedError
    from laminar_common.membership import MemberRecord, VersionRecord

    first, other = make(), make()
    first.register(MemberRecord(member_id="a", role="relay"))
    other.register(MemberRecord(member_id="b", role="relay"))
    assert first.campaign("master", "a") and first.owns("master")
    first.publish_version(VersionRecord(version=1), fence="master")
    assert not other.owns("master") and not other.evict_leader("master", "b")
    try:
        other.publish_version(VersionRecord(version=2), fence="master")
        raise AssertionError("a member that never won the election published under it")
    except FencedError:
        pass
    # The same member id, another process (a restart): not the holder.
    again = make()
    again.register(MemberRecord(member_id="a", role="relay"))
    assert again.leader("master") == "a" and not again.owns("master")
    holder, lease = again.election("master")
    assert holder == "a" and not again.evict_leader("master", "a", lease + 1), \
        "a lease other than the one named was revoked"
    assert again.evict_leader("master", "a", lease), "the earlier process's lease was not revoked"
    assert again.leader("master") is None and not again.evict_leader("master", "a")
    try:
        first.publish_version(VersionRecord(version=2), fence="master")
        raise AssertionError("a holder whose lease was revoked made a version visible")
    except FencedError:
        pass
    assert again.campaign("master", "a") and not again.evict_leader("master", "a")
    again.publish_version(VersionRecord(version=2), fence="master")
    assert other.latest_version().version == 2
    for coordinator in (first, other, again):
        coordinator.close()
