"""The experience buffer: finished trajectories in, complete GRPO groups out.

Owns deduplication (by trajectory id, against both what is buffered and what
was already consumed), group completion (a group is ready when all
``group_size`` samples of a prompt arrived), the bound on what it holds, the
sampling policy, and the staleness record of every consumed trajectory.

Capacity (``capacity`` trajectories) is backpressure, not loss: a refused
trajectory is not acked, so its worker pushes it again later. Only trajectories
that would open a new group are refused; members of groups already buffered are
taken (partial groups alone must never fill the buffer for good).

Sampling policies (``policy``):

- ``fifo``: oldest complete groups first, whatever their staleness.
- ``staleness``: oldest complete groups first, but a group whose stalest
  member exceeds ``max_staleness`` (trainer version at consume minus the
  generating version) is dropped (``stale_action="drop"``) or kept with its
  advantages scaled by ``downweight`` (``stale_action="downweight"``).

Exactly-once memory stays flat (:class:`ConsumedIds`): ids are kept one by
one only for groups above the manager's watermark (``settled_below``, which
every trajectory carries: all groups numbered below it are acked or rejected
for good); a trajectory of a group below the watermark is refused as consumed
without a per-id record.

A sample the trainer gave up on (:meth:`ExperienceBuffer.fail`: rejected by
content too often) counts as consumed and its group completes without it.
Groups dropped as too stale are consumed too, and their ids wait in
:meth:`ExperienceBuffer.pop_dropped` to be acked (nothing waits for them).

Dynamic sampling (``dynamic_sampling``, DAPO): a complete group that teaches
nothing — every member scored the same reward, or fewer than two members are
left after give-ups — is *uninformative*. It never counts as ready
(:meth:`~ExperienceBuffer.ready_groups`, :meth:`~ExperienceBuffer.wait_ready`) and
is never handed out; it is dropped (on the training thread's calls,
:meth:`~ExperienceBuffer.take` and :meth:`~ExperienceBuffer.pop_filtered`, never the
receiving thread's), counted (``stats.filtered``) and named by
:meth:`~ExperienceBuffer.pop_filtered`, so the manager can generate as many more.
Its ids are consumed untrained like a stale group's, but only once
:meth:`~ExperienceBuffer.pop_dropped` hands them to the caller to log (until then a
copy is refused as a duplicate): a checkpoint never holds a consumed id the
consumed log lacks.

Invariants: a trajectory id is handed out at most once over the buffer's
life (``consumed`` persists through checkpoints); a group is handed out whole
or not at all, and with dynamic sampling only an informative one; nothing
here blocks — the caller waits on :meth:`wait_ready`.
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from laminar_common.codec import Trajectory
from laminar_common.consume.consumed import ConsumedIds

__all__ = ["Added", "ConsumedIds", "ExperienceBuffer", "Group", "BufferStats"]


@dataclass
class Group:
    prompt_id: str
    group_size: int
    members: dict[int, Trajectory] = field(default_factory=dict)
    weight: float = 1.0
    failed: set[int] = field(default_factory=set)
    """Sample indices given up on (rejected too often): the group trains without them."""
    group_seq: int = -1
    """The manager's number for the group (-1: unknown)."""

    @property
    def complete(self) -> bool:
        return len(self.members) + len(self.failed) >= self.group_size

    def trajectories(self) -> list[Trajectory]:
        return [self.members[i] for i in sorted(self.members)]

    def min_version(self) -> int:
        return min(t.policy_version for t in self.members.values())

    @property
    def informative(self) -> bool:
        """At least two members left and not all of the same reward (a non-zero
        group-relative advantage somewhere)."""
        return len(self.members) >= 2 and len({t.reward for t in self.members.values()}) > 1

    @property
    def rewards_failed(self) -> bool:
        """Every member's reward failed (``reward_error``): dynamic sampling keeps such a
        group, so that a broken reward or answer key is named by the trainer's first step
        instead of filtered away until the prompts run out."""
        return bool(self.members) and all(t.reward_error is not None
                                          for t in self.members.values())


class Added(enum.Enum):
    """What :meth:`ExperienceBuffer.add` did with a trajectory (true only when buffered)."""

    YES = "added"
    CONSUMED = "already consumed"
    DUPLICATE = "duplicate"
    FULL = "buffer full"
    MISMATCH = "group mismatch"
    """Its ``group_size`` differs from the buffered members' (wrong contents)."""

    def __bool__(self) -> bool:
        return self is Added.YES


@dataclass
class BufferStats:
    received: int = 0
    duplicates: int = 0
    already_consumed: int = 0
    dropped_full: int = 0
    dropped_stale: int = 0
    downweighted: int = 0
    reward_errors: int = 0
    mismatched: int = 0
    failed: int = 0
    filtered: int = 0
    """Complete groups dropped untrained by dynamic sampling (uninformative)."""
    staleness: collections.Counter[int] = field(default_factory=collections.Counter)


class ExperienceBuffer:
    """Thread-safe: a receiver thread adds, the training loop samples."""

    def __init__(self, capacity: int = 4096, policy: str = "fifo", max_staleness: int = 4,
                 stale_action: str = "drop", downweight: float = 0.5,
                 consumed: ConsumedIds | Iterable[str] | None = None,
                 dynamic_sampling: bool = False) -> None:
        if policy not in ("fifo", "staleness"):
            raise ValueError(f"buffer policy {policy!r}: expected 'fifo' or 'staleness'")
        if stale_action not in ("drop", "downweight"):
            raise ValueError(f"stale_action {stale_action!r}: expected 'drop' or 'downweight'")
        self.capacity = capacity
        self.policy = policy
        self.max_staleness = max_staleness
        self.stale_action = stale_action
        self.downweight = downweight
        self.dynamic_sampling = dynamic_sampling
        self.consumed = consumed if isinstance(consumed, ConsumedIds) else \
            ConsumedIds(consumed or ())
        self.stats = BufferStats()
        self._dropped: list[str] = []
        self._uninformative: dict[str, None] = {}
        """Prompt ids of complete uninformative groups not dropped yet (dynamic sampling)."""
        self._filtered: list[tuple[str, int]] = []
        self._limbo: dict[str, int] = {}
        """Ids (-> group_seq) of filtered groups, consumed at the next :meth:`pop_dropped`."""
        self._groups: collections.OrderedDict[str, Group] = collections.OrderedDict()
        self._size = 0
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return self._size

    def add(self, traj: Trajectory) -> Added:
        """Buffer one trajectory; the result is false when it was refused, and says why."""
        with self._cond:
            self.stats.received += 1
            if self._consumed_locked(traj):
                self.stats.already_consumed += 1
                return Added.CONSUMED
            if traj.trajectory_id in self._limbo:
                self.stats.duplicates += 1
                return Added.DUPLICATE
            group = self._groups.get(traj.prompt_id)
            if group is not None and traj.group_size != group.group_size:
                self.stats.mismatched += 1
                return Added.MISMATCH
            if group is not None and traj.sample_index in group.members:
                self.stats.duplicates += 1
                return Added.DUPLICATE
            if self._size >= self.capacity and group is None:
                # Full refuses only a trajectory that would open a new group: members of
                # buffered groups still come in (at most group_size - 1 each), or groups
                # that are all partial would fill the buffer and never complete.
                self.stats.dropped_full += 1
                return Added.FULL
            if group is None:
                group = self._groups[traj.prompt_id] = Group(traj.prompt_id, traj.group_size,
                                                             group_seq=traj.group_seq)
            group.members[traj.sample_index] = traj
            self._size += 1
            if traj.reward_error is not None:
                self.stats.reward_errors += 1
            if group.complete:
                self._completed_locked(group)
            return Added.YES

    def _consumed_locked(self, traj: Trajectory) -> bool:
        """Move the watermark to ``traj``'s, then: was its id consumed (or its group
        settled)? Caller holds the lock."""
        self.consumed.advance(traj.settled_below)
        return self.consumed.covers(traj.trajectory_id, traj.group_seq)

    def fail(self, traj: Trajectory, reason: str = "") -> None:
        """Give up on ``traj``'s sample: consumed (never trained), and its group
        completes without it."""
        with self._cond:
            self.consumed.add(traj.trajectory_id, traj.group_seq)
            if traj.trajectory_id in self.consumed:
                self.consumed.failed[traj.trajectory_id] = reason
            self.stats.failed += 1
            group = self._groups.get(traj.prompt_id)
            if not 0 <= traj.sample_index < traj.group_size or \
                    (group is not None and (group.group_size != traj.group_size
                                            or traj.sample_index in group.members)):
                return  # its group fields are what is wrong: they say nothing of a group
            if group is None:
                group = self._groups[traj.prompt_id] = Group(traj.prompt_id, traj.group_size,
                                                             group_seq=traj.group_seq)
            group.failed.add(traj.sample_index)
            if group.complete:
                self._completed_locked(group)

    def _completed_locked(self, group: Group) -> None:
        """``group`` just completed (caller holds the lock): wake the trainer, or mark it
        for dropping when dynamic sampling finds it uninformative (see
        :attr:`Group.rewards_failed` for the groups it keeps all the same)."""
        if self.dynamic_sampling and not (group.informative or group.rewards_failed):
            self._uninformative[group.prompt_id] = None
        else:
            self._cond.notify_all()

    def consumed_state(self) -> tuple[list[tuple[str, int]], int, dict[str, str]]:
        """``(consumed.items(), watermark, failed)`` read under the lock (for a checkpoint)."""
        with self._cond:
            return self.consumed.items(), self.consumed.watermark, dict(self.consumed.failed)

    def pop_dropped(self) -> list[str]:
        """Ids consumed without training (stale or filtered groups) since the last call.
        A filtered group's ids become consumed here: call it where they are logged."""
        with self._cond:
            for tid, seq in self._limbo.items():
                self.consumed.add(tid, seq)
            out = self._dropped + list(self._limbo)
            self._dropped, self._limbo = [], {}
            return out

    def pop_filtered(self) -> list[tuple[str, int]]:
        """Drop the complete uninformative groups now (dynamic sampling: their ids go to
        :meth:`pop_dropped`) and return ``(prompt_id, group_seq)`` of every group
        filtered since the last call (by this call or by :meth:`take`)."""
        with self._cond:
            self._filter_locked()
            out, self._filtered = self._filtered, []
            return out

    def _filter_locked(self) -> None:
        for prompt_id in self._uninformative:
            group = self._groups.get(prompt_id)
            if group is None or not group.complete:
                continue
            del self._groups[prompt_id]
            self._size -= len(group.members)
            for traj in group.trajectories():
                self._limbo[traj.trajectory_id] = traj.group_seq
            self._filtered.append((prompt_id, group.group_seq))
            self.stats.filtered += 1
        self._uninformative = {}

    def _ready(self, group: Group) -> bool:
        return group.complete and (not self.dynamic_sampling or group.informative
                                   or group.rewards_failed)

    def ready_groups(self) -> int:
        """Complete groups buffered that :meth:`take` would hand out (or drop as stale)."""
        with self._cond:
            return sum(1 for g in self._groups.values() if self._ready(g))

    def wait_ready(self, n_groups: int, timeout_s: float) -> bool:
        """Block until ``n_groups`` groups are ready (see :meth:`ready_groups`), or the
        timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: sum(1 for g in self._groups.values() if self._ready(g)) >= n_groups,
                timeout=timeout_s)

    def take(self, n_groups: int, trainer_version: int) -> list[Group]:
        """Hand out up to ``n_groups`` complete groups (oldest first) per the policy;
        with dynamic sampling, uninformative ones are dropped first (see
        :meth:`pop_filtered`)."""
        out: list[Group] = []
        with self._cond:
            self._filter_locked()
            for prompt_id in list(self._groups):
                if len(out) >= n_groups:
                    break
                group = self._groups[prompt_id]
                if not group.complete:
                    continue
                del self._groups[prompt_id]
                self._size -= len(group.members)
                if not group.members:  # every sample given up on
                    continue
                staleness = trainer_version - group.min_version()
                if self.policy == "staleness" and staleness > self.max_staleness:
                    if self.stale_action == "drop":
                        self.stats.dropped_stale += 1
                        self._mark_consumed(group, trainer_version)
                        self._dropped.extend(t.trajectory_id for t in group.trajectories())
                        continue
                    group.weight = self.downweight
                    self.stats.downweighted += 1
                out.append(group)
                self._mark_consumed(group, trainer_version)
        return out

    def _mark_consumed(self, group: Group, trainer_version: int) -> None:
        for traj in group.members.values():
            self.consumed.add(traj.trajectory_id, traj.group_seq)
            self.stats.staleness[trainer_version - traj.policy_version] += 1
