"""Tool calls in the Hermes / Qwen2.5 format, and the tools a trajectory may call.

Owns reading ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
out of an assistant message (:func:`parse_tool_calls`), the :class:`Tool`
interface (a name, a description, JSON-schema parameters, ``call(arguments) ->
str``), the built-in :class:`PythonTool` (code run in a
:class:`~laminar_rollout.sandbox.CodeSandbox`), and running a message's calls
into ``tool`` messages (:func:`run_tool_calls`) that the chat template renders
back to the model.

Invariant: nothing the model writes raises. A malformed call (not JSON, nested
deeper than ``MAX_JSON_DEPTH``, a number Python will not convert, no name,
arguments that are not an object, an unclosed tag, an unknown tool, too many
calls, a tool that fails or overruns its time) becomes a ``tool`` message saying
what was wrong, which the model sees on its next turn; every name and message
handed back is UTF-8 encodable (lone surrogates replaced).
"""

from __future__ import annotations

import abc
import json
import logging
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "ToolCallError", "ParsedMessage", "parse_tool_calls", "Tool",
           "PythonTool", "run_tool_calls", "tool_schemas", "encodable", "MAX_CALLS",
           "MAX_CALL_CHARS", "MAX_JSON_DEPTH"]

log = logging.getLogger(__name__)

MAX_CALLS = 8
"""Tool calls run from one assistant message; later ones are answered with an error."""
MAX_CALL_CHARS = 65536
"""Longest JSON body of one call."""

MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects read in a call (deeper: an error, not a
RecursionError)."""
MAX_NAME_CHARS = 128
"""Longest tool name echoed back in an error."""

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def encodable(text: str) -> str:
    """``text`` with anything UTF-8 cannot hold (lone surrogates) replaced, so that model
    text can be re-encoded, logged and tokenized without raising."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _json_depth(text: str) -> int:
    """Deepest nesting of ``[`` / ``{`` in ``text``, brackets inside strings ignored."""
    depth = deepest = 0
    for match in _NESTING.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def _load_json(text: str) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, why)`` for text that is not JSON Laminar reads: too
    deep, a number Python refuses to convert (over 4,300 digits), or not JSON at all."""
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        return None, f"nested {depth} deep (at most {MAX_JSON_DEPTH})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at character {exc.pos}"
    except (ValueError, RecursionError) as exc:  # huge integers; depth the scan missed
        return None, f"{type(exc).__name__}: {str(exc)[:120]}"


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its arguments object."""

    name: str
    arguments: Mapping[str, Any]
    index: int
    """Its position among the message's calls (0-based), for ids and error text."""


@dataclass(frozen=True)
class ToolCallError:
    """A block that is not a usable call, and why (what the model is told)."""

    index: int
    message: str
    name: str = ""


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message split into its prose and its calls, in order."""

    content: str
    """The message without its ``<tool_call>`` blocks (stripped)."""
    calls: tuple[ToolCall | ToolCallError, ...] = field(default_factory=tuple)

    @property
    def has_calls(self) -> bool:
        """Whether the model asked for any tool (well-formed or not)."""
        return bool(self.calls)


def _parse_one(index: int, body: str) -> ToolCall | ToolCallError:
    if len(body) > MAX_CALL_CHARS:
        return ToolCallError(index, f"tool call {index} is {len(body)} characters long; at "
                                    f"most {MAX_CALL_CHARS} are read")
    obj, why = _load_json(body)
    if why is not None:
        return ToolCallError(index, f"tool call {index} is not valid JSON ({why}); write "
                                    '{"name": ..., "arguments": {...}}')
    if not isinstance(obj, dict):
        return ToolCallError(index, f"tool call {index} is a JSON {type(obj).__name__}, not "
                                    'an object {"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(index, f'tool call {index} has no "name" string')
    name = encodable(name.strip())
    if len(name) > MAX_NAME_CHARS:
        return ToolCallError(index, f"tool call {index}: a tool name of {len(name)} "
                                    f"characters (at most {MAX_NAME_CHARS})")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments JSON-encoded once more
        if arguments.strip():
            arguments, why = _load_json(arguments)
            if why is not None:
                return ToolCallError(index, f'tool call {index} ({name}): "arguments" is a '
                                            f"string that is not a JSON object ({why})", name)
        else:
            arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(index, f'tool call {index} ({name}): "arguments" must be an '
                                    f"object, got {type(arguments).__name__}", name)
    return ToolCall(name, arguments, index)


def parse_tool_calls(text: str, max_calls: int = MAX_CALLS) -> ParsedMessage:
    """Split an assistant message into prose and Hermes-format tool calls.

    Every ``<tool_call>...</tool_call>`` block is one call; an opening tag with
    no closing one (a generation cut mid-call) is an error entry; calls past
    ``max_calls`` are error entries. Never raises.
    """
    calls: list[ToolCall | ToolCallError] = []
    prose: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        prose.append(text[pos:match.start()])
        pos = match.end()
        index = len(calls)
        if index >= max_calls:
            calls.append(ToolCallError(index, f"tool call {index} was not run: at most "
                                              f"{max_calls} calls a turn"))
            continue
        calls.append(_parse_one(index, match.group(1).strip()))
    rest = text[pos:]
    cut = rest.find(_OPEN)
    if cut >= 0:
        calls.append(ToolCallError(len(calls), f"tool call {len(calls)} has no closing "
                                               "</tool_call> tag"))
        rest = rest[:cut]
    prose.append(rest)
    return ParsedMessage("".join(prose).strip(), tuple(calls))


class Tool(abc.ABC):
    """A function the model may call: what it is, and running it.

    ``call`` runs off the decode loop (in the worker's tool pool), may block
    up to the environment's per-call timeout, and returns the text the model
    sees. It raises only :class:`ValueError` for arguments it cannot use (the
    message is shown to the model); anything else it raises is reported to
    the model as a tool failure and logged.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object."""

    @abc.abstractmethod
    def call(self, arguments: Mapping[str, Any]) -> str: ...

    def schema(self) -> dict[str, Any]:
        """The OpenAI / Hermes function description chat templates take as ``tools``."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": dict(self.parameters)}}


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The ``tools=`` list for ``apply_chat_template``, in name order."""
    return [tools[name].schema() for name in sorted(tools)]


class PythonTool(Tool):
    """Runs a Python snippet in a sandbox and answers with what it printed.

    Args:
        sandbox: anything with ``run(code) -> SandboxResult``
            (:class:`~laminar_rollout.sandbox.CodeSandbox`).
        name: the tool's name as the model calls it.
    """

    description = ("Run Python 3 code in a fresh sandbox (no network, no files kept) and "
                   "return what it prints. Print the values you need.")
    parameters = {"type": "object", "required": ["code"],
                  "properties": {"code": {"type": "string",
                                          "description": "the Python source to run"}}}

    def __init__(self, sandbox: Any, name: str = "python") -> None:
        self.sandbox = sandbox
        self.name = name

    def call(self, arguments: Mapping[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ValueError('python needs {"code": "<source>"}')
        result = self.sandbox.run(code)
        parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
        if result.timed_out:
            parts.append(f"[timed out after {result.duration_s:.1f}s]")
        elif result.exit_code not in (0, None) or result.killed_by:
            err = result.stderr.strip()
            why = f"killed by {result.killed_by}" if result.killed_by else \
                f"exit code {result.exit_code}"
            parts.append(f"[{why}]" + (f"\n{err}" if err else ""))
        return "\n".join(parts) if parts else "[no output]"


def run_tool_calls(calls: Sequence[ToolCall | ToolCallError], tools: Mapping[str, Tool],
                   pool: ThreadPoolExecutor, timeout_s: float) -> list[dict[str, str]]:
    """Run a message's calls (concurrently, each within ``timeout_s``) into ``tool``
    messages, in the calls' order. Never raises for what a call or a tool does.

    A call that overruns is answered as timed out and left to finish in ``pool``
    (a thread cannot be killed; the sandbox bounds a Python call's own time).
    """
    futures: dict[int, Future[str]] = {}
    for call in calls:
        if isinstance(call, ToolCall) and call.name in tools:
            futures[call.index] = pool.submit(tools[call.name].call, call.arguments)
    out = []
    for call in calls:
        name = call.name
        if isinstance(call, ToolCallError):
            content = f"error: {call.message}"
        elif name not in tools:
            content = (f"error: tool call {call.index} names unknown tool {name!r}; tools: "
                       f"{', '.join(sorted(tools)) or 'none'}")
        else:
            try:
                content = futures[call.index].result(timeout=timeout_s)
            except FutureTimeout:
                content = f"error: {name} did not answer within {timeout_s:g}s"
            except ValueError as exc:
                content = f"error: {exc}"
            except Exception as exc:  # noqa: BLE001 - a tool's own failure is the model's answer
                log.warning("tool %s failed on call %d: %s", name, call.index, exc,
                            exc_info=True)
                content = f"error: {name} failed ({type(exc).__name__}: {exc})"
        out.append({"role": "tool", "name": encodable(name or ""),
                    "content": encodable(content)})
    return out
