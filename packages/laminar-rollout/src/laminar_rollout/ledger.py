"""Exactly-once accounting of trajectories: the manager's ledger.

Every trajectory (one sample of one prompt's GRPO group) is in exactly one
state::

    pending ──dispatch──> dispatched(worker) ──finished──> done(worker) ──durable ack──> acked
       ^                        │                              │
       └──── worker lost / exported (resume tokens kept) ─────┘
    rejected  (terminal: the prompt cannot be generated, e.g. longer than the context)

A group can also be marked *filtered* (:meth:`TrajectoryLedger.mark_filtered`:
the trainer's dynamic sampling dropped it untrained, every member having scored
the same); its trajectories still move along the arrows (they are acked). Each
filtered group counts once in ``filtered_groups``, the creation credit the
manager grants for it, however often it is told; the count and the marks are
part of the snapshot.

Invariants:

- A trajectory id is created once (from its prompt id and sample index) and
  its state only moves along the arrows above; ``acked`` and ``rejected`` are
  final. A report that does not fit (a worker finishing something it no
  longer holds) is counted as ``stale`` and changes nothing.
- Work of a lost worker goes back to ``pending``: unfinished trajectories keep
  their generated tokens and policy version (resumable on a worker at that
  version); finished-but-unacked ones are generated again. The trainer
  deduplicates by trajectory id, so re-generation can never train an id twice.
- Nothing here does I/O: it is a pure state machine, persisted by the caller
  through :meth:`snapshot` / :meth:`restore`. A restore keeps ``acked`` and
  ``rejected``; everything else is pending again (without tokens): what a
  worker held under the old manager is generated again, and what a trainer
  already trained is refused by id there and acked again.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from laminar_common.codec import (
    ConversationState,
    KvCache,
    KvRef,
    PromptTask,
    SamplingSpec,
    trajectory_seed,
)
from laminar_common.data.records import Record

__all__ = ["TrajectoryLedger", "Entry", "PENDING", "DISPATCHED", "DONE", "ACKED", "REJECTED"]

PENDING, DISPATCHED, DONE, ACKED, REJECTED = "pending", "dispatched", "done", "acked", "rejected"
STATES = (PENDING, DISPATCHED, DONE, ACKED, REJECTED)


@dataclass
class Entry:
    task: PromptTask
    batch: int = -1
    """The global batch of sync and one-step modes (-1: laminar mode)."""
    state: str = PENDING
    worker: str | None = None
    dispatches: int = 0
    partial_tokens: list[int] = field(default_factory=list)
    partial_logprobs: list[float] = field(default_factory=list)
    """What the last worker reported of it (lists: a report's continuation extends them
    in place, so a report costs its new tokens, not every token so far)."""
    partial_version: int = -1
    partial_conversation: ConversationState | None = None
    """A multi-turn trajectory's state at its export (its tokens hold tool results)."""
    partial_kv: KvCache | KvRef | None = None
    """The attention cache exported with exactly ``partial_tokens`` (repack's KV
    transfer), or where it waits on the source worker (the KV plane): sent with the next
    dispatch only, then dropped."""
    reason: str = ""


@dataclass
class LedgerCounters:
    stale_reports: int = 0
    resumed: int = 0
    restarted: int = 0
    migrated: int = 0
    acks_unknown: int = 0
    regenerated: int = 0
    """Trajectories generated again because the trainer refused a copy by content."""
    filtered_unknown: int = 0
    """Filtered-group notices naming a prompt of no group the ledger holds."""
    progress_gaps: int = 0
    """Progress continuations that did not meet the tokens held (dropped until a full one)."""
    kv_carried: int = 0
    """Exported trajectories that brought their attention cache (sent on with them)."""
    filtered_again: int = 0
    """Filtered-group notices for a group already marked (a re-sent notice)."""
    by_state: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(slots=True)
class _Group:
    """One prompt's group in the ledger's creation order."""

    prompt_id: str
    size: int
    batch: int
    open: int
    """Its trajectories not yet acked or rejected."""
    filtered: bool = False
    """The trainer dropped it untrained (dynamic sampling); credited once."""


def trajectory_id(prompt_id: str, sample_index: int) -> str:
    return f"{prompt_id}#{sample_index}"


class TrajectoryLedger:
    """The state of every trajectory of a run (see module docstring)."""

    def __init__(self, keep_settled: int | None = None) -> None:
        self.entries: dict[str, Entry] = {}
        # Groups by creation number (``group_seq``). ``settled_below`` is the
        # watermark: every group numbered below it is settled. Settled groups more
        # than ``keep_settled`` behind it are compacted away (their entries dropped),
        # so memory and snapshots stay flat however long the run.
        self._groups: collections.OrderedDict[int, _Group] = collections.OrderedDict()
        self._next_seq = 0
        self.settled_below = 0
        self.keep_settled = keep_settled
        self.compacted_groups = 0
        self.compacted_states: collections.Counter[str] = collections.Counter()
        self.filtered_groups = 0
        """Groups marked filtered over the run (compacted ones included)."""
        self._pending: collections.deque[str] = collections.deque()
        self.counters = LedgerCounters()
        # Indexes kept in step with every state change, so per-loop queries are
        # O(what they return), not O(all trajectories ever created).
        self._held: dict[str, set[str]] = collections.defaultdict(set)
        self._done_by: dict[str, set[str]] = collections.defaultdict(set)
        self._open_in_batch: collections.Counter[int] = collections.Counter()
        self._resumable: set[str] = set()

    # -- creation -------------------------------------------------------------

    def add_group(self, record: Record, group_size: int, sampling: SamplingSpec,
                  batch: int = -1, seq: int | None = None) -> list[str]:
        """Create the ``group_size`` trajectories of one prompt, all pending, as group
        number ``seq`` (the next one by default; a restore passes the saved one).

        The tasks carry the record's prompt as ``prompt`` (text) or ``messages`` (chat,
        ``prompt`` then empty) and its metadata as the file holds it."""
        seq = self._next_seq if seq is None else seq
        prompt_id = record.record_id
        if seq < self._next_seq:
            raise ValueError(f"group number {seq} for {prompt_id!r} is not after "
                             f"{self._next_seq - 1}: groups are numbered in creation order")
        ids = []
        text, messages = (record.prompt, ()) if isinstance(record.prompt, str) \
            else ("", record.prompt)
        for i in range(group_size):
            tid = trajectory_id(prompt_id, i)
            if tid in self.entries:
                raise ValueError(f"trajectory {tid!r} already exists: prompt ids must be unique")
            own = sampling if sampling.seed is None else msgspec.structs.replace(
                sampling, seed=trajectory_seed(sampling.seed, tid))
            task = PromptTask(trajectory_id=tid, prompt_id=prompt_id,
                              group_size=group_size, sample_index=i, prompt=text,
                              messages=messages, metadata=record.metadata, sampling=own,
                              group_seq=seq)
            self.entries[tid] = Entry(task, batch)
            self.counters.by_state[PENDING] += 1
            if batch >= 0:
                self._open_in_batch[batch] += 1
            self._pending.append(tid)
            ids.append(tid)
        if self.settled_below == self._next_seq:  # nothing open: the watermark may jump
            self.settled_below = seq
        self._groups[seq] = _Group(prompt_id, group_size, batch, group_size)
        self._next_seq = seq + 1
        return ids

    def _settle(self, entry: Entry) -> None:
        """One trajectory became final: move the watermark over settled groups, compact."""
        self._groups[entry.task.group_seq].open -= 1
        while self.settled_below < self._next_seq and \
                self._groups[self.settled_below].open == 0:
            self.settled_below += 1
        if self.keep_settled is None:
            return
        while self._groups:
            seq = next(iter(self._groups))
            if seq >= self.settled_below - self.keep_settled:
                break
            group = self._groups.pop(seq)
            for i in range(group.size):
                gone = self.entries.pop(trajectory_id(group.prompt_id, i), None)
                if gone is not None:
                    self.compacted_states[gone.state] += 1
            self.compacted_groups += 1

    # -- transitions ----------------------------------------------------------

    def _move(self, entry: Entry, state: str) -> None:
        old = entry.state
        tid = entry.task.trajectory_id
        self.counters.by_state[old] -= 1
        self.counters.by_state[state] += 1
        if old == DISPATCHED:
            self._held[entry.worker].discard(tid)
        if old == DONE:
            self._done_by[entry.worker].discard(tid)
        batch = entry.batch
        if batch >= 0 and (old in (PENDING, DISPATCHED)) != (state in (PENDING, DISPATCHED)):
            self._open_in_batch[batch] += -1 if old in (PENDING, DISPATCHED) else 1
        entry.state = state
        if state in (ACKED, REJECTED) and old not in (ACKED, REJECTED):
            self._settle(entry)

    def pending_count(self) -> int:
        return self.counters.by_state[PENDING]

    def take_pending(self, worker: str, version: int, limit: int) -> list[PromptTask]:
        """Dispatch up to ``limit`` pending trajectories to ``worker`` (at ``version``).

        Resumable trajectories go only to a worker at their policy version;
        others are skipped (they stay pending, in order).
        """
        out: list[PromptTask] = []
        skipped: list[str] = []
        while self._pending and len(out) < limit:
            tid = self._pending.popleft()
            entry = self.entries[tid]
            if entry.state != PENDING:
                continue
            if entry.partial_tokens and entry.partial_version != version:
                skipped.append(tid)
                continue
            out.append(self._dispatch(entry, worker))
        self._pending.extendleft(reversed(skipped))
        return out

    def take_specific(self, tid: str, worker: str, version: int) -> PromptTask | None:
        """Dispatch one pending trajectory to a chosen worker (migration, recovery)."""
        entry = self.entries.get(tid)
        if entry is None or entry.state != PENDING:
            return None
        if entry.partial_tokens and entry.partial_version != version:
            return None
        return self._dispatch(entry, worker)

    def _dispatch(self, entry: Entry, worker: str) -> PromptTask:
        task = msgspec.structs.replace(entry.task, settled_below=self.settled_below)
        if entry.partial_tokens:
            task = _with_resume(task, entry)
            self.counters.resumed += 1
            self._resumable.discard(task.trajectory_id)
        self._move(entry, DISPATCHED)
        entry.worker = worker
        entry.dispatches += 1
        self._held[worker].add(task.trajectory_id)
        return task

    def pending_resumable(self) -> list[tuple[str, int]]:
        """Pending trajectories that carry tokens, with the version that made them."""
        return [(t, self.entries[t].partial_version) for t in sorted(self._resumable)]

    def restart_unresumable(self, live_versions: set[int]) -> int:
        """Drop resume tokens of pending trajectories no live worker can continue."""
        n = 0
        for tid in sorted(self._resumable):
            entry = self.entries[tid]
            if entry.partial_version not in live_versions:
                _clear_partial(entry)
                self._resumable.discard(tid)
                self.counters.restarted += 1
                n += 1
        return n

    def record_partial(self, tid: str, worker: str, version: int, tokens: tuple[int, ...],
                       logprobs: tuple[float, ...], offset: int = 0) -> bool:
        """A worker's progress report: ``tokens`` continue the trajectory at ``offset``
        (0: they are all of it). A continuation that does not meet what the ledger holds
        (a gap, or another version) is counted and dropped: the worker's next full report
        mends it."""
        entry = self.entries.get(tid)
        if entry is None or entry.state != DISPATCHED or entry.worker != worker:
            self.counters.stale_reports += 1
            return False
        if entry.partial_conversation is not None:
            return True  # an exported conversation keeps its consistent tokens-and-state pair
        if offset and (entry.partial_version != version or offset > len(entry.partial_tokens)):
            self.counters.progress_gaps += 1
            return True
        if offset + len(tokens) >= len(entry.partial_tokens) or \
                (not offset and version != entry.partial_version):
            # (a whole report at another version: the worker restarted it there)
            del entry.partial_tokens[offset:], entry.partial_logprobs[offset:]
            entry.partial_tokens.extend(tokens)
            entry.partial_logprobs.extend(logprobs)
            entry.partial_version = version
            entry.partial_kv = None
        return True

    def mark_done(self, tid: str, worker: str) -> bool:
        entry = self.entries.get(tid)
        if entry is None or entry.state != DISPATCHED or entry.worker != worker:
            self.counters.stale_reports += 1
            return False
        self._move(entry, DONE)
        self._done_by[worker].add(tid)
        return True

    def mark_rejected(self, tid: str, worker: str, reason: str) -> bool:
        entry = self.entries.get(tid)
        if entry is None or entry.state != DISPATCHED or entry.worker != worker:
            self.counters.stale_reports += 1
            return False
        self._move(entry, REJECTED)
        entry.reason = reason
        return True

    def trainer_rejected(self, tid: str, worker: str, reason: str, final: bool) -> bool:
        """The trainer refused ``worker``'s copy of ``tid`` by its contents.

        Not final: the trajectory is generated again (pending, without tokens) if
        that copy is the one the ledger knows of (done or dispatched at
        ``worker``). Final: it is rejected for good, whoever holds it now. A
        rejection of an old copy, or of an acked id, changes nothing (stale).
        """
        entry = self.entries.get(tid)
        if entry is None or entry.state in (ACKED, REJECTED):
            self.counters.stale_reports += 1
            return False
        if final:
            self._move(entry, REJECTED)
            entry.worker = None
            entry.reason = f"trainer: {reason}"
            _clear_partial(entry)
            self._resumable.discard(tid)
            return True
        if entry.state not in (DONE, DISPATCHED) or entry.worker != worker:
            self.counters.stale_reports += 1
            return False
        _clear_partial(entry)
        self._move(entry, PENDING)
        entry.worker = None
        self._pending.appendleft(tid)
        self.counters.regenerated += 1
        return True

    def mark_filtered(self, prompt_id: str) -> bool | None:
        """The trainer dropped ``prompt_id``'s group untrained (dynamic sampling).

        Returns True when this marks it (one more ``filtered_groups``), False when it
        was marked already (a re-sent notice: no second credit), None when no group
        of that prompt is held (unknown, or compacted away long after it settled).
        """
        entry = self.entries.get(trajectory_id(prompt_id, 0))
        group = self._groups.get(entry.task.group_seq) if entry is not None else None
        if group is None or group.prompt_id != prompt_id:
            self.counters.filtered_unknown += 1
            return None
        if group.filtered:
            self.counters.filtered_again += 1
            return False
        group.filtered = True
        self.filtered_groups += 1
        return True

    def mark_acked(self, tid: str) -> str | None:
        """Durable trainer ack; returns the worker to notify, None if it is not known.

        An id acked again (a copy generated twice, e.g. after a worker or
        manager was lost) stays acked; the caller tells every worker, since
        any of them may hold that copy in its outbox.
        """
        entry = self.entries.get(tid)
        if entry is None:
            self.counters.acks_unknown += 1
            return None
        if entry.state in (ACKED, REJECTED):
            return None
        worker = entry.worker
        self._move(entry, ACKED)
        _clear_partial(entry)
        self._resumable.discard(tid)
        return worker

    def requeue_exported(self, task: PromptTask, worker: str) -> bool:
        """A worker handed a trajectory back (repack): pending again, with its tokens."""
        entry = self.entries.get(task.trajectory_id)
        if entry is None or entry.state != DISPATCHED or entry.worker != worker:
            self.counters.stale_reports += 1
            return False
        entry.partial_tokens = list(task.resume_token_ids)
        entry.partial_logprobs = list(task.resume_logprobs)
        entry.partial_version = task.policy_version if task.resume_token_ids else -1
        entry.partial_conversation = task.conversation if task.resume_token_ids else None
        entry.partial_kv = task.kv if task.resume_token_ids else None
        if entry.partial_kv is not None:
            self.counters.kv_carried += 1
        self._move(entry, PENDING)
        entry.worker = None
        self._pending.appendleft(task.trajectory_id)
        if entry.partial_tokens:
            self._resumable.add(task.trajectory_id)
        self.counters.migrated += 1
        return True

    def worker_lost(self, worker: str) -> tuple[list[str], list[str]]:
        """Send a dead worker's unacked work back to pending.

        Returns:
            (resumable ids that keep their tokens, ids to generate again).
        """
        resumable, again = [], []
        for tid in sorted(self._held.pop(worker, set()) | self._done_by.pop(worker, set())):
            entry = self.entries[tid]
            if entry.state == DONE:
                _clear_partial(entry)
                again.append(tid)
            elif entry.partial_tokens and (entry.partial_conversation is None
                                           or entry.partial_conversation.replayable):
                resumable.append(tid)
            else:
                # A conversation whose tool calls must not run again starts afresh (a new
                # environment), never from a state its lost worker went past.
                _clear_partial(entry)
                again.append(tid)
            self._move(entry, PENDING)
            entry.worker = None
        for tid in reversed(resumable + again):
            self._pending.appendleft(tid)
        self._resumable.update(resumable)
        self._held.pop(worker, None)
        self._done_by.pop(worker, None)
        return resumable, again

    # -- queries --------------------------------------------------------------

    def held_by(self, worker: str) -> list[str]:
        return sorted(self._held.get(worker, ()))

    def assigned(self, worker: str) -> int:
        return len(self._held.get(worker, ()))

    def finished_unacked(self, worker: str) -> int:
        """Trajectories ``worker`` finished that the trainer has not acked yet."""
        return len(self._done_by.get(worker, ()))

    @property
    def created(self) -> int:
        """Trajectories created over the run (compacted ones included)."""
        return sum(self.counters.by_state[s] for s in STATES)

    def counts(self) -> dict[str, int]:
        return {s: self.counters.by_state[s] for s in STATES}

    def settled(self) -> bool:
        """Every trajectory created so far is acked or rejected."""
        c = self.counters.by_state
        return c[PENDING] == c[DISPATCHED] == c[DONE] == 0

    def batch_done(self, batch: int) -> bool:
        """Every trajectory of ``batch`` has finished generating (done, acked or rejected)."""
        return self._open_in_batch[batch] == 0

    # -- persistence ----------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        """What a restarted manager needs (tokens are not kept).

        ``states``: trajectory ids by state (of the groups not compacted);
        ``groups``: ``[prompt_id, group_size, batch, group_seq]`` per prompt, in
        creation order; ``dispatched_to``: how many trajectories each worker
        holds; ``settled_below``: the watermark; ``compacted``: how many groups
        were compacted away and their trajectories' final states; ``filtered``: how
        many groups were marked filtered (``groups``) and the prompt ids of those
        not compacted (``prompt_ids``).
        """
        states: dict[str, list[str]] = {s: [] for s in STATES}
        for tid, entry in self.entries.items():
            states[entry.state].append(tid)
        groups = [[g.prompt_id, g.size, g.batch, seq] for seq, g in self._groups.items()]
        return {"states": states, "groups": groups,
                "dispatched_to": {w: len(ids) for w, ids in self._held.items() if ids},
                "settled_below": self.settled_below,
                "compacted": {"groups": self.compacted_groups, **self.compacted_states},
                "filtered": {"groups": self.filtered_groups,
                             "prompt_ids": [g.prompt_id for g in self._groups.values()
                                            if g.filtered]}}

    @classmethod
    def restored(cls, snapshot: dict, records: Callable[[str], Record | None],
                 sampling: SamplingSpec, keep_settled: int | None = None) -> TrajectoryLedger:
        """A new ledger from :meth:`snapshot` (see module docstring).

        ``records`` finds a prompt's record by the id it was dispatched under.

        Raises:
            ValueError: the snapshot does not fit, naming what is wrong.
        """
        ledger = cls(keep_settled)
        try:
            states, groups = snapshot["states"], snapshot["groups"]
            final = {tid: state for state in (ACKED, REJECTED) for tid in states.get(state, ())}
            for group in groups:
                # [prompt_id, group_size, batch, group_seq]; snapshots before group
                # numbers had three fields and no compaction.
                prompt_id, group_size, batch = group[:3]
                seq = int(group[3]) if len(group) > 3 else None
                record = records(prompt_id)
                if record is None:
                    raise ValueError(f"prompt {prompt_id!r} is not in the prompt file")
                ledger.add_group(record, int(group_size), sampling, batch=int(batch), seq=seq)
            compacted = dict(snapshot.get("compacted", {}))
            ledger.compacted_groups = int(compacted.pop("groups", 0))
            for state, n in compacted.items():
                if state not in (ACKED, REJECTED):
                    raise ValueError(f"compacted trajectories in state {state!r}")
                ledger.compacted_states[state] = int(n)
                ledger.counters.by_state[state] += int(n)
            filtered = snapshot.get("filtered", {})  # absent before dynamic sampling
            for prompt_id in filtered.get("prompt_ids", ()):
                if ledger.mark_filtered(prompt_id) is None:
                    raise ValueError(f"filtered prompt {prompt_id!r} is of no group")
            ledger.filtered_groups = int(filtered.get("groups", ledger.filtered_groups))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed ledger snapshot: {exc!r}") from exc
        unknown = sorted(set(final) - set(ledger.entries))
        if unknown:
            raise ValueError(f"snapshot names a trajectory of no group: {unknown[0]!r}")
        for tid, state in final.items():
            ledger._move(ledger.entries[tid], state)
        ledger._pending = collections.deque(t for t in ledger._pending if t not in final)
        return ledger


def _with_resume(task: PromptTask, entry: Entry) -> PromptTask:
    kv, entry.partial_kv = entry.partial_kv, None  # one use: the destination holds it now
    return msgspec.structs.replace(task, resume_token_ids=tuple(entry.partial_tokens),
                                   resume_logprobs=tuple(entry.partial_logprobs),
                                   policy_version=entry.partial_version,
                                   conversation=entry.partial_conversation, kv=kv)


def _clear_partial(entry: Entry) -> None:
    entry.partial_tokens, entry.partial_logprobs, entry.partial_version = [], [], -1
    entry.partial_conversation = None
    entry.partial_kv = None
