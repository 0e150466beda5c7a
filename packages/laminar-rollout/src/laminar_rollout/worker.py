"""A generation worker (``laminar-rollout serve``).

Owns one engine, its tokenizer and reward function, a DEALER connection to the
manager, a PUSH connection to the trainer and an outbox. It registers in etcd
(role ``worker``) and finds the manager, the trainer and the relays there.

A composition root: the engine and what it works on (:mod:`.generation`: admission,
engine requests, turns, exports), the outbox (:mod:`.outbox`: pushes to the trainer,
re-sends, drops on the durable ack), weight sync (:mod:`.weight_sync`, fetching through
:mod:`.relay_fetch`), the reward pool and scoring (:mod:`.rewards`, :mod:`.scoring`),
conversations (:mod:`.conversations`) and the KV plane (:mod:`.kv_migration`), driven by
one loop.

The loop (one thread owns the engine and every socket):

1. take messages from the manager: prompts (fresh or resumed), ``pull``,
   ``export`` (repack), ``acked``;
2. when a ``pull`` is pending and the engine holds nothing, fetch that version
   from the relay and load it — weights change only between trajectories;
3. start fresh prompts, step the engine, score finished trajectories and push
   them to the trainer, keeping each in the outbox until the trainer's
   durable ack arrives (so a trainer restart loses nothing: the outbox is
   re-sent to the new trainer, which deduplicates by id);
4. every ``report_interval_s``: a load report (with the ids finished since the
   last one) and the partial progress of every unfinished trajectory.

Multi-turn (``environment`` set): a turn that ends goes to
:class:`~laminar_rollout.conversations.Conversations`, which runs the
environment off this loop and hands the next turn back as a resumed request;
the trajectory is scored when its conversation is over.

Invariant: every trajectory pushed carries the one ``policy_version`` that
produced all of its tokens (the engine refuses to load weights while busy and
refuses a resumed trajectory of another version; no weights are pulled while a
conversation is between turns).
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from laminar_common import codec
from laminar_common.codec import PartialProgress, PromptTask, WorkerReport
from laminar_common.errors import LaminarError, TransportError
from laminar_common.etcd import make_coordinator
from laminar_common.membership import MemberRecord, MembershipEvent
from laminar_common.metrics import Metric, MetricsServer
from laminar_common.net import is_wildcard
from laminar_common.roles import Extra, Role
from laminar_common.service import Service, drain
from laminar_common.transport import Client

from .config import WorkerConfig
from .conversations import make_conversations
from .engines import GenerationEngine
from .generation import Generation
from .kv_migration import KvMigration
from .manager_link import connect_manager
from .outbox import Outbox
from .partials import ProgressDeltas
from .relay_fetch import FetchedVersion, WeightFetcher
from .rewards import RewardFn, RewardPool, load_reward_fn
from .scoring import Scoring, engine_label
from .telemetry import worker_metrics
from .tokenizer import Tokenizer
from .version import __version__
from .weight_sync import WeightSync

__all__ = ["WorkerService", "WeightFetcher", "FetchedVersion"]

log = logging.getLogger(__name__)



class WorkerService(Service):
    """See module docstring."""

    name = "worker"

    def __init__(self, config: WorkerConfig, engine: GenerationEngine, tokenizer: Tokenizer,
                 fetch_weights: WeightFetcher | None = None, reward_fn: RewardFn | None = None,
                 coordinator=None) -> None:
        super().__init__()
        self.config = config
        self.worker_id = config.worker_id
        self.engine = engine
        self.tokenizer = tokenizer
        self.counters: collections.Counter[str] = collections.Counter()
        self._curve = config.auth.curve()
        self.kv = KvMigration(config, engine, self.counters, auth=self._curve)
        """KV caches in and out with migrated trajectories (:mod:`.kv_migration`)."""
        self.weights = WeightSync(engine, fetch_weights, config.weight_load_timeout_s,
                                  self.counters, what=f"worker {config.worker_id}")
        """The version to pull, fetched and loaded between trajectories (:mod:`.weight_sync`)."""
        self.reward_fn = reward_fn or load_reward_fn(config.reward)
        self.rewards = RewardPool(self.reward_fn, workers=config.reward_workers,
                                  timeout_s=config.reward_timeout_s)
        self.scoring = Scoring(config.worker_id, self.rewards, engine_label(engine))
        """Finished generations until scored, then trajectories (:mod:`.scoring`)."""
        self.conversations = make_conversations(
            config.environment, tokenizer, reuse_kv=engine.supports_kv_transfer) \
            if config.environment is not None else None
        self.generation = Generation(engine, tokenizer, self.conversations, self.kv,
                                     self.scoring, self.counters, self._reject)
        """Trajectories from admission until scoring (:mod:`.generation`)."""
        self.coordinator = coordinator
        self.manager: Client | None = None
        self._manager_key: tuple[str, float] | None = None
        self._manager_rec: MemberRecord | None = None
        self._rejoin_to: MemberRecord | None = None
        self.metrics: MetricsServer | None = None
        self._events: queue.Queue[tuple[str, object]] = queue.Queue()
        self._done_since_report: list[str] = []
        self._last_report = 0.0
        self.partials = ProgressDeltas(config.worker_id, self.counters)
        """Unfinished trajectories' tokens the manager does not have yet (:mod:`.partials`)."""
        self.outbox = Outbox(config.resend_after_s, self.counters, auth=self._curve)
        """Finished trajectories until the trainer's durable ack (:mod:`.outbox`)."""
        self.busy_s = 0.0
        self._t_start = time.time()
        self.timeline: list[tuple[float, str]] = []

    @property
    def fetch_weights(self) -> WeightFetcher | None:
        """Where pulled versions come from (``fetch(version) -> FetchedVersion``)."""
        return self.weights.fetch

    @fetch_weights.setter
    def fetch_weights(self, fetch: WeightFetcher | None) -> None:
        self.weights.fetch = fetch

    @property
    def weight_wait_s(self) -> float:
        return self.weights.wait_s

    # -- lifecycle --------------------------------------------------------------

    def _start(self) -> None:
        if self.coordinator is None:
            self.coordinator = make_coordinator(self.config.etcd, self.config.job)
        self.coordinator.watch_members(self._on_trainer, role=Role.TRAINER)
        self.coordinator.watch_members(lambda ev: self._events.put(("manager", ev)),
                                       role=Role.MANAGER)
        extra = {Extra.ENGINE: type(self.engine).__name__}
        self._last_load = self.engine.load()
        if self.config.metrics.port is not None:
            self.metrics = MetricsServer(Role.WORKER, self.config.job, self.worker_id, self._metrics)
            host = self.config.metrics.host
            extra[Extra.METRICS] = self.metrics.start(
                host, self.config.metrics.port,
                self.config.addresses().advertise if is_wildcard(host) else None)
        record = MemberRecord(
            member_id=self.worker_id, role=Role.WORKER, host_id=self.config.host,
            package_version=__version__,
            capacity=self.engine.load().max_batch, extra=extra,
        )
        self.coordinator.register(record)
        self.kv.start_plane()
        self._connect_manager()
        # Ready once the manager welcomed us: the launcher and tests wait on this record.
        self.coordinator.update_record(msgspec.structs.replace(record, extra={
            **extra, Extra.READY: "1", Extra.VERSION: str(self.engine.weight_version)}))
        self.spawn(self._loop, "loop")

    def _connect_manager(self, timeout_s: float = 60.0,
                         known: MemberRecord | None = None) -> None:
        """Say hello to the manager: ``known`` (no etcd call), else the one registered."""
        linked = connect_manager(self.coordinator, self.worker_id, self.engine.load().max_batch,
                                 self.stopping, auth=self._curve, timeout_s=timeout_s,
                                 known=known)
        if linked is not None:
            self.manager, self._manager_rec = linked
            self._manager_key = self._manager_rec.incarnation

    def _on_trainer(self, event: MembershipEvent) -> None:
        self._events.put(("trainer", event))

    def _metrics(self) -> list[Metric]:
        return worker_metrics(self.counters, self._last_load, engine=self.engine,
                              rewards=self.rewards, scoring=len(self.scoring.waiting),
                              kv_plane=self.kv.plane, outbox=self.outbox,
                              weight_wait_s=self.weights.wait_s, busy_s=self.busy_s)

    def stats(self) -> dict:
        uptime = time.time() - self._t_start
        return {"worker_id": self.worker_id, "uptime_s": uptime, "busy_s": self.busy_s,
                "busy_fraction": self.busy_s / uptime if uptime else 0.0,
                "weight_wait_s": self.weights.wait_s, "counters": dict(self.counters),
                "kv_plane": dict(self.kv.plane.counters) if self.kv.plane else None,
                "environment": None if self.conversations is None else {
                    **self.conversations.counters,
                    "errors_by_reason": dict(self.conversations.env_error_reasons)},
                "weight_version": self.engine.weight_version, "outbox": len(self.outbox),
                "started_at": self._t_start, "timeline": self.timeline}

    def _close(self) -> None:
        if self.config.stats_path:
            import json

            with open(self.config.stats_path, "w") as fh:
                json.dump(self.stats(), fh)
        if self.metrics is not None:
            self.metrics.stop()
        self.rewards.close()
        if self.conversations is not None:
            self.conversations.close()
        self.kv.close()
        if self.coordinator is not None:
            self.coordinator.close()
        self.outbox.close()
        if self.manager is not None:
            self.manager.close()

    # -- the loop ---------------------------------------------------------------

    def _loop(self) -> None:
        self._report(force=True)
        while not self.stopping.is_set():
            self._drain_events()
            if self.manager is None:  # between managers, or rejoining one (see _rejoin)
                self.stopping.wait(0.5)
                self._reconnect_manager(self._rejoin_to)
                continue
            msg = self.manager.recv(timeout_s=self.generation.idle_wait_s())
            while msg is not None:
                self._handle(msg)
                msg = self.manager.recv(timeout_s=0) if self.manager is not None else None
            for task in self.kv.collect():
                self.generation.add(task)
            # Weights change only between trajectories.
            if self.weights.due() and self.generation.may_swap_weights():
                self._mark("weights")
                if self.weights.load_pending():
                    self._report(force=True)
            if self.weights.pending is None:
                self.generation.start_fresh()
            if self.engine.has_unfinished():
                self._mark("busy")
                t0 = time.monotonic()
                self.generation.step()
                self.busy_s += time.monotonic() - t0
            else:
                self._mark("idle")
            self.generation.next_turns()
            self._collect_scored()
            self._report(force=self._refill_due())
            self.outbox.tick()

    def _refill_due(self) -> bool:
        """Whether enough slots freed up since the last report to report now (see
        ``refill_fraction``)."""
        done = len(self._done_since_report)
        if not done or self.config.refill_fraction <= 0 or \
                time.monotonic() - self._last_report < _MIN_EARLY_REPORT_S:
            return False
        if not self.engine.has_unfinished() and not self.generation.fresh:
            return True
        return done >= max(1.0, self.config.refill_fraction * self._last_load.max_batch)

    def _mark(self, state: str) -> None:
        """Record a busy/idle/weights transition (for timelines; transitions only)."""
        if not self.timeline or self.timeline[-1][1] != state:
            self.timeline.append((round(time.time() - self._t_start, 4), state))

    def _drain_events(self) -> None:
        for kind, payload in drain(self._events):
            if kind == "trainer":
                assert isinstance(payload, MembershipEvent)
                if payload.kind == "put" and payload.record is not None:
                    self.outbox.set_trainer(payload.record)
            elif kind == "manager":
                assert isinstance(payload, MembershipEvent)
                rec = payload.record
                if payload.kind == "put" and rec is not None and \
                        rec.incarnation != self._manager_key:
                    self._rejoin("a new manager registered")

    def _rejoin(self, why: str, known: MemberRecord | None = None) -> None:
        """Drop what the manager assigned and say hello again.

        Two causes: a (re)started manager (its restored ledger has everything
        unacked pending), or a manager that forgot this worker (its lease expired
        while it was paused; it answered a report with ``Refused``) and sent this
        worker's trajectories to others meanwhile. Either way the manager
        dispatches the unfinished ones again, so keeping them here would generate
        them twice; finished ones stay in the outbox until the trainer's ack
        (the trainer refuses a second copy by id).
        """
        dropped_ids = self.generation.drop_all()
        self._done_since_report.clear()
        self._rejoin_to = known
        self.counters["manager_switches" if known is None else "rejoins"] += 1
        log.warning("%s: dropping %d unfinished trajectories %s and saying hello again",
                    why, len(dropped_ids), dropped_ids[:5])
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        self._reconnect_manager(known)

    def _reconnect_manager(self, known: MemberRecord | None = None) -> None:
        """Say hello to the manager; on failure the loop tries again later."""
        try:
            self._connect_manager(timeout_s=2.0, known=known)
        except (LaminarError, TransportError) as exc:
            log.warning("manager not reachable yet (retrying): %s", exc)
            return
        self._report(force=True)

    def _handle(self, msg: codec.Message) -> None:
        if isinstance(msg, PromptTask):
            self.generation.admit(msg)
        elif isinstance(msg, codec.PullWeights):
            if not self.weights.want(msg.version):
                self._report(force=True)
        elif isinstance(msg, codec.ExportTrajectories):
            self._export(msg.trajectory_ids)
        elif isinstance(msg, codec.Acked):
            self.outbox.acked(msg.trajectory_ids)
        elif isinstance(msg, codec.Refused):
            self._rejoin(f"the manager does not know this worker ({msg.reason})",
                         known=self._manager_rec)
        else:
            log.warning("ignoring %s from manager", type(msg).__name__)

    def _reject(self, trajectory_id: str, reason: str) -> None:
        self.manager.send(codec.GenerationRejected(trajectory_ids=(trajectory_id,),
                                                   reason=reason))

    def _collect_scored(self) -> None:
        """Scored trajectories: reported done and into the outbox (pushed now)."""
        for traj in self.scoring.collect(self.counters):
            self._done_since_report.append(traj.trajectory_id)
            self.counters["finished"] += 1
            self.outbox.add(traj)

    def _export(self, ids: Iterable[str]) -> None:
        """Repack: what the engine holds of ``ids`` to the manager, to go on elsewhere."""
        for task in self.generation.export(ids):
            self.manager.send(task)
        self._report(force=True)

    def _report(self, force: bool = False) -> None:
        if self.manager is None:  # between managers: the next hello reports
            return
        now = time.monotonic()
        if not force and now - self._last_report < self.config.report_interval_s:
            return
        self._last_report = now
        load = self._last_load = self.engine.load()
        full = len(self.outbox) >= self.config.outbox_capacity
        # A conversation with tool results in it is generated again if this worker dies.
        pinned = self.conversations.pinned if self.conversations is not None else None
        batched, extra = self.partials.since_last(self.manager, self.engine.progress(),
                                                  skip=pinned or (lambda _: False))
        try:
            self._send_report(load, full, batched, extra)
        except TransportError:
            self.partials.lost()
            raise

    def _send_report(self, load: Any, full: bool, batched: tuple[PartialProgress, ...],
                     extra: list[PartialProgress]) -> None:
        self.manager.send(WorkerReport(
            worker_id=self.worker_id, policy_version=self.engine.weight_version,
            active=load.active, queued=load.queued + len(self.generation.fresh),
            max_batch=0 if full else load.max_batch, kv_used_tokens=load.kv_used_tokens,
            kv_capacity_tokens=load.kv_capacity_tokens,
            holding=self.generation.holding(),
            done=tuple(self._done_since_report), progress=batched,
            trainer_down_s=round(self.outbox.down_s, 2),
        ))
        self._done_since_report = []
        for p in extra:
            self.manager.send(p)

_MIN_EARLY_REPORT_S = 0.01
"""Early reports (``refill_fraction``) come at most this often."""

