"""What a worker's engine works on: trajectories admitted, stepped, between turns, exported.

:class:`Generation` takes the manager's prompt tasks (fresh ones wait until no weight
pull is pending; resumed ones, from a repack or a restarted manager, go in at once),
builds each engine request (the prompt rendered or a conversation's first turn, the
sampling parameters, a migrated KV cache when one came along), steps the engine,
and hands what finishes to scoring: a single-turn completion at once, a multi-turn
trajectory's turn to its environment (:mod:`.conversations`) and the next turn back
into the engine when the environment answered. On a repack it exports what the
engine holds, with its cache and conversation state, for the manager to pass on.

It never references the worker service: what it needs of it (the manager's socket,
to refuse a task) comes in as a callable.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Iterator

import msgspec

from laminar_common.codec import PromptTask
from laminar_common.errors import ConfigError

from .conversations import Completed, Conversations
from .engines import EngineError, GenerationEngine, GenerationOutput, GenerationRequest
from .engines import SamplingParams as EngineSampling
from .engines.base import KVState
from .engines.kv_wire import kv_from_wire
from .kv_migration import KvMigration
from .scoring import Scoring
from .tokenizer import Tokenizer

__all__ = ["Generation"]

log = logging.getLogger(__name__)


class Generation:
    """A worker's trajectories from admission until scoring (see module docstring).

    Args:
        reject: ``reject(trajectory_id, reason)``: tell the manager a task cannot be
            generated here (the engine or the environment refused it).
    """

    def __init__(self, engine: GenerationEngine, tokenizer: Tokenizer,
                 conversations: Conversations | None, kv: KvMigration, scoring: Scoring,
                 counters: collections.Counter[str],
                 reject: Callable[[str, str], None]) -> None:
        self.engine, self.tokenizer, self.conversations = engine, tokenizer, conversations
        self.kv, self.scoring, self.counters = kv, scoring, counters
        self._reject = reject
        self.tasks: dict[str, PromptTask] = {}
        """Trajectories in the engine, by id."""
        self.fresh: collections.deque[PromptTask] = collections.deque()
        """Fresh prompts waiting for the engine (started once no weight pull is pending)."""
        self.between_turns: dict[str, PromptTask] = {}
        """Multi-turn trajectories whose environment is answering (held, not in the engine)."""

    # -- admission --------------------------------------------------------------

    def admit(self, task: PromptTask) -> None:
        """A task from the manager: a resumed one into the engine now (unless its cache
        is being fetched: :meth:`KvMigration.collect` returns it), a fresh one queued."""
        if task.resume_token_ids and task.policy_version != self.engine.weight_version:
            log.warning("resume of %s at v%d refused by v%d worker; restarting it",
                        task.trajectory_id, task.policy_version, self.engine.weight_version)
            self.counters["resume_refused"] += 1
            task = _without_resume(task)
        task = self.kv.incoming(task)
        if task is None:
            return
        if task.resume_token_ids:
            self.add(task)
        else:
            self.fresh.append(task)

    def start_fresh(self) -> None:
        while self.fresh:
            self.add(self.fresh.popleft())

    def add(self, task: PromptTask) -> None:
        """Into the engine, with its migrated cache if it has one; refused to the manager
        if the engine or the environment cannot take it."""
        stop = tuple(task.sampling.stop_token_ids) or tuple(self.tokenizer.eos_token_ids)
        try:
            request = self._request(task, stop)
            if task.kv is None:
                self.engine.add_request(request())
            else:
                try:
                    self.engine.add_request(request(kv_from_wire(task.kv)))
                    self.counters["kv_migrated_in"] += 1
                except (EngineError, ValueError) as exc:  # e.g. another model shape
                    self.engine.add_request(request())  # (fails again if the cache was not why)
                    self.kv.refuse(task, str(exc))
        except (EngineError, ConfigError, ValueError) as exc:
            self.counters["rejected"] += 1
            if self.conversations is not None:
                self.conversations.drop(task.trajectory_id)
            self._reject(task.trajectory_id, str(exc))
            return
        # (the engine holds the cache now: the task need not keep a copy)
        self.tasks[task.trajectory_id] = msgspec.structs.replace(task, kv=None) \
            if task.kv is not None else task

    def _request(self, task: PromptTask,
                 stop: tuple[int, ...]) -> Callable[..., GenerationRequest]:
        """The engine request of ``task``, given a KV cache or none."""
        s = task.sampling
        max_tokens = s.max_tokens
        if self.conversations is not None:
            ids, max_tokens = self.conversations.begin(task)
        else:
            ids = list(task.prompt_token_ids) or self.tokenizer.encode_prompt(
                task.messages or task.prompt)
        params = EngineSampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_tokens=max_tokens, stop_token_ids=stop, seed=s.seed)
        keep_kv = self.conversations is not None and self.conversations.reuse_kv

        def request(kv: KVState | None = None) -> GenerationRequest:
            return GenerationRequest(
                request_id=task.trajectory_id, prompt_token_ids=ids, params=params,
                resume_token_ids=list(task.resume_token_ids),
                resume_logprobs=list(task.resume_logprobs),
                policy_version=task.policy_version if task.resume_token_ids else None,
                keep_kv=keep_kv, kv=kv)

        return request

    # -- generation -------------------------------------------------------------

    def step(self) -> None:
        """One engine step; what finished goes on (see :meth:`_finish`)."""
        for out in self.engine.step():
            self._finish(out)

    def _finish(self, out: GenerationOutput) -> None:
        """Generation is over: hand the completion to the reward pool (off the decode loop),
        or a multi-turn trajectory's turn to its environment."""
        task = self.tasks.pop(out.request_id)
        if out.finish_reason == "aborted":
            if self.conversations is not None:
                self.conversations.drop(out.request_id)
            return
        if self.conversations is None:
            text = self.tokenizer.decode(out.token_ids)
            self.scoring.submit(task, Completed.single_turn(out, text))
            return
        done = self.conversations.turn_ended(out)
        if done is None:
            self.between_turns[task.trajectory_id] = task
        else:
            self.scoring.submit(task, done)

    def next_turns(self) -> None:
        """Environments that answered: next turns into the engine, finished conversations
        to the reward pool."""
        if self.conversations is None or not self.between_turns:
            return
        turns, done = self.conversations.poll()
        for task, request in turns:
            self.between_turns.pop(task.trajectory_id, None)
            try:
                self.engine.add_request(request)
            except EngineError as exc:  # e.g. the conversation outgrew the context
                log.warning("next turn of %s refused by the engine (%s): it ends here",
                            task.trajectory_id, exc)
                self.counters["turn_refused"] += 1
                self.scoring.submit(task, self.conversations.end(task.trajectory_id))
                continue
            self.tasks[task.trajectory_id] = task
        for task, completed in done:
            self.between_turns.pop(task.trajectory_id, None)
            self.scoring.submit(task, completed)

    # -- leaving ----------------------------------------------------------------

    def export(self, ids: Iterable[str]) -> Iterator[PromptTask]:
        """What the engine holds of ``ids``, as tasks another worker continues (repack),
        one at a time: each is built (its cache serialized) only once the one before it
        was sent, and counted as exported after it was."""
        # Only what the engine holds moves: a conversation waiting on its tool call stays
        # (its side effects are running here); one between turns in the engine moves
        # with its conversation state.
        wanted = [t for t in ids if t in self.tasks]
        # It takes its cache along; a conversation's covers its turns so far, tool results
        # included (the destination continues the same tokens: its prompt ids and
        # resumed tokens travel as they are, never rendered again).
        with_kv = self.kv.with_kv
        for req in (self.engine.export_with_kv(wanted, max_bytes=self.kv.limit) if with_kv
                    else self.engine.export(wanted)):
            task = self.tasks.pop(req.request_id)
            conversation = self.conversations.export_state(req.request_id, replayable=True) \
                if self.conversations is not None else None
            yield msgspec.structs.replace(
                task, prompt_token_ids=tuple(req.prompt_token_ids),
                resume_token_ids=tuple(req.resume_token_ids),
                resume_logprobs=tuple(req.resume_logprobs),
                policy_version=req.policy_version if req.policy_version is not None else -1,
                conversation=conversation, kv=self.kv.out(req) if with_kv else None,
            )
            self.counters["exported"] += 1

    def drop_all(self) -> list[str]:
        """Abort and forget every unfinished trajectory (the manager dispatches them
        again); returns their ids. Scored ones are not touched."""
        dropped = self.engine.abort() if self.engine.has_unfinished() else []
        dropped_ids = [out.request_id for out in dropped] + [t.trajectory_id for t in self.fresh]
        dropped_ids += self.kv.drop_waiting()
        if self.conversations is not None:
            self.conversations.clear()
            dropped_ids += [t for t in self.between_turns if t not in dropped_ids]
            self.between_turns.clear()
        self.tasks.clear()
        self.fresh.clear()
        return dropped_ids

    # -- state ------------------------------------------------------------------

    def holding(self) -> tuple[str, ...]:
        """Every unfinished trajectory held here (the load report's ``holding``)."""
        return tuple(self.tasks) + tuple(self.scoring.waiting) + tuple(self.between_turns) \
            + tuple(self.kv.waiting)

    def may_swap_weights(self) -> bool:
        """Nothing in the engine, migrating in, or between turns: weights may change."""
        return not self.engine.has_unfinished() and not self.kv.waiting and \
            not (self.conversations is not None and self.conversations.busy)

    def idle_wait_s(self) -> float:
        """How long the loop may wait for the manager: none while there is work, briefly
        while results are coming (scoring, environments, caches), longer when idle."""
        if self.engine.has_unfinished() or self.fresh:
            return 0.0
        return 0.002 if self.scoring.waiting or self.between_turns or self.kv.waiting else 0.02


def _without_resume(task: PromptTask) -> PromptTask:
    return msgspec.structs.replace(task, resume_token_ids=(), resume_logprobs=(),
                                   policy_version=-1, conversation=None)
