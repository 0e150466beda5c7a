"""Dispatch decisions of the three scheduling modes, as pure functions.

The manager (and the discrete-event simulator in ``tools/``) call these with
a view of the workers and get back how many new trajectories each worker may
take and which workers must pull which weight version first.

- ``laminar``: trajectory-level asynchrony. A worker at the latest version
  takes work up to its capacity. A stale worker that still holds trajectories
  gets nothing new (its batch drains at its version; repack can empty it); a
  stale worker that is empty pulls the latest version, then takes work.
- ``one-step`` / ``sync``: a global batch at a time, behind a barrier: batch
  ``b`` is generated only by workers at ``required_version(mode, b)`` — ``b``
  for sync (the trainer has trained every earlier batch), ``b - 1`` for
  one-step (generation of batch ``b`` overlaps training on batch ``b - 1``).

Invariant: no decision ever asks a worker that holds trajectories to change
weights; weights change only between trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerView", "DispatchPlan", "plan_laminar", "plan_barrier", "required_version"]


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


def plan_laminar(workers: list[WorkerView], latest: int) -> DispatchPlan:
    grants: dict[str, int] = {}
    pulls: dict[str, int] = {}
    for w in workers:
        if w.pulling is not None:
            continue
        if w.version < latest:
            if w.assigned == 0:
                pulls[w.worker_id] = latest
            continue
        if w.free > 0:
            grants[w.worker_id] = w.free
    return DispatchPlan(grants, pulls)


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
