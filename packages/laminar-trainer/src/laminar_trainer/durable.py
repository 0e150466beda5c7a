"""Acks after the checkpoint that covers them: the trainer's half of exactly-once.

The trajectories a step consumed (trained, or dropped as too stale or filtered) are
acked to the manager only once they are durable for the trainer: after the checkpoint
that records them (every ``checkpoint.every_steps`` and at the last step), or at
once when the trainer keeps no checkpoints. A checkpoint holds the door's consumed
ids, taken atomically against the receive thread (ids polled but not trained yet stay
out: their workers send them again to a resumed trainer), and the final rejections
it records go out with its acks. A graceful stop checkpoints the steps since the last
one. It never references the trainer service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from laminar_common.consume.consumer import TrajectoryConsumer

from .backend import PolicyBackend
from .checkpoint import TrainerState
from .config import TrainerConfig

__all__ = ["AckAfterCheckpoint"]

log = logging.getLogger(__name__)


class AckAfterCheckpoint:
    """Checkpoints and the acks that follow them (see module docstring)."""

    def __init__(self, config: TrainerConfig, policy: PolicyBackend,
                 door: Callable[[], TrajectoryConsumer]) -> None:
        self.config = config
        self.policy = policy
        self._door = door
        self.unacked: list[str] = []
        """Ids consumed by steps (trained, or dropped as stale or filtered) not acked yet."""
        self.last_step = 0
        """The step of the latest checkpoint (the one resumed from, at start)."""

    def consumed(self, ids: Iterable[str]) -> None:
        self.unacked.extend(ids)

    def step_done(self, step: int, version: int) -> None:
        """After a step's rows: checkpoint when due (acks follow it), or ack at once
        without checkpoints."""
        cfg = self.config
        if not cfg.checkpoint.dir:
            self.ack()
        elif step % cfg.checkpoint.every_steps == 0 or step == cfg.total_steps:
            self.checkpoint(step, version)

    def final(self, step: int, version: int) -> None:
        """A graceful stop (or the data ran out): checkpoint the steps since the last one
        and ack them, so a resumed trainer starts where this one stopped."""
        if not self.config.checkpoint.dir or step <= self.last_step:
            return
        log.info("stopping: a final checkpoint at step %d", step)
        self.checkpoint(step, version)

    def checkpoint(self, step: int, version: int) -> None:
        t0 = time.monotonic()
        door = self._door().state(trained=self.unacked)
        kept = door["consumed"]
        state = TrainerState(step, version, [i for i, _ in kept], self.config.seed,
                             consumed_seqs=[q for _, q in kept],
                             settled_below=door["settled_below"], failed=door["failed"])
        self.policy.checkpoint(state)
        log.info("checkpoint at step %d in %.2fs", step, time.monotonic() - t0)
        self.last_step = step
        self.ack()

    def ack(self) -> None:
        """Everything consumed is durable now: ack it (with the final rejections the
        checkpoint recorded; the door re-sends what a manager did not take). The acks
        carry the step and version the trainer stamped on the door after the step."""
        ids, self.unacked = self.unacked, []
        self._door().ack(ids)
