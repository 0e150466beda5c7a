"""The step loop's supply of groups: wait for them, say why while waiting, end a run
whose data ran out.

:class:`GroupFeed` hands the training loop complete groups from the buffer. While it
waits it tells the manager (through the trajectory door) of groups dynamic sampling
dropped, so that as many more are generated; warns when dynamic sampling drops many
groups and no step comes; every ``WAIT_REASON_EVERY_S`` prints why it waits (from the
manager's status in etcd: only a starved trainer reads etcd, never a step); and ends
the wait when no more data will come (``on_data_exhausted``) or none came for
``wait_timeout_s``.

It never references the trainer service: what it needs of the loop (the step and
version, the ids held unacked) comes in as callables.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from laminar_common.consume.consumer import TrajectoryConsumer
from laminar_common.errors import LaminarError
from laminar_common.membership import Coordinator
from laminar_common.roles import State
from laminar_common.status import StatusWriter

from .buffer import ExperienceBuffer, Group
from .config import TrainerConfig
from .console import WAIT_REASON_EVERY_S, nothing_more_coming, why_waiting

__all__ = ["GroupFeed"]

log = logging.getLogger(__name__)


class GroupFeed:
    """Complete groups for the training loop (see module docstring).

    Args:
        position: the loop's ``(step, version)`` now.
        held: how many trajectories the trainer holds unacked beyond the buffer.
    """

    def __init__(self, config: TrainerConfig, buffer: ExperienceBuffer,
                 door: Callable[[], TrajectoryConsumer], status: Callable[[], StatusWriter],
                 coordinator: Callable[[], Coordinator], stopping: threading.Event,
                 position: Callable[[], tuple[int, int]], held: Callable[[], int]) -> None:
        self.config = config
        self.buffer = buffer
        self._door, self._status, self._coordinator = door, status, coordinator
        self.stopping = stopping
        self._position = position
        self._held = held
        self.ended_early: str | None = None
        """Why the run ended before ``total_steps`` (``on_data_exhausted: finish``)."""
        self.filtered_since_step = 0
        """Groups dynamic sampling dropped since the last :meth:`step_done`."""
        self._starved_warn_at = 0
        self.stream_wait = 0.0
        """A streamed step's wait for its later mini-batches (see :meth:`more`)."""
        self.stream_groups: list[Group] = []

    def take(self, n_groups: int) -> list[Group] | None:
        """Up to ``n_groups`` groups once that many are ready ([] if the buffer dropped
        them all as too stale); None if the loop is to stop (a signal, or the data ran
        out with ``on_data_exhausted: finish``)."""
        if not self.wait_for(n_groups):
            return None
        return self.buffer.take(n_groups, self._position()[1])

    def take_exactly(self, n_groups: int) -> list[Group]:
        """``n_groups`` groups at the trainer's version (the buffer may drop some it holds
        as too stale: then more are waited for); [] if the loop is to stop."""
        groups: list[Group] = []
        while len(groups) < n_groups:
            if not self.wait_for(n_groups - len(groups)):
                return []
            groups += self.buffer.take(n_groups - len(groups), self._position()[1])
        return groups

    def start_step(self) -> None:
        self.stream_wait, self.stream_groups = 0.0, []

    def more(self, n_groups: int) -> list[Group]:
        """A streamed step's next mini-batch (``train_step``'s ``more``): [] ends the step
        early when the loop is to stop; the wait counts as waiting, not training."""
        t0 = time.monotonic()
        groups = self.take_exactly(n_groups)
        self.stream_wait += time.monotonic() - t0
        self.stream_groups += groups
        return groups

    def note_filtered(self) -> None:
        """Tell the manager at once of groups dynamic sampling dropped, so it generates as
        many more (nothing durable in it: it credits each group once, however often
        told; the door tells a new manager incarnation again)."""
        groups = self.buffer.pop_filtered()
        if groups:
            self.filtered_since_step += len(groups)
            self._door().groups_filtered(groups)

    def step_done(self) -> int:
        """A step consumed its groups: the filtered groups counted for it (since the last
        step), and the starvation warning starts over."""
        n, self.filtered_since_step, self._starved_warn_at = self.filtered_since_step, 0, 0
        return n

    def wait_for(self, n_groups: int) -> bool:
        """Block until ``n_groups`` groups are ready; False if the loop is to stop.
        Filtered groups are told and a starved trainer warns meanwhile; no data for
        ``wait_timeout_s`` is an error."""
        t0 = time.monotonic()
        timeout_s = self.config.wait_timeout_s
        said_at, why, drained = t0, "", 0
        while not self.buffer.wait_ready(n_groups, timeout_s=0.2):
            if self.stopping.is_set():
                return False
            self.note_filtered()
            self._warn_if_starved()
            now = time.monotonic()
            step, version = self._position()
            if now - said_at >= WAIT_REASON_EVERY_S:
                said_at = now
                why, over = self._why_waiting()
                print(f"WAITING {now - t0:.0f}s for {n_groups} group(s) at step "
                      f"{step + 1}: {why}", flush=True)
                self._status().put(State.TRAINER, json.dumps(
                    {"step": step, "version": version, "waiting_s": round(now - t0),
                     "waiting_for": why, "total_steps": self.config.total_steps,
                     "time": time.time()}).encode())
                # Twice in a row (a check apart): what was generated has had time to come.
                drained = drained + 1 if over else 0
                if drained >= 2:
                    return self._data_ran_out(why, step)
            if now - t0 > timeout_s:
                raise LaminarError(f"no {n_groups} complete group(s) of data for "
                                   f"{timeout_s:.0f}s (wait_timeout_s) at step {step + 1}"
                                   + (f": {why}" if why else ""))
        return True

    def _why_waiting(self) -> tuple[str, bool]:
        """(see :func:`.console.why_waiting`, whether no more data will come), from the
        manager's status read from etcd."""
        try:
            raw = self._coordinator().get_state(State.MANAGER)
        except LaminarError as exc:
            return (f"{self.buffer.ready_groups()} complete group(s) held; the manager's "
                    f"status cannot be read from etcd ({exc})"), False
        held = len(self.buffer) + self._held()
        return why_waiting(self.buffer.ready_groups(), raw), nothing_more_coming(raw, held)

    def _data_ran_out(self, why: str, step: int) -> bool:
        """No more data will come before ``total_steps`` (see ``on_data_exhausted``):
        end the run here (``finish``; returns False, the loop's "stop"), or fail now
        naming the cause (``fail``)."""
        cfg = self.config
        if cfg.on_data_exhausted == "fail":
            raise LaminarError(
                f"no more data will come at step {step + 1} of {cfg.total_steps}: {why}; "
                "set on_data_exhausted: finish to end such a run with its final eval and model")
        self.ended_early = f"the data ran out at step {step + 1} of {cfg.total_steps}: {why}"
        print(f"DATA EXHAUSTED: {self.ended_early}; finishing here (on_data_exhausted: "
              "finish): the final eval and model follow", flush=True)
        return False

    def _warn_if_starved(self) -> None:
        """Dynamic sampling has dropped many groups with no step: every group scores the
        same (a broken reward or answer key looks like this). Logged at 4x, 8x, 16x ...
        ``batch_groups`` filtered groups since the last step."""
        n, batch = self.filtered_since_step, self.config.batch_groups
        if n < max(self._starved_warn_at, 4 * batch):
            return
        self._starved_warn_at = 2 * max(self._starved_warn_at, 4 * batch)
        log.warning("dynamic sampling dropped %d groups since step %d (all rewards equal in "
                    "each) and the step still waits for %d informative groups; check the "
                    "reward, the data's answer_key, and reward_errors (%d so far)", n,
                    self._position()[0], batch, self.buffer.stats.reward_errors)
