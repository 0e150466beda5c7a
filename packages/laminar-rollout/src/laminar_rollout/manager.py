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
import os
import queue
import time
from dataclasses import dataclass, field

from laminar_common import codec
from laminar_common.codec import (
    GroupsFiltered,
    PartialProgress,
    PromptTask,
    SamplingSpec,
    TrajectoryRejected,
    WorkerReport,
)
from laminar_common.errors import LaminarError
from laminar_common.etcd import make_coordinator
from laminar_common.membership import MemberRecord, MembershipEvent, VersionRecord
from laminar_common.metrics import Metric, MetricsServer
from laminar_common.roles import Extra, Role, State
from laminar_common.service import Service
from laminar_common.status import StatusWriter
from laminar_common.transport import (
    PullReceiver,
    Server,
    TransportError,
    make_pull_receiver,
    make_server,
)

from .config import ManagerConfig
from .ledger import ACKED, DONE, PENDING, TrajectoryLedger
from .prompts import PromptCursor, check_resume, load_prompt_file
from .repack import KvLifecycle, WorkerLoad, plan_repack
from .scheduling import Admission, WorkerView, plan_barrier, plan_dispatch, required_version
from .version import __version__

__all__ = ["ManagerService"]

log = logging.getLogger(__name__)

RESUME_HOLD_S = 120.0
"""How long a resumed manager holds new work for the resumed weights (see ``_resume_hold``)
before it sends work out at what it has (a trainer that kept running but waits for data
publishes nothing new)."""


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


@dataclass
class ManagerStats:
    dispatched: int = 0
    acks: int = 0
    workers_lost: int = 0
    repacks: int = 0
    repack_migrated: int = 0
    repack_seconds: float = 0.0
    """Time spent planning repacks and sending the export commands."""
    migrations_placed: int = 0
    migration_seconds: float = 0.0
    """Summed over migrated trajectories: export command sent -> dispatched again (to
    the planned destination, or to another worker at its version when that one could
    not take it; ``migrations_placed`` of them)."""
    pulls_commanded: int = 0
    lease_expired_kept: int = 0
    """Workers whose lease expired while they kept talking (etcd paused): kept."""
    trainer_rejections: int = 0
    """Trajectories the trainer refused by content (each generated again or failed)."""
    filtered_notices: int = 0
    """Filtered-group notices received (re-sent ones included)."""
    recovery_seconds: list[float] = field(default_factory=list)
    """Per lost worker: last heard from -> every trajectory it held dispatched again."""


@dataclass
class Recovery:
    """A lost worker's trajectories on their way back to live workers."""

    worker_id: str
    last_seen: float
    ids: set[str]


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
        self.workers: dict[str, WorkerState] = {}
        self.latest = 0
        self._trainer_step = 0
        """The trainer's step at its latest published version (what ``max_waiting`` counts
        as consumed)."""
        self.batch = -1
        self._resume_hold: tuple[int, float] | None = None
        """After ``--resume``: (the newest version this manager had seen, when it saved).
        No new work goes out until a version at least that new, or one published after
        that save (the resumed trainer's), is known: until then the workers hold their
        initial weights, and what they generated would be older than any staleness bound."""
        self._resume_hold_deadline = 0.0
        if resume:
            self._restore()
        self.stats = ManagerStats()
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        self._migrations: dict[str, tuple[str, float]] = {}
        self._recoveries: list[Recovery] = []
        self._last_repack = time.monotonic()
        self._last_expiry_check = time.monotonic()
        self._last_state_write = 0.0
        self._last_log = 0.0
        self._last_ledger_log = 0.0
        self._drained_announced = False
        self.server: Server | None = None
        self.acks: PullReceiver | None = None
        self.metrics: MetricsServer | None = None
        self.status: StatusWriter | None = None

    def _state_path(self) -> str | None:
        if self.config.state_dir is None:
            return None
        return os.path.join(self.config.state_dir, "manager_state.json")

    def _restore(self) -> None:
        """``--resume``: cursor, open batch and ledger from ``state_dir`` (see the ledger).

        The saved cursor resumes in the order it was taken in: a config whose
        ``data.shuffle`` / ``data.seed`` differ from the saved ones, or a prompt file
        of another length, is refused (:func:`~laminar_rollout.prompts.check_resume`).
        """
        path = self._state_path()
        if path is None:
            raise LaminarError("manager --resume needs state_dir (where the state was saved)")
        if not os.path.exists(path):
            log.warning("--resume: no saved state at %s; starting fresh", path)
            return
        try:
            with open(path) as fh:
                data = json.load(fh)
            cursor = data["summary"]["cursor"]
            shuffle, seed = self.config.data.shuffle, self.config.data.seed
            check_resume(cursor, len(self.records), shuffle, seed)
            self.cursor = PromptCursor(self.records, self.config.epochs, self.config.max_prompts,
                                       epoch=int(cursor["epoch"]), position=int(cursor["position"]),
                                       shuffle=shuffle, seed=seed)
            self.batch = int(data["summary"].get("batch", -1))
            seen = int(data["summary"].get("latest_version", 0))
            # Weights v0 are every worker's initial ones: nothing newer seen, nothing to wait for.
            self._resume_hold = (seen, float(data.get("saved_at", 0.0))) if seen > 0 else None
            self.ledger = TrajectoryLedger.restored(data["ledger"], self.cursor.lookup,
                                                    self.sampling, self.config.ledger_keep_groups)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LaminarError(f"manager --resume: cannot restore {path}: {exc}") from exc
        log.info("resumed from %s: cursor %s, batch %d, ledger %s", path, self.cursor.state(),
                 self.batch, self.ledger.counts())

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
        if self._resume_hold is not None:
            self._resume_hold_deadline = time.monotonic() + RESUME_HOLD_S
            self._release_resume_hold(latest)
            if self._resume_hold is not None:
                log.warning("resumed: no new work until the trainer publishes its resumed "
                            "weights (this manager had seen v%d; etcd has %s)",
                            self._resume_hold[0],
                            "none" if latest is None else f"v{latest.version}")
        extra = {Extra.ACK: ack_address, Extra.MODE: self.config.mode, Extra.READY: "1"}
        if self.config.metrics.port is not None:
            self.metrics = MetricsServer(Role.MANAGER, self.config.job, self.config.manager_id,
                                         self._metrics)
            extra[Extra.METRICS] = self.metrics.start(self.config.metrics.host,
                                                  self.config.metrics.port)
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
                    self._handle_trainer_rejection(ack)
                elif isinstance(ack, GroupsFiltered):
                    self._handle_groups_filtered(ack)
                else:
                    self._handle_ack(ack)
                ack = self.acks.recv(timeout_s=0)
            self._expire_silent_workers()
            self._schedule()
            if self._recoveries:
                self._settle_recoveries()
            self._maybe_repack()
            self._write_state()
            self._log_progress()

    def _drain_events(self) -> None:
        while True:
            try:
                kind, payload = self._events.get_nowait()
            except queue.Empty:
                return
            if kind == "latest":
                assert isinstance(payload, VersionRecord)
                self._release_resume_hold(payload)
                if payload.version > self.latest:
                    self.latest = payload.version
                    self._trainer_step = max(self._trainer_step, _trainer_step(payload))
                    self._maybe_repack(force=True)
            elif kind == "member":
                assert isinstance(payload, MembershipEvent)
                if payload.kind == "delete" and payload.member_id in self.workers:
                    silent = time.monotonic() - self.workers[payload.member_id].last_seen
                    if silent > self.config.lease_grace_s:
                        self._worker_lost(payload.member_id,
                                          f"lease expired, silent for {silent:.1f}s")
                    else:
                        # It talks to us but not to etcd: etcd paused or partitioned from
                        # it. Its keepalive registers it again; work goes on meanwhile.
                        self.stats.lease_expired_kept += 1
                        log.warning("worker %s: lease expired but it was heard from %.1fs ago; "
                                    "keeping it (etcd paused?)", payload.member_id, silent)

    def _release_resume_hold(self, record: VersionRecord | None) -> None:
        """End the hold after ``--resume`` (see ``_resume_hold``) once ``record`` is the
        resumed run's weights: as new as what was seen before, or published since."""
        if self._resume_hold is None or record is None:
            return
        seen, saved_at = self._resume_hold
        if record.version >= seen or record.published_at > saved_at:
            self._resume_hold = None
            log.info("resumed: new work goes out at v%d", record.version)

    def _holding_for_resume(self) -> bool:
        if self._resume_hold is None:
            return False
        if time.monotonic() < self._resume_hold_deadline:
            return True
        log.warning("resumed: no version newer than v%d for %.0fs; sending work out at v%d "
                    "(the trainer refuses what is staler than its bound after a resume)",
                    self._resume_hold[0], RESUME_HOLD_S, self.latest)
        self._resume_hold = None
        return False

    def _handle(self, peer: str, msg: codec.Message) -> None:
        if isinstance(msg, codec.Hello):
            if peer in self.workers:
                # A restarted worker with the same id: whatever it held is gone. (The
                # socket keeps the hello it just accepted: forgetting it would refuse
                # the new incarnation's reports.)
                self._worker_lost(peer, "reconnected", forget=False)
            self.workers[peer] = WorkerState(peer, capacity=msg.capacity)
            log.info("worker %s joined (capacity %d)", peer, msg.capacity)
            return
        w = self.workers.get(peer)
        if w is None:
            self.server.forget(peer)
            return
        w.last_seen = time.monotonic()
        if isinstance(msg, WorkerReport):
            self._handle_report(w, msg)
        elif isinstance(msg, PartialProgress):
            self._record_progress(peer, msg)
        elif isinstance(msg, PromptTask):
            if self.ledger.requeue_exported(msg, peer):
                migration = self._migrations.get(msg.trajectory_id)
                if migration is not None:
                    # To the planned destination; if it cannot take it now (pulling,
                    # gone, full), it waits as resumable for any worker at its version.
                    self._place(msg.trajectory_id, migration[0])
            else:
                self._migrations.pop(msg.trajectory_id, None)
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

    def _record_progress(self, peer: str, p: PartialProgress) -> None:
        self.ledger.record_partial(p.trajectory_id, peer, p.policy_version, p.token_ids,
                                   p.logprobs, p.offset)

    def _handle_report(self, w: WorkerState, msg: WorkerReport) -> None:
        for p in msg.progress:
            self._record_progress(w.worker_id, p)
        w.version = msg.policy_version
        w.capacity = msg.max_batch
        w.active, w.queued = msg.active, msg.queued
        w.kv_used, w.kv_capacity = msg.kv_used_tokens, msg.kv_capacity_tokens
        w.kv.observe(msg.kv_used_tokens if msg.kv_capacity_tokens > 0 else msg.active)
        if w.pulling is not None and msg.policy_version >= w.pulling:
            w.pulling = None
        for tid in msg.done:
            self.ledger.mark_done(tid, w.worker_id)

    def _handle_ack(self, ack: codec.Ack) -> None:
        by_worker: dict[str, list[str]] = {}
        unattributed: list[str] = []
        for tid in ack.trajectory_ids:
            worker = self.ledger.mark_acked(tid)
            self.stats.acks += 1
            if worker is not None and worker in self.workers:
                by_worker.setdefault(worker, []).append(tid)
            else:
                unattributed.append(tid)
        for worker, ids in by_worker.items():
            self._send(worker, codec.Acked(trajectory_ids=tuple(ids)))
        if unattributed:
            # Acked again, or held by a worker this manager does not know (after a
            # restart): whichever worker keeps a copy in its outbox may drop it.
            for worker in self.workers:
                self._send(worker, codec.Acked(trajectory_ids=tuple(unattributed)))

    def _handle_trainer_rejection(self, msg: TrajectoryRejected) -> None:
        """The trainer refused a trajectory by content: generate it again, or (final)
        record it as rejected; either way its worker drops its copy."""
        if self.ledger.trainer_rejected(msg.trajectory_id, msg.worker_id, msg.reason, msg.final):
            self.stats.trainer_rejections += 1
            log.warning("trainer rejected %s from %s (%s): %s", msg.trajectory_id,
                        msg.worker_id, "failed for good" if msg.final else "generating it again",
                        msg.reason)
        if msg.worker_id in self.workers:
            self._send(msg.worker_id, codec.Acked(trajectory_ids=(msg.trajectory_id,)))

    def _handle_groups_filtered(self, msg: GroupsFiltered) -> None:
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
        added = 0
        if self.config.mode != "laminar" and self.batch >= 0:
            while added < new and not self.cursor.exhausted():
                self.ledger.add_group(self.cursor.next(), self.config.group_size,
                                      self.sampling, batch=self.batch)
                added += 1
        log.info("trainer step %d: %d groups filtered (%d in all)%s", msg.trainer_step, new,
                 self.ledger.filtered_groups,
                 f"; {added} added to batch {self.batch}" if self.config.mode != "laminar"
                 else "")

    def _send(self, worker: str, msg: codec.Message) -> bool:
        try:
            self.server.send(worker, msg)
            return True
        except TransportError as exc:
            log.warning("cannot reach worker %s: %s", worker, exc)
            return False

    def _expire_silent_workers(self) -> None:
        now = time.monotonic()
        gap, self._last_expiry_check = now - self._last_expiry_check, now
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
            if now - w.last_seen > self.config.worker_timeout_s:
                self._worker_lost(wid, f"silent for {now - w.last_seen:.1f}s")

    def _worker_lost(self, worker_id: str, why: str, forget: bool = True) -> None:
        w = self.workers.pop(worker_id, None)
        if forget:
            self.server.forget(worker_id)
        resumable, again = self.ledger.worker_lost(worker_id)
        for tid in resumable + again:  # lost with the source: not a migration any more
            self._migrations.pop(tid, None)
        self.ledger.restart_unresumable({w.version for w in self.workers.values()})
        self.stats.workers_lost += 1
        last_seen = w.last_seen if w is not None else time.monotonic()
        self._recoveries.append(Recovery(worker_id, last_seen, set(resumable + again)))
        self._settle_recoveries()
        log.warning("worker %s lost (%s): %d trajectories resumable, %d to generate again",
                    worker_id, why, len(resumable), len(again))

    def _settle_recoveries(self) -> None:
        """Close the recoveries whose trajectories all left ``pending``."""
        now = time.monotonic()
        for rec in list(self._recoveries):
            rec.ids = {t for t in rec.ids if (e := self.ledger.entries.get(t)) is not None
                       and e.state == PENDING}
            if not rec.ids:
                self._recoveries.remove(rec)
                self.stats.recovery_seconds.append(now - rec.last_seen)
                log.info("worker %s recovered: its work is running again %.2fs after it was "
                         "last heard from", rec.worker_id, now - rec.last_seen)

    # -- scheduling -------------------------------------------------------------

    def _views(self) -> list[WorkerView]:
        return [WorkerView(w.worker_id, w.version, w.capacity, self.ledger.assigned(w.worker_id),
                           w.pulling) for w in self.workers.values() if w.version >= 0]

    def _place(self, tid: str, worker_id: str) -> bool:
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
        migration = self._migrations.pop(tid, None)
        if migration is not None:
            self.stats.migrations_placed += 1
            self.stats.migration_seconds += time.monotonic() - migration[1]
        return True

    def _place_resumables(self, views: list[WorkerView]) -> None:
        """Unfinished trajectories with tokens go to a worker at their version."""
        free = {v.worker_id: v.free for v in views if v.pulling is None}
        for tid, version in self.ledger.pending_resumable():
            for v in views:
                if v.version == version and free.get(v.worker_id, 0) > 0:
                    if self._place(tid, v.worker_id):
                        free[v.worker_id] -= 1
                    break

    def _schedule(self) -> None:
        views = self._views()
        if not views:
            return
        if self.config.mode == "laminar" and self._holding_for_resume():
            return
        if self.ledger.pending_resumable():
            self._place_resumables(views)
            views = self._views()
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

    def _maybe_repack(self, force: bool = False) -> None:
        cfg = self.config.repack
        if self.config.mode != "laminar" or not cfg.enabled:
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
                       or w.version < self.latest)
            for w in self.workers.values() if w.version >= 0 and w.pulling is None
        ]
        moves = plan_repack(loads, self.latest, min_sources=cfg.min_sources)
        if not moves:
            return
        t0 = time.monotonic()
        for move in moves:
            ids = tuple(self.ledger.held_by(move.source))
            if ids and self._send(move.source, codec.ExportTrajectories(trajectory_ids=ids)):
                self.stats.repack_migrated += len(ids)
                for tid in ids:
                    self._migrations[tid] = (move.destination, t0)
        self.stats.repacks += 1
        self.stats.repack_seconds += time.monotonic() - t0
        log.info("repack: emptying %d workers (%s)", len(moves),
                 ", ".join(f"{m.source}->{m.destination}" for m in moves))

    # -- reporting --------------------------------------------------------------

    def _metrics(self) -> list[Metric]:
        st, lc = self.stats, self.ledger.counters
        return [
            Metric("trajectories", "gauge", "trajectories by ledger state", labels=("state",),
                   values={(k,): v for k, v in self.ledger.counts().items()}),
            Metric("dispatched_total", "counter", "trajectories sent to workers", st.dispatched),
            Metric("acks_total", "counter", "durable trainer acks received", st.acks),
            Metric("workers", "gauge", "connected workers", len(self.workers)),
            Metric("workers_lost_total", "counter", "workers declared dead", st.workers_lost),
            Metric("repacks_total", "counter", "repack rounds that moved work", st.repacks),
            Metric("repack_migrated_total", "counter", "trajectories migrated by repack",
                   st.repack_migrated),
            Metric("repack_seconds_total", "counter", "time spent planning + commanding repacks",
                   st.repack_seconds),
            Metric("migration_seconds_total", "counter",
                   "export command -> re-dispatch, summed over migrated trajectories",
                   st.migration_seconds),
            Metric("recoveries_total", "counter", "lost workers whose work runs again",
                   len(st.recovery_seconds)),
            Metric("recovery_seconds_last", "gauge",
                   "last heard from -> work dispatched again, last lost worker",
                   st.recovery_seconds[-1] if st.recovery_seconds else 0.0),
            Metric("resumed_total", "counter", "trajectories resumed from partial tokens",
                   lc.resumed),
            Metric("progress_gaps_total", "counter",
                   "progress continuations that did not meet the tokens held (dropped)",
                   lc.progress_gaps),
            Metric("kv_carried_total", "counter",
                   "migrated trajectories that brought their KV cache (sent on with them)",
                   lc.kv_carried),
            Metric("stale_reports_total", "counter", "worker reports that did not fit the ledger",
                   lc.stale_reports),
            Metric("latest_version", "gauge", "latest published weight version", self.latest),
            Metric("rejected_frames_total", "counter", "frames refused by the worker socket",
                   labels=("reason",),
                   values={(k,): v for k, v in self.server.stats.rejected.items()}
                   if self.server else {}),
            Metric("ack_rejected_frames_total", "counter", "frames refused by the ack socket",
                   labels=("reason",),
                   values={(k,): v for k, v in self.acks.stats.rejected.items()}
                   if self.acks else {}),
            Metric("trainer_rejections_total", "counter",
                   "trajectories the trainer refused by content", st.trainer_rejections),
            Metric("groups_filtered_total", "counter",
                   "groups the trainer dropped untrained (dynamic sampling), each credited once",
                   self.ledger.filtered_groups),
            Metric("filtered_unknown_total", "counter",
                   "filtered-group notices naming a prompt the ledger does not hold",
                   lc.filtered_unknown),
            Metric("lease_expired_kept_total", "counter",
                   "workers kept although their lease expired (they kept talking)",
                   st.lease_expired_kept),
        ]

    def summary(self) -> dict[str, object]:
        return {
            "ledger": self.ledger.counts(),
            "dispatched": self.stats.dispatched,
            "acks": self.stats.acks,
            "workers": len(self.workers),
            "workers_lost": self.stats.workers_lost,
            "repacks": self.stats.repacks,
            "repack_migrated": self.stats.repack_migrated,
            "repack_seconds": round(self.stats.repack_seconds, 4),
            "migration_seconds_mean": round(
                self.stats.migration_seconds / self.stats.migrations_placed, 4)
            if self.stats.migrations_placed else None,
            "recovery_seconds": [round(x, 3) for x in self.stats.recovery_seconds],
            "resumed": self.ledger.counters.resumed,
            "kv_carried": self.ledger.counters.kv_carried,
            "restarted": self.ledger.counters.restarted,
            "stale_reports": self.ledger.counters.stale_reports,
            "trainer_rejections": self.stats.trainer_rejections,
            "groups_filtered": self.ledger.filtered_groups,
            "filtered_unknown": self.ledger.counters.filtered_unknown,
            "lease_expired_kept": self.stats.lease_expired_kept,
            "ack_rejected_frames": dict(self.acks.stats.rejected) if self.acks else {},
            "pulls_commanded": self.stats.pulls_commanded,
            "latest_version": self.latest,
            "cursor": self.cursor.state(),
            "batch": self.batch,
            "prompts_exhausted": self.cursor.exhausted(),
            "holding_for_resume": self._resume_hold is not None,
            "settled": self.ledger.settled(),
            "settled_below": self.ledger.settled_below,
            "compacted_groups": self.ledger.compacted_groups,
        }

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
        if self.config.state_dir is None:
            return
        now = time.monotonic()
        if not force and now - self._last_state_write < 2:
            return
        self._last_state_write = now
        os.makedirs(self.config.state_dir, exist_ok=True)
        ledger = self.ledger.snapshot()
        data = {"summary": self.summary(), "ledger": ledger, "saved_at": time.time()}
        path = self._state_path()
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)


def _trainer_step(record: VersionRecord) -> int:
    """The trainer step a published version came from (its version when not given)."""
    return record.trainer_step if record.trainer_step >= 0 else record.version
