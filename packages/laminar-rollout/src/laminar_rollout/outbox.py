"""A worker's finished trajectories until the trainer's durable ack: the outbox.

:class:`Outbox` holds every trajectory a worker finished and pushes it to the
trainer over one PUSH socket; it drops one only when the manager relays the
trainer's durable ack. Nothing finished is lost to a trainer restart or a cut link:

- a new trainer incarnation (a restart, at any address) gets the whole outbox again;
- the link to the trainer back after being down (a cut, a paused trainer): the whole
  outbox again at once, since what was in flight may be lost;
- a trajectory not acked in ``resend_after_s`` (doubling per push, at most 8x) is
  pushed again.

The trainer refuses copies it has by id. While the link is down, :attr:`down_s`
says how long (the worker reports it to the manager) and a warning says so after
``TRAINER_DOWN_SAY_AFTER_S``. One thread (the worker's loop) owns it.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable

from laminar_common.auth import CurveAuth
from laminar_common.codec import Trajectory
from laminar_common.errors import TransportError
from laminar_common.membership import MemberRecord
from laminar_common.transport import PushSender, make_push_sender

__all__ = ["Outbox", "TRAINER_DOWN_SAY_AFTER_S", "TRAINER_DOWN_SAY_EVERY_S"]

log = logging.getLogger(__name__)

TRAINER_DOWN_SAY_AFTER_S = 5.0
"""A link to the trainer down this long is said on the console."""
TRAINER_DOWN_SAY_EVERY_S = 10.0
"""How often it is said again while down."""


class Outbox:
    """Finished trajectories until acked (see module docstring).

    Args:
        counters: the worker's counters (``resent``, ``push_failed``,
            ``trainer_switches``, ``trainer_reconnects`` are counted there).
    """

    def __init__(self, resend_after_s: float, counters: collections.Counter[str],
                 auth: CurveAuth | None = None) -> None:
        self.resend_after_s = resend_after_s
        self.counters = counters
        self._auth = auth
        self.held: dict[str, Trajectory] = {}
        """Pushed, not yet acked: id -> trajectory."""
        self._resend_at: dict[str, tuple[float, int]] = {}
        """Per id: when to push it again unless acked, and how often it was pushed."""
        self._last_resend_check = 0.0
        self.trainer: PushSender | None = None
        self._trainer_key: tuple[str, float] | None = None
        self._reconnects = 0
        self.down_s = 0.0
        """How long the link to the trainer has been down, as last read (0.0: up)."""
        self._down_said = 0.0

    def __len__(self) -> int:
        return len(self.held)

    def __bool__(self) -> bool:
        return bool(self.held)

    def __iter__(self):
        return iter(self.held)

    def add(self, traj: Trajectory) -> None:
        """A finished trajectory: held until acked, and pushed now."""
        self.held[traj.trajectory_id] = traj
        self._push(traj)

    def acked(self, ids: Iterable[str]) -> None:
        """The trainer's durable acks (relayed by the manager): these ids go."""
        for tid in ids:
            self.held.pop(tid, None)
            self._resend_at.pop(tid, None)

    def set_trainer(self, record: MemberRecord) -> None:
        """A trainer registered: a new incarnation gets every unacked trajectory again; a
        re-registration of the same process changes nothing."""
        if record.incarnation == self._trainer_key:
            return
        if self.trainer is not None:
            self.trainer.close(linger_s=0)
        self.trainer = make_push_sender(record.address, send_timeout_s=5, auth=self._auth)
        self._trainer_key = record.incarnation
        self._reconnects = 0
        self.counters["trainer_switches"] += 1
        log.info("trainer %s at %s; re-sending %d unacked trajectories", record.member_id,
                 record.address, len(self.held))
        self._push_all()

    def tick(self) -> None:
        """Once per loop turn: follow the link, push again what is overdue."""
        self._watch_link()
        self._resend_overdue()

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()

    def _push_all(self) -> None:
        for traj in list(self.held.values()):
            self._push(traj)

    def _watch_link(self) -> None:
        if self.trainer is None:
            return
        reconnects = self.trainer.reconnects()
        if reconnects != self._reconnects:
            self._reconnects, self.down_s = reconnects, 0.0
            self.counters["trainer_reconnects"] += 1
            log.warning("link to the trainer is back; re-sending %d unacked trajectories",
                        len(self.held))
            self._push_all()
            return
        down = self.down_s = self.trainer.down_s()
        now = time.monotonic()
        if down >= TRAINER_DOWN_SAY_AFTER_S and now - self._down_said >= \
                TRAINER_DOWN_SAY_EVERY_S:
            self._down_said = now
            log.warning("no link to the trainer for %.0fs (%d finished trajectories waiting "
                        "in the outbox): cut off, or the trainer is gone", down,
                        len(self.held))

    def _resend_overdue(self) -> None:
        now = time.monotonic()
        if now - self._last_resend_check < 1.0 or self.trainer is None:
            return
        self._last_resend_check = now
        for tid, (due, _) in list(self._resend_at.items()):
            if due <= now and tid in self.held:
                self.counters["resent"] += 1
                self._push(self.held[tid])

    def _push(self, traj: Trajectory) -> None:
        if self.trainer is None:
            return
        _, pushes = self._resend_at.get(traj.trajectory_id, (0.0, 0))
        backoff = self.resend_after_s * min(2 ** pushes, 8)
        self._resend_at[traj.trajectory_id] = (time.monotonic() + backoff, pushes + 1)
        try:
            self.trainer.send(traj)
        except TransportError as exc:
            self.counters["push_failed"] += 1
            log.warning("push of %s to the trainer failed (kept in the outbox): %s",
                        traj.trajectory_id, exc)
