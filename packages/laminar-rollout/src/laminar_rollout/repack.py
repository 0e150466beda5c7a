"""Dynamic repack planning: a pure function over worker loads.

Long-tail generation leaves stale workers (weights older than the latest
version) holding a few slow trajectories each, which keeps them from pulling
new weights. Repack consolidates those stragglers onto as few workers of the
same version as possible, so the emptied ones pull the newest weights and take
fresh prompts. Migrated trajectories keep their policy version (they move as
prompt + generated tokens and are re-prefilled on the destination).

Rule (DESIGN.md, Dynamic repack): group workers by weight version; in a group,
a worker whose queue is empty and whose load (KV use or active slots) is
falling is a candidate source. Sources are taken smallest load first; each is
packed whole into the *fullest* destination of its group that still fits both
the KV capacity and the decode-batch limit (best fit). A worker that received
trajectories in this plan is never also emptied.

By default only stale groups (version < latest) are repacked: a worker at the
latest version with free slots is simply given fresh prompts. The manager
reads "falling" as *draining*: the worker holds fewer trajectories than at
its peak since its weights went stale (a worker left with one straggler has a
flat load, but it is exactly the one repack should empty).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

__all__ = ["WorkerLoad", "RepackMove", "plan_repack"]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    worker_id: str
    version: int
    active: int
    max_batch: int
    kv_used: int
    kv_capacity: int
    falling: bool = True
    queue_empty: bool = True


@dataclass(frozen=True, slots=True)
class RepackMove:
    source: str
    destination: str
    trajectories: int
    kv_tokens: int


def plan_repack(workers: list[WorkerLoad], latest: int, *, include_latest: bool = False,
                min_sources: int = 1) -> list[RepackMove]:
    """Plan which workers to empty into which (see module docstring).

    Returns:
        moves, one per emptied source; empty when fewer than ``min_sources``
        workers can be emptied.
    """
    groups: dict[int, list[WorkerLoad]] = defaultdict(list)
    for w in workers:
        if w.version < latest or include_latest:
            groups[w.version].append(w)
    moves: list[RepackMove] = []
    for members in groups.values():
        active = {w.worker_id: w.active for w in members}
        kv = {w.worker_id: w.kv_used for w in members}
        receivers: set[str] = set()
        emptied: set[str] = set()
        sources = sorted(
            (w for w in members if w.active > 0 and w.queue_empty and w.falling),
            key=lambda w: (w.active, w.kv_used, w.worker_id),
        )
        for src in sources:
            if src.worker_id in receivers:
                continue
            best: WorkerLoad | None = None
            for dst in members:
                if dst.worker_id == src.worker_id or dst.worker_id in emptied:
                    continue
                fits_batch = active[dst.worker_id] + active[src.worker_id] <= dst.max_batch
                fits_kv = dst.kv_capacity <= 0 or \
                    kv[dst.worker_id] + kv[src.worker_id] <= dst.kv_capacity
                if not (fits_batch and fits_kv) or active[dst.worker_id] == 0:
                    continue
                if best is None or (active[dst.worker_id], kv[dst.worker_id]) > \
                        (active[best.worker_id], kv[best.worker_id]):
                    best = dst
            if best is None:
                continue
            moves.append(RepackMove(src.worker_id, best.worker_id, active[src.worker_id],
                                    kv[src.worker_id]))
            active[best.worker_id] += active[src.worker_id]
            kv[best.worker_id] += kv[src.worker_id]
            active[src.worker_id] = kv[src.worker_id] = 0
            receivers.add(best.worker_id)
            emptied.add(src.worker_id)
    return moves if len(moves) >= min_sources else []
