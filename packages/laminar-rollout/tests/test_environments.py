"""Environments: the tool-calling loop, turn limits, state for migration, the registry."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from laminar_common.errors import ConfigError
from laminar_rollout.environments import (
    Environment,
    EnvStep,
    ToolEnvironment,
    TurnLimits,
    conversation_so_far,
    make_environment,
)
from laminar_rollout.tools import Tool

RECORD = {"messages": [{"role": "user", "content": "what is 123*456?"}],
          "metadata": {"answer": "56088"}}


class _Mul(Tool):
    name = "mul"
    description = "multiply"
    parameters = {"type": "object"}

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def call(self, arguments):
        self.seen.append(dict(arguments))
        return str(arguments["a"] * arguments["b"])


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as p:
        yield p


def test_a_tool_turn_then_a_final_answer(pool):
    mul = _Mul()
    env = make_environment("tools", RECORD, TurnLimits(max_turns=4), tools={"mul": mul},
                           pool=pool)
    assert env.reset() == RECORD["messages"]
    assert env.tools()[0]["function"]["name"] == "mul"
    first = env.step('<tool_call>{"name": "mul", "arguments": {"a": 123, "b": 456}}'
                     "</tool_call>")
    assert not first.done
    assert first.observations == [{"role": "tool", "name": "mul", "content": "56088"}]
    final = env.step("The answer is 56088.")
    assert final.done and final.observations == []
    assert env.turns == 2 and env.calls == 1 and mul.seen == [{"a": 123, "b": 456}]
    convo = conversation_so_far(env.reset(), [("<tool_call>...</tool_call>",
                                               first.observations)])
    assert [m["role"] for m in convo] == ["user", "assistant", "tool"]


def test_the_last_allowed_turn_ends_the_conversation_whatever_it_asks(pool):
    mul = _Mul()
    env = ToolEnvironment(RECORD, TurnLimits(max_turns=2), {"mul": mul}, pool)
    call = '<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert not env.step(call).done
    last = env.step(call)
    assert last.done and last.observations == []


def test_a_malformed_call_is_an_observation_not_a_crash(pool):
    env = ToolEnvironment(RECORD, TurnLimits(), {"mul": _Mul()}, pool)
    step = env.step("<tool_call>{mul(2, 3)}</tool_call>")
    assert not step.done
    assert step.observations[0]["content"].startswith("error: tool call 0 is not valid JSON")


def test_state_moves_a_conversation_to_a_fresh_environment(pool):
    env = ToolEnvironment(RECORD, TurnLimits(max_turns=3), {"mul": _Mul()}, pool)
    env.step('<tool_call>{"name": "mul", "arguments": {"a": 1, "b": 1}}</tool_call>')
    env.step('<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 2}}</tool_call>')
    moved = ToolEnvironment(RECORD, TurnLimits(max_turns=3), {"mul": _Mul()}, pool)
    moved.restore(env.state())
    assert moved.state() == {"turns": 2, "calls": 2}
    # Its third turn is the last one allowed, as it would have been before the move.
    assert moved.step('<tool_call>{"name": "mul", "arguments": {"a": 3, "b": 3}}'
                      "</tool_call>").done


class Echo(Environment):
    """A user-defined environment loaded by module:Class."""

    def respond(self, assistant):
        return EnvStep([{"role": "user", "content": assistant.upper()}], reward=0.5,
                       done=assistant == "bye")


def test_registry_and_module_class_specs():
    env = make_environment(f"{__name__}:Echo", {"prompt": "hi"}, TurnLimits())
    assert env.reset() == [{"role": "user", "content": "hi"}]
    step = env.step("hello")
    assert step.observations[0]["content"] == "HELLO" and step.reward == 0.5
    assert env.step("bye").done
    for spec, says in (("nope", "not a built-in"), ("no_such_mod:X", "cannot load"),
                       (f"{__name__}:RECORD", "not a laminar_rollout")):
        with pytest.raises(ConfigError, match=says):
            make_environment(spec, RECORD, TurnLimits())


@pytest.mark.parametrize("field, value", [("max_turns", 0), ("max_tokens_per_turn", 1.5),
                                          ("max_total_tokens", True), ("tool_timeout_s", 0)])
def test_limits_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        TurnLimits(**{field: value})
