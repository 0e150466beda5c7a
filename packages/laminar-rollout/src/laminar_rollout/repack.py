"""Dynamic repack planning: a pure function over worker loads.

Long-tail generation leaves stale workers (weights older than the latest
version) holding a few slow trajectories each, which keeps them from pulling
new weights. Repack consolidates those stragglers onto as few workers of the
same version as possible, so the emptied ones pull the newest weights and take
fresh prompts. Migrated trajectories keep their policy version (they move as
prompt + generated tokens and are re-prefilled on the destination).

Rule (docs/design.md, Dynamic repack): group workers by weight version; in a group,
a worker whose queue is empty and whose load (KV use or active slots) is
falling is a candidate source. Sources are taken smallest load first; each is
packed whole into the *fullest* destination of its group that still fits both
the KV capacity and the decode-batch limit (best fit). A worker that received
trajectories in this plan is never also emptied.

"Falling" is the paper's KV-utilisation lifecycle (:class:`KvLifecycle`): after
a worker is given work its KV use climbs, plateaus while its batch decodes, and
falls as sequences finish; a worker is in its fall once its use has dropped a
fifth below the peak since it was last given work and is not climbing again (a
last straggler grows its KV by a token a step, which does not count as a
climb). The manager and the simulator both keep one per worker and call
:func:`plan_repack` with every version's group, the latest included: a draining
latest-version worker emptied now pulls the next version the moment it lands.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

__all__ = ["WorkerLoad", "RepackMove", "KvLifecycle", "kv_phase", "plan_repack"]

FALL_DROP = 0.2
"""A worker is falling once its KV use is this fraction below its peak."""
CLIMB_TOLERANCE = 0.02
"""A rise of less than this fraction of the peak between reports is not a climb."""


def kv_phase(peak: float, previous: float, current: float, *, drop: float = FALL_DROP,
             tolerance: float = CLIMB_TOLERANCE) -> str:
    """``"climb"``, ``"plateau"`` or ``"fall"`` of a KV-utilisation trace, from its peak
    since the worker was last given work and its last two samples."""
    if peak <= 0:
        return "climb"
    if current > previous + tolerance * peak:
        return "climb"
    if current <= (1 - drop) * peak:
        return "fall"
    return "plateau"


class KvLifecycle:
    """One worker's KV use since it was last given work (see :func:`kv_phase`).

    ``observe`` each reported use (KV tokens; active sequences where the engine
    reports no KV), ``refill`` when the worker is given new trajectories (the
    lifecycle starts again from its current use).
    """

    __slots__ = ("peak", "previous", "current")

    def __init__(self) -> None:
        self.peak = self.previous = self.current = 0.0

    def observe(self, used: float) -> None:
        self.previous, self.current = self.current, float(used)
        self.peak = max(self.peak, self.current)

    def refill(self) -> None:
        self.peak = self.previous = self.current

    @property
    def phase(self) -> str:
        return kv_phase(self.peak, self.previous, self.current)

    @property
    def falling(self) -> bool:
        return self.phase == "fall"


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


def plan_repack(workers: list[WorkerLoad], latest: int, *, include_latest: bool = True,
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
