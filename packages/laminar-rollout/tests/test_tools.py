"""Hermes / Qwen2.5 tool calls: parsing (valid, malformed, several) and running them into
``tool`` messages without ever raising for what the model wrote."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_rollout.tools import (
    MAX_CALLS,
    Tool,
    ToolCall,
    ToolCallError,
    parse_tool_calls,
    run_tool_calls,
    tool_schemas,
)


def test_one_valid_call_and_the_prose_around_it():
    msg = ('Let me compute.\n<tool_call>\n{"name": "python", "arguments": '
           '{"code": "print(6*7)"}}\n</tool_call>')
    parsed = parse_tool_calls(msg)
    assert parsed.content == "Let me compute."
    assert parsed.calls == (ToolCall("python", {"code": "print(6*7)"}, 0),)


def test_several_calls_keep_their_order_and_string_arguments_are_decoded():
    msg = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
           '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
           '<tool_call>{"name": "c"}</tool_call>')
    parsed = parse_tool_calls(msg)
    assert [(c.name, dict(c.arguments), c.index) for c in parsed.calls] == \
        [("a", {"x": 1}, 0), ("b", {"y": [2]}, 1), ("c", {}, 2)]
    assert parsed.content == "and"


def test_no_call_is_a_final_answer():
    parsed = parse_tool_calls("The answer is 42.")
    assert not parsed.has_calls and parsed.content == "The answer is 42."


@pytest.mark.parametrize("body, says", [
    ("{not json}", "is not valid JSON"),
    ('["python"]', "is a JSON list"),
    ('{"arguments": {}}', 'has no "name"'),
    ('{"name": "  "}', 'has no "name"'),
    ('{"name": "python", "arguments": [1]}', '"arguments" must be an object'),
    ('{"name": "python", "arguments": "nope"}', "not a JSON object"),
])
def test_malformed_calls_are_errors_that_say_why(body, says):
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    [err] = parsed.calls
    assert isinstance(err, ToolCallError) and says in err.message, err


def test_an_unclosed_call_and_too_many_calls_are_errors():
    cut = parse_tool_calls('ok <tool_call>{"name": "python", "argu')
    assert cut.content == "ok"
    assert isinstance(cut.calls[0], ToolCallError) and "no closing" in cut.calls[0].message
    many = parse_tool_calls('<tool_call>{"name": "a"}</tool_call>' * (MAX_CALLS + 2))
    assert all(isinstance(c, ToolCall) for c in many.calls[:MAX_CALLS])
    assert all(isinstance(c, ToolCallError) and f"at most {MAX_CALLS}" in c.message
               for c in many.calls[MAX_CALLS:])
    assert len(many.calls) == MAX_CALLS + 2


class _Add(Tool):
    name = "add"
    description = "add two numbers"
    parameters = {"type": "object", "properties": {"a": {"type": "number"},
                                                   "b": {"type": "number"}}}

    def call(self, arguments):
        if not {"a", "b"} <= set(arguments):
            raise ValueError("add needs a and b")
        return str(arguments["a"] + arguments["b"])


class _Slow(Tool):
    name = "slow"
    description = "never answers in time"
    parameters = {"type": "object"}

    def __init__(self) -> None:
        self.release = threading.Event()

    def call(self, arguments):
        self.release.wait(10)
        return "late"


class _Broken(Tool):
    name = "broken"
    description = "fails"
    parameters = {"type": "object"}

    def call(self, arguments):
        raise RuntimeError("disk on fire")


def test_running_calls_answers_every_one_in_order_and_never_raises():
    slow = _Slow()
    tools = {"add": _Add(), "slow": slow, "broken": _Broken()}
    msg = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
           '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
           '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
           "<tool_call>{oops}</tool_call>"
           '<tool_call>{"name": "broken"}</tool_call>'
           '<tool_call>{"name": "slow"}</tool_call>')
    with ThreadPoolExecutor(4) as pool:
        out = run_tool_calls(parse_tool_calls(msg).calls, tools, pool, timeout_s=0.5)
        slow.release.set()
    assert [m["role"] for m in out] == ["tool"] * 6
    contents = [m["content"] for m in out]
    assert contents[0] == "5"
    assert contents[1] == "error: add needs a and b"
    assert "unknown tool 'nope'" in contents[2] and "add, broken, slow" in contents[2]
    assert contents[3].startswith("error: tool call 3 is not valid JSON")
    assert contents[4] == "error: broken failed (RuntimeError: disk on fire)"
    assert contents[5] == "error: slow did not answer within 0.5s"
    assert [m["name"] for m in out] == ["add", "add", "nope", "", "broken", "slow"]


def test_tool_schemas_are_the_function_descriptions_chat_templates_take():
    [schema] = tool_schemas({"add": _Add()})
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "add two numbers", "parameters": _Add.parameters}}


def test_the_python_tool_runs_in_the_sandbox_and_reports_failures():
    from laminar_rollout.sandbox import CodeSandbox, SandboxLimits
    from laminar_rollout.tools import PythonTool

    tool = PythonTool(CodeSandbox(SandboxLimits(wall_s=2, cpu_s=2)))
    msg = '<tool_call>{"name": "python", "arguments": {"code": "print(123*456)"}}</tool_call>'
    with ThreadPoolExecutor(2) as pool:
        [ok] = run_tool_calls(parse_tool_calls(msg).calls, {"python": tool}, pool, 10)
        assert ok == {"role": "tool", "name": "python", "content": "56088"}
        assert tool.call({"code": "print('a')\nraise KeyError('b')"}).startswith(
            "a\n[exit code 1]\nTraceback")
        assert tool.call({"code": "import time; time.sleep(30)"}).startswith("[timed out after")
        assert tool.call({"code": "x = 1"}) == "[no output]"
        with pytest.raises(ValueError, match="python needs"):
            tool.call({"source": "print(1)"})


# -- hostile model text: nothing raises, everything handed back is encodable ---------

_DEEP = "[" * 3000 + "]" * 3000


@pytest.mark.parametrize("body, says", [
    (_DEEP, "nested 3000 deep"),
    ('{"name": "python", "arguments": ' + "[" * 3000 + "]" * 3000 + "}", "nested 3001 deep"),
    ('{"name": "python", "arguments": "' + "[" * 3000 + '"}', '"arguments" is a string'),
    ('{"name": "python", "arguments": {"n": ' + "9" * 5000 + "}}", "4300 digits"),
])
def test_deep_json_and_huge_numbers_are_tool_errors_not_exceptions(body, says):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>").calls
    assert isinstance(call, ToolCallError) and says in call.message


def test_a_lone_surrogate_in_a_tool_name_comes_back_encodable():
    parsed = parse_tool_calls('<tool_call>{"name": "\\ud800py", "arguments": {}}</tool_call>')
    with ThreadPoolExecutor(1) as pool:
        (msg,) = run_tool_calls(parsed.calls, {}, pool, 1.0)
    assert "unknown tool" in msg["content"]
    msg["content"].encode("utf-8")
    msg["name"].encode("utf-8")


class _Echo(Tool):
    name = "echo"
    description = "echo"
    parameters = {"type": "object"}

    def call(self, arguments):
        return json.dumps(arguments, ensure_ascii=False)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_arbitrary_text_never_raises(text):
    parsed = parse_tool_calls(text + "<tool_call>" + text + "</tool_call>" + text)
    with ThreadPoolExecutor(1) as pool:
        for msg in run_tool_calls(parsed.calls, {"echo": _Echo()}, pool, 5.0):
            msg["content"].encode("utf-8")
            msg["name"].encode("utf-8")


@settings(max_examples=200, deadline=None)
@given(_json_values, st.text(max_size=20))
def test_arbitrary_json_never_raises(value, name):
    for body in (json.dumps({"name": name, "arguments": value}),
                 json.dumps({"name": name, "arguments": json.dumps(value)}),
                 json.dumps(value)):
        parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
        assert len(parsed.calls) == 1
        with ThreadPoolExecutor(1) as pool:
            (msg,) = run_tool_calls(parsed.calls, {"echo": _Echo()}, pool, 5.0)
        msg["content"].encode("utf-8")
