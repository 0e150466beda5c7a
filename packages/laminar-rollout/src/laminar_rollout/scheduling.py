"""Dispatch decisions of the three scheduling modes, as pure functions.

The manager (and the discrete-event simulator in ``tools/``) call these with
a view of the workers and get back how many new trajectories each worker may
take and which workers must pull which weight version first.

- ``laminar``: trajectory-level asynchrony (:func:`plan_dispatch`). New prompt
  groups are admitted while the pending work is below the workers' total
  capacity and the admission bounds allow (:class:`Admission`: ``max_staleness``,
  at most ``(latest + 1 + bound) * batch`` trajectories created; ``max_waiting``,
  fewer than that many batches of finished work waiting for the trainer). Workers at the
  latest version share what can be granted by water-filling: the least loaded
  are raised first, so when the bound binds the work is spread instead of
  piled on the first workers in line. A stale worker that still holds
  trajectories gets nothing new (its batch drains at its version; repack can
  empty it); a stale worker that is empty pulls the latest version.
- ``one-step`` / ``sync``: a global batch at a time, behind a barrier: batch
  ``b`` is generated only by workers at ``required_version(mode, b)`` — ``b``
  for sync (the trainer has trained every earlier batch), ``b - 1`` for
  one-step (generation of batch ``b`` overlaps training on batch ``b - 1``).

Invariant: no decision ever asks a worker that holds trajectories to change
weights; weights change only between trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerView", "DispatchPlan", "Admission", "plan_dispatch", "water_fill",
           "plan_barrier", "required_version"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the scheduler needs to know about one live worker."""

    worker_id: str
    version: int
    capacity: int
    assigned: int
    pulling: int | None = None

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.assigned)


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    grants: dict[str, int]
    pulls: dict[str, int]
    new_groups: int = 0
    """Prompt groups to create before granting (laminar mode)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """Laminar mode's admission: two bounds, each optional.

    - ``max_staleness`` (run-ahead): at most ``(latest + 1 + max_staleness) *
      batch_groups`` groups created (plus one per group the trainer filtered out), so
      no trajectory *starts* more than ``max_staleness`` versions ahead of the one that
      will train it. It counts work in flight too, so a long tail holding slots stops
      admission while other slots are free.
    - ``max_waiting`` (over-production): no new group while ``max_waiting *
      batch_groups`` groups' worth of finished trajectories wait for the trainer. It
      counts only finished work, so slots never idle while the trainer is short of
      work; a trajectory's staleness is then its own generation time in trainer steps
      plus at most ``max_waiting`` steps of waiting.

    None: that bound is off.
    """

    batch_groups: int
    group_size: int
    max_staleness: int | None = 1
    max_waiting: int | None = None

    def room(self, latest: int, created: int, filtered_groups: int = 0,
             waiting: int = 0) -> int | None:
        """Trajectories that may still be created (None: unbounded); ``waiting``:
        finished trajectories the trainer has not consumed yet."""
        if self.max_waiting is not None and \
                waiting >= self.max_waiting * self.batch_groups * self.group_size:
            return 0
        if self.max_staleness is None:
            return None
        allowed = ((latest + 1 + self.max_staleness) * self.batch_groups
                   + filtered_groups) * self.group_size
        return max(0, allowed - created)


def water_fill(workers: list[WorkerView], budget: int) -> dict[str, int]:
    """Split ``budget`` trajectories over ``workers`` so the least loaded rise first.

    Each worker ends at ``min(capacity, L)`` or ``L + 1`` trajectories for one level
    ``L`` (never above its capacity; workers already above ``L`` get nothing); ties
    at the top level go to workers in the order given.
    """
    budget = min(budget, sum(w.free for w in workers))
    if budget <= 0:
        return {}

    def filled(level: int) -> int:
        return sum(min(w.free, max(0, level - w.assigned)) for w in workers)

    lo, hi = 0, max(w.capacity for w in workers)
    while lo < hi:  # the highest level whose fill fits the budget
        mid = (lo + hi + 1) // 2
        if filled(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    grants = {w.worker_id: min(w.free, max(0, lo - w.assigned)) for w in workers}
    left = budget - sum(grants.values())
    for w in workers:
        if left == 0:
            break
        if grants[w.worker_id] < w.free and w.assigned + grants[w.worker_id] == lo:
            grants[w.worker_id] += 1
            left -= 1
    return {wid: n for wid, n in grants.items() if n > 0}


def plan_dispatch(workers: list[WorkerView], latest: int, *, pending: int, created: int,
                  admission: Admission, filtered_groups: int = 0, waiting: int = 0,
                  can_create: bool = True, want: int | None = None) -> DispatchPlan:
    """Laminar mode's whole dispatch decision (the manager and the simulator run it).

    Args:
        workers: every live worker.
        latest: the newest published weight version.
        pending: trajectories created and not yet dispatched.
        created: trajectories created over the run (what the bound counts).
        admission: the run-ahead bound.
        filtered_groups: groups the trainer filtered out (each may be replaced).
        waiting: finished trajectories the trainer has not consumed (``max_waiting``).
        can_create: False when the prompt source is exhausted.
        want: pending work to keep (default: the total capacity of ``workers``; a
            caller that passes only some workers passes the total of all).

    Returns:
        ``new_groups`` to create first, then ``grants`` (water-filled over the
        latest-version workers, at most the pending work after creation) and
        ``pulls`` (empty stale workers).
    """
    pulls = {w.worker_id: latest for w in workers
             if w.pulling is None and w.version < latest and w.assigned == 0}
    if want is None:
        want = sum(w.capacity for w in workers)
    room = admission.room(latest, created, filtered_groups, waiting)
    new_groups = 0
    if can_create:
        gs = admission.group_size
        while pending + new_groups * gs < want and (room is None or (new_groups + 1) * gs <= room):
            new_groups += 1
    ready = [w for w in workers if w.pulling is None and w.version >= latest]
    grants = water_fill(ready, pending + new_groups * admission.group_size)
    return DispatchPlan(grants, pulls, new_groups)


def required_version(mode: str, batch: int) -> int:
    if mode == "sync":
        return batch
    if mode == "one-step":
        return max(0, batch - 1)
    raise ValueError(f"mode {mode!r} has no batch barrier")


def plan_barrier(workers: list[WorkerView], required: int, latest: int,
                 share: int | None = None) -> DispatchPlan:
    """Grants for a barrier batch that needs weights ``required`` (<= ``latest``).

    ``share`` spreads the batch: a worker holds at most ``share`` trajectories of
    it (the manager passes ceil(batch / live workers)), instead of the first
    workers in line taking the whole batch while the rest idle.
    """
    grants: dict[str, int] = {}
    pulls: dict[str, int] = {}
    for w in workers:
        if w.pulling is not None:
            continue
        if w.version < required:
            if w.assigned == 0 and latest >= required:
                pulls[w.worker_id] = required
            continue
        n = w.free if share is None else min(w.free, share - w.assigned)
        if n > 0:
            grants[w.worker_id] = n
    return DispatchPlan(grants, pulls)
