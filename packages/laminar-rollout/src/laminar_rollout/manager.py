"""The rollout manager (``laminar-rollout manage``): prompt pool, dispatch, accounting.

Owns the prompt cursor, the :class:`~laminar_rollout.ledger.TrajectoryLedger`,
the view of every worker, and the scheduling loop. Workers connect over a
ZeroMQ ROUTER socket (hello handshake); the trainer sends durable acks,
rejections and filtered-group notices to a PULL socket. The manager registers in
etcd (role ``manager``) with both addresses, watches worker membership and
``weights/latest``.

One thread owns both sockets and the ledger (no locks around them); etcd
watch callbacks only post events to a queue that this thread drains.

Dynamic sampling: the trainer drops groups that teach nothing and says so
(:class:`~laminar_common.codec.GroupsFiltered`); each such group, once however
often it is named, buys one more group: in laminar mode it raises the run-ahead
bound by a group, in sync and one-step modes a group is added to the open
batch. Without it the trainer would wait for groups the bound never lets the
manager create.

Invariants: every trajectory is accounted for exactly once (see the ledger);
the manager never asks a worker holding trajectories to change weights.
"""

from __future__ import annotations

import json
import logging
import queue
import time

from laminar_common import codec
from laminar_common.codec import (
    GroupsFiltered,
    PartialProgress,
    PromptTask,
    SamplingSpec,
    TrajectoryRejected,
    WorkerReport,
)
from laminar_common.etcd import make_coordinator
from laminar_common.membership import MemberRecord, MembershipEvent, VersionRecord
from laminar_common.metrics import Metric, MetricsServer
from laminar_common.roles import Extra, Role, State
from laminar_common.service import Service, drain
from laminar_common.status import StatusWriter
from laminar_common.transport import (
    PullReceiver,
    Server,
    TransportError,
    make_pull_receiver,
    make_server,
)

from .config import ManagerConfig
from .dispatch import Dispatch
from .feedback import TrainerFeedback
from .ledger import ACKED, DONE, TrajectoryLedger
from .manager_state import ResumeHold, StateFile
from .prompts import PromptCursor, load_prompt_file
from .roster import Roster, WorkerState
from .scheduling import Admission, plan_barrier, plan_dispatch, required_version
from .telemetry import ManagerStats, manager_metrics, manager_summary
from .version import __version__

__all__ = ["ManagerService"]

log = logging.getLogger(__name__)



class ManagerService(Service):
    """See module docstring."""

    name = "manager"

    def __init__(self, config: ManagerConfig, coordinator=None, resume: bool = False) -> None:
        super().__init__()
        self.config = config
        self.coordinator = coordinator
        self.ledger = TrajectoryLedger(config.ledger_keep_groups)
        self.records = load_prompt_file(config.prompts, config.data)
        self.cursor = PromptCursor(self.records, config.epochs, config.max_prompts,
                                   shuffle=config.data.shuffle, seed=config.data.seed)
        self.sampling = SamplingSpec(**config.sampling.model_dump())
        self.latest = 0
        self._trainer_step = 0
        """The trainer's step at its latest published version (what ``max_waiting`` counts
        as consumed)."""
        self.batch = -1
        self.resume_hold = ResumeHold()
        """After ``--resume``: no new work until the running trainer's weights
        (:mod:`.manager_state`)."""
        self.state_file = StateFile(config)
        """``state_dir/manager_state.json`` (:mod:`.manager_state`)."""
        restored = self.state_file.restore(self.records, self.sampling) if resume else None
        if restored is not None:
            self.cursor, self.batch, self.ledger = restored.cursor, restored.batch, \
                restored.ledger
            self.resume_hold = ResumeHold(restored.hold)
        self.stats = ManagerStats()
        self.feedback = TrainerFeedback(self.ledger, self.stats, self._send,
                                        lambda: list(self.workers), self._refill,
                                        lambda: self.batch if config.mode != "laminar" else None)
        """The trainer's acks, rejections and filtered groups (:mod:`.feedback`)."""
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        migrations: dict[str, tuple[str, float]] = {}
        self.roster = Roster(config.worker_timeout_s, self.ledger, self.stats,
                             lambda wid: self.server.forget(wid), migrations)
        """The connected workers, lost ones and recoveries (:mod:`.roster`)."""
        self.workers = self.roster.workers
        self.dispatch = Dispatch(self.workers, self.ledger, self.stats, self._send,
                                 self.roster.cut_off, config.repack, config.mode == "laminar",
                                 migrations)
        """Pulls, grants, placements and repack rounds to the workers (:mod:`.dispatch`)."""
        self._last_log = 0.0
        self._last_ledger_log = 0.0
        self._drained_announced = False
        self.server: Server | None = None
        self.acks: PullReceiver | None = None
        self.metrics: MetricsServer | None = None
        self.status: StatusWriter | None = None

    # -- lifecycle --------------------------------------------------------------

    def _start(self) -> None:
        curve = self.config.auth.curve()
        where = self.config.addresses()
        self.server = make_server(self.config.listen or where.tcp(self.config.port),
                                  member_id=self.config.manager_id, auth=curve)
        self.acks = make_pull_receiver(self.config.ack_listen or where.tcp(self.config.ack_port),
                                       expect=(codec.Ack, TrajectoryRejected, GroupsFiltered),
                                       auth=curve)
        address, ack_address = (where.advertised(self.server.endpoint),
                                where.advertised(self.acks.endpoint))
        if self.coordinator is None:
            self.coordinator = make_coordinator(self.config.etcd, self.config.job)
        self.status = StatusWriter(self.coordinator, "manager status")
        self.coordinator.watch_members(self._on_member, role=Role.WORKER)
        self.coordinator.watch_latest(lambda rec: self._events.put(("latest", rec)))
        latest = self.coordinator.latest_version()
        if latest is not None:
            self.latest = latest.version
            self._trainer_step = _trainer_step(latest)
        if self.resume_hold.holding:
            self.resume_hold.start(latest, self.coordinator.members(Role.TRAINER))
        extra = {Extra.ACK: ack_address, Extra.MODE: self.config.mode, Extra.READY: "1"}
        if self.config.metrics.port is not None:
            self.metrics = MetricsServer(Role.MANAGER, self.config.job, self.config.manager_id,
                                         self._metrics)
            extra[Extra.METRICS] = self.metrics.start(self.config.metrics.host,
                                                  self.config.metrics.port, where.advertise)
        self.coordinator.register(MemberRecord(
            member_id=self.config.manager_id, role=Role.MANAGER, address=address,
            host_id=self.config.host, package_version=__version__, extra=extra,
        ))
        log.info("manager %s: %d prompts x %d samples, mode %s, workers at %s, acks at %s",
                 self.config.manager_id, len(self.records), self.config.group_size,
                 self.config.mode, address, ack_address)
        self.spawn(self._loop, "loop")

    def _close(self) -> None:
        self._write_state(force=True)
        if self.metrics is not None:
            self.metrics.stop()
        if self.status is not None:
            self.status.close(timeout_s=2)
        if self.coordinator is not None:
            self.coordinator.close()
        for sock in (self.server, self.acks):
            if sock is not None:
                sock.close()

    def _on_member(self, event: MembershipEvent) -> None:
        self._events.put(("member", event))

    # -- the loop ---------------------------------------------------------------

    def _loop(self) -> None:
        assert self.server is not None and self.acks is not None
        while not self.stopping.is_set():
            self._drain_events()
            item = self.server.recv(timeout_s=0.01)
            while item is not None:
                self._handle(*item)
                item = self.server.recv(timeout_s=0)
            ack = self.acks.recv(timeout_s=0)
            while ack is not None:
                if isinstance(ack, TrajectoryRejected):
                    self.feedback.rejected(ack)
                elif isinstance(ack, GroupsFiltered):
                    self.feedback.filtered(ack)
                else:
                    self.feedback.acked(ack)
                ack = self.acks.recv(timeout_s=0)
            self.roster.expire_silent()
            self._schedule()
            if self.roster.recoveries:
                self.roster.settle_recoveries()
            self.dispatch.maybe_repack(self.latest)
            self._write_state()
            self._log_progress()

    def _drain_events(self) -> None:
        for kind, payload in drain(self._events):
            if kind == "latest":
                assert isinstance(payload, VersionRecord)
                self.resume_hold.published(payload)
                if payload.version > self.latest:
                    self.latest = payload.version
                    self._trainer_step = max(self._trainer_step, _trainer_step(payload))
                    self.dispatch.maybe_repack(self.latest, force=True)
            elif kind == "member":
                assert isinstance(payload, MembershipEvent)
                if payload.kind == "delete" and payload.member_id in self.workers:
                    silent = time.monotonic() - self.workers[payload.member_id].last_seen
                    if silent > self.config.lease_grace_s:
                        self.roster.lost(payload.member_id,
                                          f"lease expired, silent for {silent:.1f}s")
                    else:
                        # It talks to us but not to etcd: etcd paused or partitioned from
                        # it. Its keepalive registers it again; work goes on meanwhile.
                        self.stats.lease_expired_kept += 1
                        log.warning("worker %s: lease expired but it was heard from %.1fs ago; "
                                    "keeping it (etcd paused?)", payload.member_id, silent)

    def _handle(self, peer: str, msg: codec.Message) -> None:
        if isinstance(msg, codec.Hello):
            if peer in self.workers:
                # A restarted worker with the same id: whatever it held is gone. (The
                # socket keeps the hello it just accepted: forgetting it would refuse
                # the new incarnation's reports.)
                self.roster.lost(peer, "reconnected", forget=False)
            # One this manager let go as cut off from the trainer gets no work until it
            # reports its link back (its hello carries no link state).
            self.workers[peer] = WorkerState(peer, capacity=msg.capacity,
                                             trainer_down_s=self.roster.still_cut.get(peer, 0.0))
            log.info("worker %s joined (capacity %d)", peer, msg.capacity)
            return
        w = self.workers.get(peer)
        if w is None:
            self.server.forget(peer)
            return
        w.last_seen = time.monotonic()
        if isinstance(msg, WorkerReport):
            self.roster.report(w, msg)
        elif isinstance(msg, PartialProgress):
            self.roster.progress(peer, msg)
        elif isinstance(msg, PromptTask):
            if self.ledger.requeue_exported(msg, peer):
                migration = self.dispatch.migrations.get(msg.trajectory_id)
                if migration is not None:
                    # To the planned destination; if it cannot take it now (pulling,
                    # gone, full), it waits as resumable for any worker at its version.
                    self.dispatch.place(msg.trajectory_id, migration[0])
            else:
                self.dispatch.migrations.pop(msg.trajectory_id, None)
        elif isinstance(msg, codec.GenerationRejected):
            for tid in msg.trajectory_ids:
                if self.ledger.mark_rejected(tid, peer, msg.reason):
                    log.warning("trajectory %s rejected by %s: %s", tid, peer, msg.reason)
        else:
            log.warning("ignoring %s from worker %s", type(msg).__name__, peer)

    def _waiting(self) -> int:
        """Finished trajectories the trainer has not consumed: every one that finished
        (acked or not: acks wait for the trainer's checkpoint) less the trainer's steps
        times the batch and the groups it dropped, as of its latest published version."""
        led, cfg = self.ledger, self.config
        finished = led.counters.by_state[DONE] + led.counters.by_state[ACKED] + \
            led.compacted_states[ACKED]
        consumed = (self._trainer_step * cfg.batch_groups + led.filtered_groups) * \
            cfg.group_size
        return max(0, finished - consumed)

    def _refill(self, n: int) -> int:
        """Add up to ``n`` groups to the open batch for groups the trainer filtered (the
        batch modes; laminar mode refills by itself); returns how many were added."""
        added = 0
        if self.config.mode != "laminar" and self.batch >= 0:
            while added < n and not self.cursor.exhausted():
                self.ledger.add_group(self.cursor.next(), self.config.group_size,
                                      self.sampling, batch=self.batch)
                added += 1
        return added

    def _send(self, worker: str, msg: codec.Message) -> bool:
        try:
            self.server.send(worker, msg)
            return True
        except TransportError as exc:
            log.warning("cannot reach worker %s: %s", worker, exc)
            return False

    # -- scheduling -------------------------------------------------------------

    def _schedule(self) -> None:
        views = self.dispatch.views()
        if not views:
            return
        if self.config.mode == "laminar" and self.resume_hold.check(self.latest):
            return
        if self.ledger.pending_resumable():
            self.dispatch.place_resumables(views)
            views = self.dispatch.views()
        if self.config.mode == "laminar":
            cfg = self.config
            # Each group the trainer filtered (dynamic sampling) is one more to create.
            plan = plan_dispatch(
                views, self.latest, pending=self.ledger.pending_count(),
                created=self.ledger.created,
                admission=Admission(cfg.batch_groups, cfg.group_size, cfg.max_staleness,
                                    cfg.max_waiting),
                filtered_groups=self.ledger.filtered_groups,
                waiting=self._waiting(),
                can_create=not self.cursor.exhausted())
            for _ in range(plan.new_groups):
                if self.cursor.exhausted():
                    break
                self.ledger.add_group(self.cursor.next(), cfg.group_size, self.sampling)
        else:
            self._advance_batch()
            if self.batch < 0:
                return
            batch = self.config.batch_groups * self.config.group_size
            plan = plan_barrier(views, required_version(self.config.mode, self.batch), self.latest,
                                share=-(-batch // len(self.workers)))
        self.dispatch.apply(plan)

    def _advance_batch(self) -> None:
        """Open the next global batch once the current one has finished generating."""
        if self.batch >= 0 and not self.ledger.batch_done(self.batch):
            return
        nxt = self.batch + 1
        if self.cursor.exhausted():
            return
        if self.latest < required_version(self.config.mode, nxt):
            return
        added = 0
        while added < self.config.batch_groups and not self.cursor.exhausted():
            self.ledger.add_group(self.cursor.next(), self.config.group_size, self.sampling,
                                  batch=nxt)
            added += 1
        self.batch = nxt
        log.info("batch %d open (%d groups) at required version %d", nxt, added,
                 required_version(self.config.mode, nxt))

    # -- reporting --------------------------------------------------------------

    def _metrics(self) -> list[Metric]:
        return manager_metrics(self.stats, self.ledger, workers=len(self.workers),
                               latest=self.latest, server=self.server, acks=self.acks)

    def summary(self) -> dict[str, object]:
        """The manager's figures (its status in etcd, the saved state, MANAGER DRAINED)."""
        return manager_summary(self.stats, self.ledger, workers=len(self.workers),
                               acks=self.acks, latest=self.latest, cursor=self.cursor,
                               batch=self.batch, holding_for_resume=self.resume_hold.holding)

    def _log_progress(self) -> None:
        now = time.monotonic()
        if now - self._last_log < 1:
            return
        self._last_log = now
        s = self.summary()
        # A status snapshot for `laminar status` (every few seconds, not per trajectory).
        status = dict(s, workers={w.worker_id: {"version": w.version, "active": w.active,
                                                 "capacity": w.capacity, "kv_used": w.kv_used,
                                                 "assigned": self.ledger.assigned(w.worker_id)}
                                  for w in self.workers.values()})
        # In the background: this loop never waits on etcd.
        self.status.put(State.MANAGER, json.dumps(status).encode())
        if now - self._last_ledger_log >= 10:
            self._last_ledger_log = now
            log.info("ledger %s, %d workers, latest v%d", s["ledger"], s["workers"], self.latest)
        if self.cursor.exhausted() and self.ledger.settled() and not self._drained_announced:
            self._drained_announced = True
            print("MANAGER DRAINED " + json.dumps(s, sort_keys=True), flush=True)

    def _write_state(self, force: bool = False) -> None:
        self.state_file.write(self.summary(), self.ledger, self.latest, self.resume_hold.hold,
                              force=force)


def _trainer_step(record: VersionRecord) -> int:
    """The trainer step a published version came from (its version when not given)."""
    return record.trainer_step if record.trainer_step >= 0 else record.version
