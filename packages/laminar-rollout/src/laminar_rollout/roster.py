"""The manager's workers: who is connected, who is lost, and how fast their work recovers.

:class:`Roster` holds each connected worker's state (:meth:`Roster.report` takes its load
reports, their progress and finished ids going into the ledger), declares a worker lost
when it is silent for ``worker_timeout_s`` (not counting a stall of the manager's own
loop) or cut off from the trainer that long while other workers reach it (a partition:
its finished work cannot be delivered), hands a lost worker's trajectories back to the
ledger (resumable from their partial tokens, or to generate again), and times each
recovery (last heard from -> all of its work dispatched again).
It never references the manager service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from laminar_common.codec import PartialProgress, WorkerReport

from .ledger import PENDING, TrajectoryLedger
from .repack import KvLifecycle
from .telemetry import ManagerStats

__all__ = ["Roster", "WorkerState", "Recovery"]

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    worker_id: str
    version: int = -1
    capacity: int = 0
    active: int = 0
    queued: int = 0
    kv_used: int = 0
    kv_capacity: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    pulling: int | None = None
    kv: KvLifecycle = field(default_factory=KvLifecycle)
    """KV use since the worker was last given work: repack empties it in its fall."""
    trainer_down_s: float = 0.0
    """How long its link to the trainer has been down, as it last reported (0.0: up)."""


@dataclass
class Recovery:
    """A lost worker's trajectories on their way back to live workers."""

    worker_id: str
    last_seen: float
    ids: set[str]


class Roster:
    """The connected workers (see module docstring).

    Args:
        forget: drop a worker's connection at the socket.
        migrations: trajectory id -> (destination, since) of repack migrations under way
            (a migration lost with its source is dropped).
    """

    def __init__(self, worker_timeout_s: float, ledger: TrajectoryLedger, stats: ManagerStats,
                 forget: Callable[[str], None], migrations: dict) -> None:
        self.worker_timeout_s = worker_timeout_s
        self.ledger = ledger
        self.stats = stats
        self._forget = forget
        self._migrations = migrations
        self.workers: dict[str, WorkerState] = {}
        self.recoveries: list[Recovery] = []
        self.still_cut: dict[str, float] = {}
        """Workers let go as cut off from the trainer, until they report their link back."""
        self._last_check = time.monotonic()

    def expire_silent(self) -> None:
        """Workers silent for ``worker_timeout_s`` are lost; so are workers cut off from
        the trainer that long while others reach it."""
        now = time.monotonic()
        gap, self._last_check = now - self._last_check, now
        if gap > 1.0:
            # This loop itself did not run (the manager was paused or starved): the
            # workers were not silent, we were not listening. Their queued messages
            # arrive over the next moments, so count their silence from now.
            for w in self.workers.values():
                w.last_seen = max(w.last_seen, now)
            log.warning("the manager's loop stalled for %.1fs; not counting it as worker "
                        "silence", gap)
            return
        for wid, w in list(self.workers.items()):
            if now - w.last_seen > self.worker_timeout_s:
                self.lost(wid, f"silent for {now - w.last_seen:.1f}s")
        self._expire_cut_off()

    def report(self, w: WorkerState, msg: WorkerReport) -> None:
        """A worker's load report: its state, its unfinished trajectories' progress and
        the ids it finished."""
        for p in msg.progress:
            self.progress(w.worker_id, p)
        w.version = msg.policy_version
        w.capacity = msg.max_batch
        w.active, w.queued = msg.active, msg.queued
        w.kv_used, w.kv_capacity = msg.kv_used_tokens, msg.kv_capacity_tokens
        w.kv.observe(msg.kv_used_tokens if msg.kv_capacity_tokens > 0 else msg.active)
        w.trainer_down_s = msg.trainer_down_s
        if not msg.trainer_down_s:
            self.still_cut.pop(w.worker_id, None)
        if w.pulling is not None and msg.policy_version >= w.pulling:
            w.pulling = None
        for tid in msg.done:
            self.ledger.mark_done(tid, w.worker_id)

    def progress(self, worker_id: str, p: PartialProgress) -> None:
        """New tokens of an unfinished trajectory, into the ledger's copy."""
        self.ledger.record_partial(p.trajectory_id, worker_id, p.policy_version, p.token_ids,
                                   p.logprobs, p.offset)

    def cut_off(self) -> set[str]:
        """Workers that report no link to the trainer while another worker has one: cut
        off from it (a partition), not a trainer that is gone (then every worker says so
        and the outboxes deliver to its next incarnation)."""
        down = {wid for wid, w in self.workers.items() if w.trainer_down_s > 0}
        return down if len(down) < len(self.workers) else set()

    def _expire_cut_off(self) -> None:
        """A worker cut off from the trainer for ``worker_timeout_s`` cannot deliver what it
        finished: its work is generated again elsewhere (its copies, if the link heals, are
        refused by id at the trainer), and it gets no new work until its link is back."""
        for wid in self.cut_off():
            w = self.workers[wid]
            if w.trainer_down_s > self.worker_timeout_s and (
                    self.ledger.assigned(wid) or self.ledger.finished_unacked(wid)):
                self.stats.workers_cut_off += 1
                self.still_cut[wid] = w.trainer_down_s
                self.lost(wid, f"no link to the trainer for {w.trainer_down_s:.1f}s "
                                       "while other workers reach it")

    def lost(self, worker_id: str, why: str, forget: bool = True) -> None:
        """A worker is gone (or restarted): what it held is resumed or generated again
        elsewhere, and its recovery is timed."""
        w = self.workers.pop(worker_id, None)
        if forget:
            self._forget(worker_id)
        resumable, again = self.ledger.worker_lost(worker_id)
        for tid in resumable + again:  # lost with the source: not a migration any more
            self._migrations.pop(tid, None)
        self.ledger.restart_unresumable({w.version for w in self.workers.values()})
        self.stats.workers_lost += 1
        last_seen = w.last_seen if w is not None else time.monotonic()
        self.recoveries.append(Recovery(worker_id, last_seen, set(resumable + again)))
        self.settle_recoveries()
        log.warning("worker %s lost (%s): %d trajectories resumable, %d to generate again",
                    worker_id, why, len(resumable), len(again))

    def settle_recoveries(self) -> None:
        """Close the recoveries whose trajectories all left ``pending``."""
        now = time.monotonic()
        for rec in list(self.recoveries):
            rec.ids = {t for t in rec.ids if (e := self.ledger.entries.get(t)) is not None
                       and e.state == PENDING}
            if not rec.ids:
                self.recoveries.remove(rec)
                self.stats.recovery_seconds.append(now - rec.last_seen)
                log.info("worker %s recovered: its work is running again %.2fs after it was "
                         "last heard from", rec.worker_id, now - rec.last_seen)
