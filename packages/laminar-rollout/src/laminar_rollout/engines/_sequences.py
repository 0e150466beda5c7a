"""Request bookkeeping shared by the engines: queue, decode slots, finish rules, migration records.

``SequenceTable`` owns which requests are queued and which occupy a decode
slot; it never computes anything. Engines own the compute (and any per-slot
state such as a KV cache) and ask the table what to run.

Invariants: while unfinished, a request id is in exactly one of the queue or a
slot; a slot holds at most one sequence; queue order is admission order
(preempted sequences go back to the front).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .base import (
    EngineError,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    KVState,
    PartialProgress,
)


@dataclass(slots=True)
class SequenceState:
    """One unfinished request and the tokens generated for it so far (resumed ones first)."""

    request: GenerationRequest
    token_ids: list[int]
    logprobs: list[float]
    num_resumed: int
    stop_ids: frozenset[int]
    slot: int = -1
    admitted_seq: int = -1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def total_length(self) -> int:
        """Prompt plus response tokens."""
        return len(self.request.prompt_token_ids) + len(self.token_ids)

    def input_ids(self) -> list[int]:
        """Tokens to prefill: the prompt followed by every response token so far."""
        return [*self.request.prompt_token_ids, *self.token_ids]

    def finish_reason(self, context_length: int) -> FinishReason | None:
        """Why this sequence is complete, or ``None`` if it should keep generating."""
        if self.token_ids and self.token_ids[-1] in self.stop_ids:
            return "stop"
        if len(self.token_ids) >= self.request.params.max_tokens:
            return "length"
        if self.total_length >= context_length:
            return "length"
        return None


class SequenceTable:
    """Queued and slotted sequences of one engine."""

    def __init__(self, max_batch: int) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.max_batch = max_batch
        self._queue: deque[SequenceState] = deque()
        self._slots: list[SequenceState | None] = [None] * max_batch
        self._by_id: dict[str, SequenceState] = {}
        self._admissions = 0

    def add(
        self, request: GenerationRequest, *, weight_version: int, eos_ids: Iterable[int]
    ) -> SequenceState:
        """Queue ``request``; refuse duplicates and version mismatches."""
        rid = request.request_id
        if rid in self._by_id:
            raise EngineError(f"request {rid!r} is already unfinished on this engine")
        if request.policy_version is not None and request.policy_version != weight_version:
            raise EngineError(
                f"request {rid!r} was generated with policy v{request.policy_version} but this "
                f"engine holds v{weight_version}: a trajectory never spans two versions"
            )
        seq = SequenceState(
            request=request,
            token_ids=list(request.resume_token_ids),
            logprobs=[float(x) for x in request.resume_logprobs],
            num_resumed=len(request.resume_token_ids),
            stop_ids=frozenset(eos_ids) | frozenset(request.params.stop_token_ids),
        )
        self._queue.append(seq)
        self._by_id[rid] = seq
        return seq

    # -- queries -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_id)

    def active(self) -> list[SequenceState]:
        """Slotted sequences in slot order."""
        return [s for s in self._slots if s is not None]

    def queued(self) -> list[SequenceState]:
        """Queued sequences in admission order."""
        return list(self._queue)

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s is None]

    def peek_queued(self) -> SequenceState | None:
        return self._queue[0] if self._queue else None

    # -- transitions -------------------------------------------------------------

    def admit_next(self, slot: int) -> SequenceState:
        """Move the head of the queue into the free ``slot``."""
        assert self._slots[slot] is None, f"slot {slot} is taken"
        seq = self._queue.popleft()
        seq.slot = slot
        seq.admitted_seq = self._admissions
        self._admissions += 1
        self._slots[slot] = seq
        return seq

    def move(self, seq: SequenceState, slot: int) -> None:
        """Move an active sequence into the free ``slot`` (the engine moves its state)."""
        assert self._slots[seq.slot] is seq, "only an active sequence moves"
        assert self._slots[slot] is None, f"slot {slot} is taken"
        self._slots[seq.slot] = None
        self._slots[slot] = seq
        seq.slot = slot

    def preempt(self, seq: SequenceState) -> None:
        """Return an active sequence to the front of the queue (its tokens are kept)."""
        assert self._slots[seq.slot] is seq
        self._slots[seq.slot] = None
        seq.slot = -1
        self._queue.appendleft(seq)

    def release(self, seq: SequenceState) -> None:
        """Forget a finished sequence and free its slot."""
        self._by_id.pop(seq.request_id)
        if seq.slot >= 0:
            assert self._slots[seq.slot] is seq
            self._slots[seq.slot] = None
            seq.slot = -1
        else:
            self._queue.remove(seq)

    def take(self, request_ids: Iterable[str] | None) -> list[SequenceState]:
        """Remove and return the named unfinished sequences (all when ``None``).

        Raises:
            EngineError: an id is unknown; nothing is removed then.
        """
        if request_ids is None:
            chosen = [*self.active(), *self._queue]
        else:
            if isinstance(request_ids, str):
                raise EngineError(
                    f"request_ids must be a collection of ids, got str {request_ids!r}"
                )
            ids = list(dict.fromkeys(request_ids))
            unknown = [rid for rid in ids if rid not in self._by_id]
            if unknown:
                raise EngineError(f"requests not unfinished on this engine: {unknown}")
            chosen = [self._by_id[rid] for rid in ids]
        for seq in chosen:
            self.release(seq)
        return chosen

    # -- records -----------------------------------------------------------------

    @staticmethod
    def output(
        seq: SequenceState, reason: FinishReason, version: int, *, simulated: bool
    ) -> GenerationOutput:
        return GenerationOutput(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.request.prompt_token_ids),
            token_ids=list(seq.token_ids),
            logprobs=list(seq.logprobs),
            finish_reason=reason,
            policy_version=version,
            simulated=simulated,
            num_resumed=seq.num_resumed,
        )

    @staticmethod
    def resumable(seq: SequenceState, version: int, kv: KVState | None = None
                  ) -> GenerationRequest:
        """The request that continues ``seq`` elsewhere, pinned to the version that produced it."""
        return GenerationRequest(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.request.prompt_token_ids),
            params=seq.request.params,
            resume_token_ids=list(seq.token_ids),
            resume_logprobs=list(seq.logprobs),
            policy_version=version if seq.token_ids else seq.request.policy_version,
            kv=kv,
        )

    def progress(self, version: int) -> list[PartialProgress]:
        return [
            PartialProgress(
                request_id=seq.request_id,
                token_ids=list(seq.token_ids),
                logprobs=list(seq.logprobs),
                policy_version=version,
            )
            for seq in (*self.active(), *self._queue)
        ]
