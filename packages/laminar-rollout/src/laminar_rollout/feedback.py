"""What the trainer tells the manager, applied: acks, rejections, filtered groups.

The trainer's acks (durable: after its checkpoint) mark trajectories consumed in the
ledger, and the manager relays them to the workers holding copies in their outboxes.
A rejection by content has the trajectory generated again, or (final) records it as
rejected; a rejection by a resumed trainer for too old weights is counted apart.
A filtered-group notice (dynamic sampling) credits one more group for each group not
credited before. The component never references the manager service: the ledger,
the stats, a send function and the workers' ids come in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from laminar_common import codec
from laminar_common.codec import GroupsFiltered, TrajectoryRejected
from laminar_common.consume.validation import STALE_AFTER_RESUME

from .ledger import TrajectoryLedger
from .telemetry import ManagerStats

__all__ = ["TrainerFeedback"]

log = logging.getLogger(__name__)


class TrainerFeedback:
    """Applies the trainer's messages (see module docstring).

    Args:
        send: ``send(worker_id, message) -> bool`` to a worker.
        workers: the connected workers' ids.
        refill: ``refill(n) -> added``: up to ``n`` more groups for filtered ones (the
            batch modes).
        batch: the open batch (None in laminar mode), named in the log.
    """

    def __init__(self, ledger: TrajectoryLedger, stats: ManagerStats,
                 send: Callable[[str, codec.Message], bool],
                 workers: Callable[[], Iterable[str]], refill: Callable[[int], int],
                 batch: Callable[[], int | None]) -> None:
        self.ledger = ledger
        self.stats = stats
        self._send = send
        self._workers = workers
        self._refill = refill
        self._batch = batch

    def acked(self, ack: codec.Ack) -> None:
        """Durable acks: the ledger counts them consumed; their workers drop their copies
        (every worker, for ids this manager cannot attribute)."""
        workers = set(self._workers())
        by_worker: dict[str, list[str]] = {}
        unattributed: list[str] = []
        for tid in ack.trajectory_ids:
            worker = self.ledger.mark_acked(tid)
            self.stats.acks += 1
            if worker is not None and worker in workers:
                by_worker.setdefault(worker, []).append(tid)
            else:
                unattributed.append(tid)
        for worker, ids in by_worker.items():
            self._send(worker, codec.Acked(trajectory_ids=tuple(ids)))
        if unattributed:
            # Acked again, or held by a worker this manager does not know (after a
            # restart): whichever worker keeps a copy in its outbox may drop it.
            for worker in workers:
                self._send(worker, codec.Acked(trajectory_ids=tuple(unattributed)))

    def rejected(self, msg: TrajectoryRejected) -> None:
        """The trainer refused a trajectory by content: generate it again, or (final)
        record it as rejected; either way its worker drops its copy."""
        stale = msg.reason.startswith(STALE_AFTER_RESUME)
        if self.ledger.trainer_rejected(msg.trajectory_id, msg.worker_id, msg.reason, msg.final):
            if stale:  # its weights, not its content: counted apart, said now and then
                self.stats.stale_after_resume += 1
                n = self.stats.stale_after_resume
                if n == 1 or n % 100 == 0:
                    log.warning("the resumed trainer refused %d trajectories from older weights "
                                "so far (%s: %s); generating them again", n,
                                msg.trajectory_id, msg.reason)
            else:
                self.stats.trainer_rejections += 1
                log.warning("trainer rejected %s from %s (%s): %s", msg.trajectory_id,
                            msg.worker_id,
                            "failed for good" if msg.final else "generating it again",
                            msg.reason)
        if msg.worker_id in self._workers():
            self._send(msg.worker_id, codec.Acked(trajectory_ids=(msg.trajectory_id,)))

    def filtered(self, msg: GroupsFiltered) -> None:
        """The trainer dropped these groups untrained (dynamic sampling): credit one more
        group for each not credited before (see module docstring)."""
        self.stats.filtered_notices += 1
        new = unknown = 0
        for prompt_id in msg.prompt_ids:
            marked = self.ledger.mark_filtered(prompt_id)
            new += marked is True
            unknown += marked is None
        if unknown:
            log.warning("trainer step %d: %d of %d filtered groups are unknown here "
                        "(not credited; %d so far)", msg.trainer_step, unknown,
                        len(msg.prompt_ids), self.ledger.counters.filtered_unknown)
        if not new:
            return
        added = self._refill(new)
        batch = self._batch()
        log.info("trainer step %d: %d groups filtered (%d in all)%s", msg.trainer_step, new,
                 self.ledger.filtered_groups,
                 f"; {added} added to batch {batch}" if batch is not None else "")
