"""Environments of multi-turn trajectories: the API, the limits, the built-ins, the registry.

Owns :class:`Environment` (built once per trajectory from its prompt record;
``reset`` gives the first messages, ``step`` answers each assistant message
with observation messages, an optional reward and whether the conversation is
over), :class:`TurnLimits` (turns, tokens a turn and in all, time a tool call
may take), :class:`ToolEnvironment` (the Hermes tool-calling loop over a set
of :class:`~laminar_rollout.tools.Tool`), and :func:`make_environment`, which
builds one by registry name or ``module:Class``.

What it must not do: touch the engine or the decode loop. ``step`` blocks (a
tool call may take seconds), so the worker runs it in a pool and the
trajectory's decode slot is free meanwhile.

Invariants:

- One environment serves one trajectory; ``step`` is called with that
  trajectory's assistant messages in order, never concurrently.
- ``state()`` is JSON-serialisable and ``restore(state)`` on a fresh
  environment built from the same record continues the conversation where it
  stood (a migrated or recovered trajectory). An environment whose tools have
  side effects that must not run twice says so with ``replayable = False``
  and keeps what it needs in its state instead of re-running calls.
- ``step`` never raises for what the model wrote: a malformed or failing tool
  call is an observation.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from laminar_common.errors import ConfigError

from .tools import Tool, parse_tool_calls, run_tool_calls, tool_schemas

__all__ = ["Message", "TurnLimits", "EnvStep", "Environment", "ToolEnvironment",
           "SimulatedToolEnvironment",
           "ENVIRONMENTS", "make_environment", "conversation_so_far"]

Message = dict[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (a tool result adds ``"name"``)."""


@dataclass(frozen=True)
class TurnLimits:
    """Bounds of one multi-turn trajectory.

    Args:
        max_turns: assistant messages at most; the last one is final whatever it asks.
        max_tokens_per_turn: tokens one assistant message may generate.
        max_total_tokens: generated plus observation tokens of the whole response.
        tool_timeout_s: wall-clock time one tool call may take (then it is answered
            as timed out).

    Raises:
        ValueError: naming the offending field.
    """

    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 1024
    tool_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {self.tool_timeout_s!r}")


@dataclass
class EnvStep:
    """What an environment answers to one assistant message."""

    observations: list[Message] = field(default_factory=list)
    """Messages appended before the model's next turn (``tool`` results, a ``user`` nudge)."""
    reward: float | None = None
    """This turn's reward, if the environment gives per-turn rewards."""
    done: bool = False
    """The conversation is over (the message was a final answer, or a limit was hit)."""


class Environment(abc.ABC):
    """One trajectory's environment.

    Args:
        record: the prompt record (``messages`` and ``metadata`` as the manager
            sent them).
        limits: the trajectory's :class:`TurnLimits`.
    """

    replayable: ClassVar[bool] = True
    """Whether re-running the recorded tool calls rebuilds this environment (no side
    effect outside it); if not, :meth:`state` must hold everything needed to continue."""

    def __init__(self, record: Mapping[str, Any], limits: TurnLimits) -> None:
        self.record = record
        self.limits = limits
        self.turns = 0
        """Assistant messages answered so far."""

    def reset(self) -> list[Message]:
        """The conversation's first messages (default: the record's own)."""
        messages = self.record.get("messages")
        if messages:
            return [dict(m) for m in messages]
        return [{"role": "user", "content": str(self.record.get("prompt", ""))}]

    def tools(self) -> list[dict[str, Any]]:
        """Function descriptions for the chat template's ``tools=`` (default: none)."""
        return []

    def step(self, assistant: str) -> EnvStep:
        """Answer one assistant message; counts the turn and ends at ``max_turns``."""
        self.turns += 1
        result = self.respond(assistant)
        if self.turns >= self.limits.max_turns and not result.done:
            result.done = True
            result.observations = []  # nothing follows the last turn
        return result

    @abc.abstractmethod
    def respond(self, assistant: str) -> EnvStep:
        """What this environment says to ``assistant`` (the turn is already counted)."""

    def state(self) -> dict[str, Any]:
        """JSON-serialisable state to continue from elsewhere (see :meth:`restore`)."""
        return {"turns": self.turns}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state` of the same trajectory's environment."""
        self.turns = int(state.get("turns", 0))


class ToolEnvironment(Environment):
    """The tool-calling loop: an assistant message with ``<tool_call>`` blocks gets one
    ``tool`` message per call; one without any is the final answer.

    Args:
        tools: the tools the model may call, by name.
        pool: threads that run tool calls (shared by a worker's trajectories).
    """

    replayable = True  # the built-in tools keep nothing between calls

    def __init__(self, record: Mapping[str, Any], limits: TurnLimits,
                 tools: Mapping[str, Tool], pool: ThreadPoolExecutor) -> None:
        super().__init__(record, limits)
        self._tools = dict(tools)
        self._pool = pool
        self.calls = 0
        """Tool calls answered so far (errors included)."""

    def tools(self) -> list[dict[str, Any]]:
        return tool_schemas(self._tools)

    def respond(self, assistant: str) -> EnvStep:
        parsed = parse_tool_calls(assistant)
        if not parsed.has_calls:
            return EnvStep(done=True)
        self.calls += len(parsed.calls)
        return EnvStep(observations=run_tool_calls(parsed.calls, self._tools, self._pool,
                                                   self.limits.tool_timeout_s))

    def state(self) -> dict[str, Any]:
        return {**super().state(), "calls": self.calls}

    def restore(self, state: Mapping[str, Any]) -> None:
        super().restore(state)
        self.calls = int(state.get("calls", 0))


class SimulatedToolEnvironment(Environment):
    """Tool latency without a model or a sandbox, for scheduling benchmarks.

    Every assistant message is answered as if it called a tool: after a wait drawn
    from a log-normal distribution (``median_s``, p99 = ``tail_ratio`` x median,
    capped at the tool timeout) comes one ``tool`` message, for the trajectory's
    first ``tool_turns`` turns; the turn after those is final. The draws are keyed
    by the record's id and ``seed``, so a trajectory waits the same wherever it runs.
    """

    def __init__(self, record: Mapping[str, Any], limits: TurnLimits, median_s: float = 0.05,
                 tail_ratio: float = 10.0, tool_turns: int = 2, seed: int = 0) -> None:
        import math
        import zlib

        import numpy as np

        super().__init__(record, limits)
        if median_s < 0 or tail_ratio < 1 or tool_turns < 0:
            raise ConfigError(f"simulated environment: median_s {median_s} >= 0, tail_ratio "
                              f"{tail_ratio} >= 1 and tool_turns {tool_turns} >= 0 required")
        self.tool_turns = int(tool_turns)
        self.waited_s = 0.0
        rng = np.random.default_rng([seed, zlib.crc32(str(record.get("id", "")).encode())])
        sigma = math.log(tail_ratio) / 2.3263 if tail_ratio > 1 else 0.0
        self._waits = [min(float(median_s * math.exp(sigma * rng.standard_normal())),
                           limits.tool_timeout_s) for _ in range(self.tool_turns)]

    def respond(self, assistant: str) -> EnvStep:
        import time

        if self.turns > self.tool_turns:
            return EnvStep(done=True)
        wait = self._waits[self.turns - 1]
        time.sleep(wait)
        self.waited_s += wait
        return EnvStep(observations=[{"role": "tool", "name": "simulated",
                                      "content": f"result {self.turns} after {wait:.3f}s"}])


ENVIRONMENTS: dict[str, type[Environment]] = {"tools": ToolEnvironment,
                                              "simulated": SimulatedToolEnvironment}
"""Built-in environments by the name a config gives (``env: tools``)."""


def make_environment(spec: str, record: Mapping[str, Any], limits: TurnLimits,
                     **kwargs: Any) -> Environment:
    """Build the environment ``spec`` names for one trajectory.

    Args:
        spec: a name in :data:`ENVIRONMENTS` or ``package.module:Class`` (an
            :class:`Environment` subclass).
        record: the trajectory's prompt record.
        limits: its turn limits.
        **kwargs: what that class's constructor takes besides those two.

    Raises:
        ConfigError: the name is unknown, the module or class cannot be loaded, or
            it is not an Environment.
    """
    cls = _environment_class(spec)
    return cls(record, limits, **kwargs)


def _environment_class(spec: str) -> type[Environment]:
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec]
    if ":" not in spec:
        raise ConfigError(f"environment {spec!r}: not a built-in ({', '.join(ENVIRONMENTS)}) "
                          "and not module:Class")
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"environment {spec!r}: cannot load it ({exc})") from exc
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"environment {spec!r} is not a laminar_rollout.environments."
                          "Environment subclass")
    return cls


def conversation_so_far(initial: Sequence[Message], turns: Sequence[tuple[str, list[Message]]]
                        ) -> list[Message]:
    """The messages after ``turns`` (each an assistant message and its observations)."""
    out = [dict(m) for m in initial]
    for assistant, observations in turns:
        out.append({"role": "assistant", "content": assistant})
        out.extend(dict(m) for m in observations)
    return out
