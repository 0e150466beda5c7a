"""Multi-turn trajectories on a worker: one conversation per trajectory between its turns.

Owns what a worker keeps of each multi-turn trajectory (:class:`Conversations`):
its environment, the messages so far, every response token (the model's and
the environment's), the behaviour log-probs of the generated ones and the
observation spans. When a turn ends, the environment's ``step`` runs in a
thread pool (the trajectory holds no decode slot meanwhile); its observations
are rendered by the chat template (``Tokenizer.encode_observation``) and the
conversation goes back to the engine as a resumed request (prompt plus every
response token so far, same policy version) for the next turn. A conversation
ends when the environment says so, at ``max_turns``, when the total token
budget is spent, or when a turn is cut at its token limit; it is then handed
back as a :class:`Completed` for scoring.

What it must not do: talk to the manager, the trainer or the relay; decide when
weights change. The worker asks :attr:`Conversations.busy` and pulls weights
only when no conversation is between turns, so one policy version produces
every turn.

Invariants: ``observation_spans`` are in order, disjoint and never at the
response's start; ``behaviour_logprobs`` holds one value per generated token.

Moving: a trajectory whose request is in the engine may be exported (repack);
past its first turn it leaves with a
:class:`~laminar_common.codec.ConversationState` (spans, messages, the
environment's ``state()``, rewards so far) and another worker of the same
version continues it (:meth:`Conversations.begin`) — no tool call is run again.
One waiting on its environment is never exported. A trajectory past its first
turn sends no partial progress (:meth:`Conversations.pinned`): lost with its
worker, it resumes from its last export, or is generated again from its first
turn.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from laminar_common.codec import ConversationState, PromptTask
from laminar_common.errors import ConfigError

from .engines import GenerationOutput, GenerationRequest, KVState, SamplingParams
from .environments import Environment, EnvStep, Message, TurnLimits
from .tokenizer import Tokenizer
from .tools import encodable

__all__ = ["Completed", "Conversations", "make_conversations"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completed:
    """A finished trajectory's tokens, ready to be scored and pushed."""

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int
    text: str
    """What the reward function scores: the completion (single turn) or the final
    assistant message (multi-turn)."""
    completion: str
    """The whole response as text (samples, logs)."""
    simulated: bool = False
    observation_spans: tuple[tuple[int, int], ...] = ()
    env_reward: float = 0.0
    """The environment's per-turn rewards, summed (added to the reward function's)."""
    turns: int = 1

    @classmethod
    def single_turn(cls, out: GenerationOutput, text: str) -> Completed:
        return cls(tuple(out.prompt_token_ids), tuple(out.token_ids), tuple(out.logprobs),
                   out.finish_reason, out.policy_version, text, text, out.simulated)


@dataclass
class _Conversation:
    task: PromptTask
    env: Environment
    messages: list[Message]
    tools: list[dict[str, Any]]
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """One per generated token."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    env_reward: float = 0.0
    policy_version: int = -1
    simulated: bool = False
    last_text: str = ""
    pending: Future[EnvStep] | None = None
    stop_id: int | None = None
    turns: int = 0
    turn_start: int = 0
    """Where the current turn's tokens begin in ``response``."""
    kv: KVState | None = None
    """The cache the engine handed back at the end of the last turn (next turn's prefix)."""


class Conversations:
    """The multi-turn trajectories of one worker (see module docstring).

    Args:
        tokenizer: the worker's tokenizer (renders prompts and observations).
        make_env: builds a trajectory's environment from its record.
        limits: turn limits of every trajectory.
        workers: threads running environment steps.
        reuse_kv: continue each turn from the previous turn's cache (see
            :attr:`reuse_kv`); the first turn's request must ask for it too
            (``keep_kv``).
    """

    def __init__(self, tokenizer: Tokenizer, make_env: Callable[[Mapping[str, Any]], Environment],
                 limits: TurnLimits, workers: int = 4, reuse_kv: bool = False) -> None:
        self.tokenizer = tokenizer
        self.reuse_kv = reuse_kv
        """Ask the engine for each turn's cache and hand it to the next turn, so only the
        tool results are prefilled (engines with ``supports_kv_transfer``)."""
        self.make_env = make_env
        self.limits = limits
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="env-step")
        self._convs: dict[str, _Conversation] = {}
        self.counters: dict[str, int] = {"turns": 0, "env_steps": 0, "env_errors": 0}
        self.env_error_reasons: collections.Counter[str] = collections.Counter()
        """Environment errors by where and what (``step:KeyError``, ``next_turn:...``)."""

    # -- what the worker asks ----------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a conversation is between turns or past its first one (no weight change)."""
        return any(c.pending is not None or c.spans for c in self._convs.values())

    def waiting(self) -> list[str]:
        """Trajectories waiting on their environment (held by the worker, not the engine)."""
        return [tid for tid, c in self._convs.items() if c.pending is not None]

    def pinned(self, trajectory_id: str) -> bool:
        """Past its first turn: not exportable, no partial progress (see module docstring)."""
        conv = self._convs.get(trajectory_id)
        return conv is not None and bool(conv.spans)

    # -- the turns -------------------------------------------------------------

    def begin(self, task: PromptTask) -> tuple[list[int], int]:
        """A trajectory's environment and prompt: ``(prompt ids, max tokens for the
        request``, resumed tokens included). A resumed first turn starts a fresh
        environment; a migrated conversation (``task.conversation``) restores its
        environment's state, messages, spans and log-probs and continues its turn.

        Raises:
            ConfigError: the environment cannot be built for this record, or a migrated
                conversation's spans do not fit its tokens.
        """
        record = {"prompt": task.prompt, "messages": [dict(m) for m in task.messages],
                  "metadata": dict(task.metadata), "id": task.trajectory_id}
        env = self.make_env(record)
        messages = env.reset()
        tools = env.tools()
        # A migrated trajectory keeps the prompt ids its tokens were generated after.
        ids = list(task.prompt_token_ids) or \
            self.tokenizer.encode_prompt(messages, tools=tools or None)
        conv = _Conversation(task, env, messages, tools, ids)
        state = task.conversation
        if state is not None:
            env.restore(state.env_state)
            conv.messages = [dict(m) for m in state.messages]
            conv.spans = [tuple(span) for span in state.observation_spans]
            conv.response = list(task.resume_token_ids)
            observed = _observed(conv.spans, len(conv.response))
            if observed is None or len(task.resume_logprobs) != len(conv.response):
                raise ConfigError(f"{task.trajectory_id}: its conversation's observation "
                                  f"spans {state.observation_spans} do not fit its "
                                  f"{len(conv.response)} resumed tokens")
            conv.logprobs = [lp for i, lp in enumerate(task.resume_logprobs)
                             if i not in observed]
            conv.env_reward, conv.turns = state.env_reward, state.turns - 1
            conv.turn_start = conv.spans[-1][1] if conv.spans else 0
            conv.policy_version = task.policy_version
        elif task.resume_token_ids:  # a first turn that moved: its tokens so far
            conv.response = list(task.resume_token_ids)
            conv.logprobs = list(task.resume_logprobs)
            conv.policy_version = task.policy_version
        self._convs[task.trajectory_id] = conv
        budget = min(self.limits.max_tokens_per_turn - (len(conv.response) - conv.turn_start),
                     self.limits.max_total_tokens - len(conv.response))
        return ids, len(conv.response) + max(1, budget)

    def export_state(self, trajectory_id: str, replayable: bool) -> ConversationState | None:
        """The state a trajectory leaves with when its request is exported (None before its
        first tool result: it moves as a plain resumed request); forgets it here."""
        conv = self._convs.pop(trajectory_id, None)
        if conv is None or not conv.spans:
            return None
        return ConversationState(
            observation_spans=tuple(conv.spans), messages=tuple(conv.messages),
            env_state=conv.env.state(), env_reward=conv.env_reward, turns=conv.turns + 1,
            replayable=replayable and conv.env.replayable)

    def turn_ended(self, out: GenerationOutput) -> Completed | None:
        """A turn came back from the engine: the trajectory's :class:`Completed` if the
        conversation is over, else None (its environment step is running)."""
        conv = self._convs[out.request_id]
        conv.logprobs.extend(out.logprobs[len(conv.response):])
        conv.response.extend(out.token_ids[len(conv.response):])
        conv.policy_version = out.policy_version
        conv.simulated = out.simulated
        conv.kv = out.kv
        turn = conv.response[conv.turn_start:]  # (a migrated turn began on another worker)
        conv.last_text = self.tokenizer.decode(turn)
        conv.messages.append({"role": "assistant", "content": conv.last_text})
        conv.turns += 1
        self.counters["turns"] += 1
        stopped = out.finish_reason == "stop" and turn and turn[-1] in self._stops(conv)
        if not stopped or len(conv.response) >= self.limits.max_total_tokens:
            return self._complete(out.request_id, "length" if not stopped else "stop")
        conv.stop_id = turn[-1]
        conv.pending = self._pool.submit(conv.env.step, conv.last_text)
        return None

    def poll(self) -> tuple[list[tuple[PromptTask, GenerationRequest]], list[tuple[PromptTask,
                                                                                   Completed]]]:
        """Environment steps that finished: next turns to generate, and conversations over."""
        turns, done = [], []
        for tid, conv in list(self._convs.items()):
            if conv.pending is None or not conv.pending.done():
                continue
            future, conv.pending = conv.pending, None
            self.counters["env_steps"] += 1
            try:
                step = future.result()
            except Exception as exc:  # noqa: BLE001 - an environment's bug ends its trajectory
                self.counters["env_errors"] += 1
                self.env_error_reasons[f"step:{type(exc).__name__}"] += 1
                log.warning("environment of %s failed at turn %d: %s", tid, conv.env.turns,
                            encodable(str(exc))[:300], exc_info=True)
                done.append((conv.task, self._complete(tid, "stop")))
                continue
            conv.env_reward += step.reward or 0.0
            if step.done or not step.observations:
                done.append((conv.task, self._complete(tid, "stop")))
                continue
            try:
                request = self._next_turn(tid, conv, step.observations)
            except Exception as exc:  # noqa: BLE001 - model text must never end the worker
                self.counters["env_errors"] += 1
                self.env_error_reasons[f"next_turn:{type(exc).__name__}"] += 1
                log.warning("trajectory %s: its next turn cannot be built (%s: %s); ended as "
                            "an environment error", tid, type(exc).__name__,
                            encodable(str(exc))[:300])
                done.append((conv.task, self._complete(tid, "stop")))
                continue
            if request is None:
                done.append((conv.task, self._complete(tid, "length")))
            else:
                turns.append((conv.task, request))
        return turns, done

    def end(self, trajectory_id: str) -> Completed:
        """End a conversation now (its next turn could not be generated)."""
        return self._complete(trajectory_id, "length")

    def drop(self, trajectory_id: str) -> None:
        """Forget a trajectory (aborted, exported at its first turn, or dropped on rejoin)."""
        self._convs.pop(trajectory_id, None)

    def clear(self) -> list[str]:
        """Forget every conversation; their ids."""
        ids = list(self._convs)
        self._convs.clear()
        return ids

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals -------------------------------------------------------------

    def _stops(self, conv: _Conversation) -> set[int]:
        return set(conv.task.sampling.stop_token_ids) or set(self.tokenizer.eos_token_ids)

    def _next_turn(self, tid: str, conv: _Conversation,
                   observations: list[Message]) -> GenerationRequest | None:
        """The resumed request of the next turn, or None when the budget is spent."""
        history = conv.messages
        try:
            obs_ids = self.tokenizer.encode_observation(history, observations, conv.stop_id,
                                                        tools=conv.tools or None)
        except ConfigError as exc:
            self.counters["env_errors"] += 1
            log.warning("%s: cannot render tool results: %s", tid, exc)
            return None
        start = len(conv.response)
        room = self.limits.max_total_tokens - start - len(obs_ids)
        if room < 1:
            return None
        conv.spans.append((start, start + len(obs_ids)))
        conv.response.extend(obs_ids)
        conv.turn_start = len(conv.response)
        conv.messages = [*history, *(dict(m) for m in observations)]
        s = conv.task.sampling
        params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_tokens=len(conv.response) + min(self.limits.max_tokens_per_turn, room),
            stop_token_ids=tuple(s.stop_token_ids) or tuple(self.tokenizer.eos_token_ids),
            seed=s.seed)
        kv, conv.kv = conv.kv, None
        return GenerationRequest(
            request_id=tid, prompt_token_ids=list(conv.prompt_ids), params=params,
            resume_token_ids=list(conv.response),
            resume_logprobs=self._resume_logprobs(conv), policy_version=conv.policy_version,
            kv=kv, keep_kv=self.reuse_kv)

    @staticmethod
    def _resume_logprobs(conv: _Conversation) -> list[float]:
        """A value per response token for the engine (0.0 for environment tokens; the
        trajectory keeps only the generated ones)."""
        observed = _observed(conv.spans, len(conv.response)) or set()
        generated = iter(conv.logprobs)
        return [0.0 if i in observed else next(generated) for i in range(len(conv.response))]

    def _complete(self, tid: str, finish: str) -> Completed:
        conv = self._convs.pop(tid)
        return Completed(
            prompt_token_ids=tuple(conv.prompt_ids), response_token_ids=tuple(conv.response),
            behaviour_logprobs=tuple(conv.logprobs), finish_reason=finish,
            policy_version=conv.policy_version, text=conv.last_text,
            completion=self.tokenizer.decode(conv.response), simulated=conv.simulated,
            observation_spans=tuple(conv.spans), env_reward=conv.env_reward,
            turns=conv.turns)


def make_conversations(config: Any, tokenizer: Tokenizer, reuse_kv: bool = False
                       ) -> Conversations:
    """:class:`Conversations` for a worker's ``environment`` config
    (:class:`~laminar_rollout.config.EnvironmentConfig`).

    Raises:
        ConfigError: an unknown environment or tool, or a sandbox that cannot run here.
    """
    from .environments import _environment_class
    from .sandbox import CodeSandbox, SandboxLimits
    from .tools import PythonTool, Tool

    limits = TurnLimits(max_turns=config.max_turns,
                        max_tokens_per_turn=config.max_tokens_per_turn,
                        max_total_tokens=config.max_total_tokens,
                        tool_timeout_s=config.tool_timeout_s)
    cls = _environment_class(config.type)
    kwargs: dict[str, Any] = dict(config.options)
    if config.type == "tools":
        tools: dict[str, Tool] = {}
        for name in config.tools:
            if name != "python":
                raise ConfigError(f"environment.tools: unknown tool {name!r} (built-in: python)")
            sb = config.sandbox
            tools[name] = PythonTool(CodeSandbox(SandboxLimits(
                cpu_s=sb.cpu_s, memory_bytes=sb.memory_mb << 20, file_bytes=sb.file_mb << 20,
                wall_s=sb.wall_s, output_bytes=sb.output_bytes), isolation=sb.isolation,
                sandbox_uid=sb.sandbox_uid))
        tool_pool = ThreadPoolExecutor(max(1, config.workers), thread_name_prefix="tool")
        kwargs.update(tools=tools, pool=tool_pool)
    conversations = Conversations(tokenizer, lambda record: cls(record, limits, **kwargs),
                                  limits, workers=config.workers, reuse_kv=reuse_kv)
    return conversations


def _observed(spans, n: int) -> set[int] | None:
    """Positions inside ``spans`` (None: they are not ordered, disjoint ranges of ``n``)."""
    out: set[int] = set()
    end_before = 0
    for start, end in spans:
        if not end_before <= start < end <= n:
            return None
        out.update(range(start, end))
        end_before = end
    return out
