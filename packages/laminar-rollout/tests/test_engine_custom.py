"""``engine: {type: custom, factory: "pkg.mod:fn"}``: a user's own GenerationEngine."""

from __future__ import annotations

import textwrap

import pytest

from laminar_common.config import load_config
from laminar_common.errors import ConfigError
from laminar_rollout.config import CustomEngineConfig, WorkerConfig
from laminar_rollout.engines import (
    EngineError,
    GenerationRequest,
    SamplingParams,
    SimulatedEngine,
    make_engine,
    make_engine_from_config,
)

USER_MODULE = '''
from laminar_rollout.engines import SimulatedEngine


class MyEngine(SimulatedEngine):
    """Stands in for a user's engine (any GenerationEngine subclass)."""


def make(max_batch=2, greeting="hi"):
    engine = MyEngine(max_batch=max_batch)
    engine.greeting = greeting
    return engine


def not_an_engine():
    return object()


def broken():
    raise RuntimeError("no GPU here")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_engines.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_engines"


def _config(*items: str) -> WorkerConfig:
    return load_config(WorkerConfig, None, ["engine.type=custom", *items], env={})


def test_the_factory_builds_the_engine_with_its_options(user_module):
    config = _config(f"engine.factory={user_module}:make", "engine.options.max_batch=3",
                     "engine.options.greeting=hello")
    assert isinstance(config.engine, CustomEngineConfig)
    engine = make_engine_from_config(config.engine)
    assert type(engine).__name__ == "MyEngine" and isinstance(engine, SimulatedEngine)
    assert engine.load().max_batch == 3 and engine.greeting == "hello"
    [out] = engine.run_until_done([GenerationRequest("r", [1, 2], SamplingParams(max_tokens=4))])
    assert out.token_ids and out.policy_version == engine.weight_version


def test_a_malformed_factory_is_refused_when_the_config_loads():
    for spec in ("nocolon", "pkg.mod:", ":fn", "pkg mod:fn", "pkg..mod:fn"):
        with pytest.raises(ConfigError) as info:
            _config(f"engine.factory={spec}")
        assert "\n  engine.custom.factory: " in str(info.value)
    with pytest.raises(ConfigError) as info:
        _config()
    assert "\n  engine.custom.factory: " in str(info.value)


@pytest.mark.parametrize(("factory", "options", "field", "words"), [
    ("no_such_module_for_laminar:make", {}, "engine.factory", "cannot import"),
    ("raises_on_import:make", {}, "engine.factory", "boom at import"),
    ("{mod}:missing", {}, "engine.factory", "no callable 'missing'"),
    ("{mod}:not_an_engine", {}, "engine.factory", "not a GenerationEngine"),
    ("{mod}:make", {"max_bacth": 3}, "engine.options", "max_bacth"),
])
def test_a_bad_factory_is_a_config_error_naming_the_field(user_module, factory, options, field,
                                                         words):
    config = _config(f"engine.factory={factory.format(mod=user_module)}")
    config = config.model_copy(update={"engine": config.engine.model_copy(
        update={"options": options})})
    with pytest.raises(ConfigError) as info:
        make_engine_from_config(config.engine)
    assert str(info.value).startswith(field) and words in str(info.value)


def test_a_failing_factory_is_an_engine_error(user_module):
    with pytest.raises(EngineError, match="no GPU here"):
        make_engine("custom", factory=f"{user_module}:broken")
    with pytest.raises(ConfigError, match="engine.factory"):
        make_engine("custom")
