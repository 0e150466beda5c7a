"""What goes to which worker: trajectories, weight pulls and repack moves.

:class:`Dispatch` turns the scheduler's plans (:mod:`.scheduling`) into messages: the
weight pulls and the grants of pending trajectories, resumable trajectories placed on a
worker at their version, migrations (repack, :mod:`.repack`) placed on their planned
destination and timed, and repack rounds. New work never goes to a worker cut off from
the trainer. It never references the manager service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from laminar_common import codec

from .config import RepackConfig
from .ledger import TrajectoryLedger
from .repack import WorkerLoad, plan_repack
from .roster import WorkerState
from .scheduling import WorkerView
from .telemetry import ManagerStats

__all__ = ["Dispatch"]

log = logging.getLogger(__name__)


class Dispatch:
    """Sends the plans (see module docstring).

    Args:
        send: ``send(worker_id, message) -> bool``.
        cut_off: the workers cut off from the trainer (no new work for them).
        laminar: the manager's mode is ``laminar`` (repack runs only there).
        migrations: trajectory id -> (planned destination, when the export was
            commanded), shared with the roster (a migration lost with its source goes).
    """

    def __init__(self, workers: dict[str, WorkerState], ledger: TrajectoryLedger,
                 stats: ManagerStats, send: Callable[[str, codec.Message], bool],
                 cut_off: Callable[[], set[str]], repack: RepackConfig, laminar: bool,
                 migrations: dict[str, tuple[str, float]]) -> None:
        self.workers = workers
        self.ledger = ledger
        self.stats = stats
        self._send = send
        self._cut_off = cut_off
        self.repack = repack
        self.laminar = laminar
        self.migrations = migrations
        self._last_repack = time.monotonic()

    def views(self) -> list[WorkerView]:
        """The workers new work may go to: not those cut off from the trainer."""
        cut_off = self._cut_off()
        return [WorkerView(w.worker_id, w.version, w.capacity, self.ledger.assigned(w.worker_id),
                           w.pulling) for w in self.workers.values()
                if w.version >= 0 and w.worker_id not in cut_off]

    def place(self, tid: str, worker_id: str) -> bool:
        """Dispatch one pending trajectory to a chosen live worker."""
        w = self.workers.get(worker_id)
        if w is None or w.pulling is not None:
            return False
        task = self.ledger.take_specific(tid, worker_id, w.version)
        if task is None:
            return False
        if not self._send(worker_id, task):
            return False
        w.kv.refill()
        self.stats.dispatched += 1
        migration = self.migrations.pop(tid, None)
        if migration is not None:
            self.stats.migrations_placed += 1
            self.stats.migration_seconds += time.monotonic() - migration[1]
        return True

    def place_resumables(self, views: list[WorkerView]) -> None:
        """Unfinished trajectories with tokens go to a worker at their version."""
        free = {v.worker_id: v.free for v in views if v.pulling is None}
        for tid, version in self.ledger.pending_resumable():
            for v in views:
                if v.version == version and free.get(v.worker_id, 0) > 0:
                    if self.place(tid, v.worker_id):
                        free[v.worker_id] -= 1
                    break

    def apply(self, plan) -> None:
        """Send a plan's weight pulls and grants (pending trajectories) to the workers."""
        for wid, version in plan.pulls.items():
            if self._send(wid, codec.PullWeights(version=version)):
                self.workers[wid].pulling = version
                self.stats.pulls_commanded += 1
        for wid, n in plan.grants.items():
            w = self.workers[wid]
            tasks = self.ledger.take_pending(wid, w.version, n)
            if tasks:
                w.kv.refill()
            for task in tasks:
                if not self._send(wid, task):
                    break
                self.stats.dispatched += 1

    def maybe_repack(self, latest: int, force: bool = False) -> None:
        """A repack round when due (laminar mode, ``repack.enabled``): workers whose KV use
        is falling and whose queue is empty hand their trajectories to a few others
        (:func:`~laminar_rollout.repack.plan_repack`), so they pull fresh weights."""
        cfg = self.repack
        if not self.laminar or not cfg.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_repack < cfg.interval_s:
            return
        self._last_repack = now
        # "Queue empty" = no more work is coming its way: nothing waits for it, or it
        # is stale (stale workers get no fresh prompts; what it has queued but not
        # started leaves with the repack like the rest).
        loads = [
            WorkerLoad(w.worker_id, w.version, self.ledger.assigned(w.worker_id), w.capacity,
                       w.kv_used, w.kv_capacity, falling=w.kv.falling,
                       queue_empty=(w.queued == 0 and self.ledger.pending_count() == 0)
                       or w.version < latest)
            for w in self.workers.values() if w.version >= 0 and w.pulling is None
        ]
        moves = plan_repack(loads, latest, min_sources=cfg.min_sources)
        if not moves:
            return
        t0 = time.monotonic()
        for move in moves:
            ids = tuple(self.ledger.held_by(move.source))
            if ids and self._send(move.source, codec.ExportTrajectories(trajectory_ids=ids)):
                self.stats.repack_migrated += len(ids)
                for tid in ids:
                    self.migrations[tid] = (move.destination, t0)
        self.stats.repacks += 1
        self.stats.repack_seconds += time.monotonic() - t0
        log.info("repack: emptying %d workers (%s)", len(moves),
                 ", ".join(f"{m.source}->{m.destination}" for m in moves))
