"""The trainer (``laminar-trainer run``): streaming GRPO on finished trajectories.

A composition root: the trajectory door (:class:`~laminar_common.consume.
TrajectoryConsumer`, the same one a custom trainer uses: it registers the
``trainer`` member, checks every trajectory, drops copies by id, and sends acks,
rejections and filtered groups to the manager), the experience buffer, a policy
backend (:mod:`.backend`: the model and optimizer, or a simulated step), the
step loop, the weight publisher and checkpoints.

Per step: wait until ``batch_groups`` complete groups are buffered (never a
whole rollout batch; with ``buffer.dynamic_sampling`` only informative groups
count, and the manager is told of each one dropped so that it generates
another), take the step's PPO mini-batch updates (``laminar_trainer.step``:
advantages, the clipped policy loss with off-policy correction against the
behaviour log-probs the workers recorded, exact aggregation), then snapshot the
weights to host memory and hand them to the publisher thread (the only stall),
and go on. One trainer step publishes one weight version however many
optimizer updates it made.

Metrics: every step's row (loss, grad norm, entropy, clip fractions, KLs,
importance weights, response lengths, truncation, reward per data source, ...)
goes to ``metrics.jsonl``, the trackers and the Prometheus gauges; every
``samples.every_steps`` a few completions with their rewards go to
``samples.jsonl`` and the trackers (``laminar_trainer.samples``).

Durability: every ``checkpoint.every_steps`` a checkpoint is written
atomically and only then are the trajectory ids it covers acked to the
manager. Ids consumed after the last checkpoint are rolled back on a restart
(``--resume``): the consumed log is cut back to the checkpoint, so no
trajectory is trained twice in the surviving run, and none is lost (its
worker still holds it, unacked, and sends it again).

Tracking (optional, ``tracking``): every metrics.jsonl row, the held-out
accuracy before and after training, and the summary also go to TensorBoard
and/or W&B (``laminar_trainer.tracking``); a failing tracker is counted in the
summary's ``tracker_errors`` and never stops training.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import torch
import yaml

from laminar_common.codec import Trajectory
from laminar_common.config import dump_config
from laminar_common.consume.consumer import TrajectoryConsumer
from laminar_common.data.provenance import StepRecordWriter
from laminar_common.errors import LaminarError
from laminar_common.etcd import make_coordinator
from laminar_common.metrics import Metric, MetricsServer
from laminar_common.roles import Extra, Role
from laminar_common.service import Service
from laminar_common.status import StatusWriter

from .backend import make_backend
from .buffer import ExperienceBuffer, Group
from .config import TrainerConfig
from .console import (
    check_rewards,
)
from .distributed import Command, DistContext
from .durable import AckAfterCheckpoint
from .feed import GroupFeed
from .heldout import HeldOut
from .intake import Intake
from .publisher import Snapshot, WeightPublisher, relay_publisher
from .reporting import StepReporter
from .resume import begin
from .runfiles import RunFiles, make_step_records
from .samples import SampleLogger
from .step import StepResult
from .telemetry import prometheus_metrics, rejected_by_reason, run_summary, step_row
from .tracking import MultiTracker, make_trackers

__all__ = ["TrainerService"]

log = logging.getLogger(__name__)

class TrainerService(Service):
    """See module docstring."""

    name = "trainer"

    def __init__(self, config: TrainerConfig, publish_fn=None, coordinator=None,
                 resume: bool = False, dist: DistContext | None = None) -> None:
        super().__init__()
        if config.model_dir is None and config.simulate is None:
            raise LaminarError("trainer: set model_dir (or simulate, for benchmarks)")
        if config.optim.stream and dist is not None:
            raise LaminarError("trainer: optim.stream runs in one process; under torchrun "
                               f"({dist.world_size} ranks) every rank needs the whole step "
                               "at its start: set optim.stream false")
        self.config = config
        self.coordinator = coordinator
        self.resume = resume
        self.dist = dist
        self.policy = make_backend(config, dist)
        """What a step trains: a real model or a simulated step (:mod:`.backend`)."""
        self.publish_fn = publish_fn
        self.run_dir = Path(config.run_dir)
        self.logs = RunFiles(self.run_dir)
        self.reporter = StepReporter(config.total_steps, self.logs, lambda: self.trackers,
                                     lambda: self.status,
                                     lambda: self.buffer.stats.reward_errors)
        """A step's row to metrics.jsonl, trackers, status, log and console (:mod:`.reporting`)."""
        self.step = 0
        self.version = 0
        self.buffer = ExperienceBuffer(
            capacity=config.buffer.capacity, policy=config.buffer.policy,
            max_staleness=config.buffer.max_staleness, stale_action=config.buffer.stale_action,
            downweight=config.buffer.downweight, dynamic_sampling=config.buffer.dynamic_sampling)
        self.feed = GroupFeed(config, self.buffer, lambda: self.consumer, lambda: self.status,
                              lambda: self.coordinator, self.stopping,
                              lambda: (self.step, self.version),
                              lambda: len(self.durable.unacked))
        """Complete groups for the step loop (:mod:`.feed`)."""
        self.consumer: TrajectoryConsumer | None = None
        """The trajectory door (built in ``_start``, after the initial publish)."""
        self._restored: dict | None = None
        """The consumer state of the checkpoint resumed from."""
        self.publisher: WeightPublisher | None = None
        self.metrics: MetricsServer | None = None
        self.trackers = MultiTracker()
        self.samples: SampleLogger | None = None
        self._curve = config.auth.curve()
        self.status: StatusWriter | None = None
        self.intake: Intake | None = None
        """The receive loop, door to buffer (:mod:`.intake`): after a resume (first
        version V published) it refuses trajectories generated by weights older than
        V - buffer.max_staleness, whatever the buffer's policy."""
        self.nonfinite_steps = 0
        self.durable = AckAfterCheckpoint(config, self.policy, lambda: self.consumer)
        """Checkpoints, and the acks after them (:mod:`.durable`)."""
        self._tokens_consumed = 0
        self._t_first_step: float | None = None
        self._wait_s = 0.0
        self._train_s = 0.0
        self.heldout = HeldOut(config, self.policy)
        """Held-out evaluations before, during and after training (:mod:`.heldout`)."""
        self._first_step = 0
        """The step this process started at (a resumed run's checkpoint step)."""
        self._filtered_last_step = 0
        """Groups dynamic sampling dropped between the previous step's ``_account`` and
        the latest one's (the step's ``groups_filtered``)."""
        self.finished = threading.Event()
        self.records: StepRecordWriter | None = None

    @property
    def model(self):
        """The policy's model (None for a simulated step)."""
        return self.policy.model

    @property
    def eval_before(self) -> float | None:
        return self.heldout.before

    @property
    def eval_after(self) -> float | None:
        return self.heldout.after

    @property
    def ended_early(self) -> str | None:
        """Why the run ended before ``total_steps`` (``on_data_exhausted: finish``)."""
        return self.feed.ended_early

    @property
    def refused_stale_resume(self) -> int:
        return self.intake.refused_stale_resume if self.intake is not None else 0

    @property
    def rejected(self) -> dict[str, int]:
        """Trajectories refused by content, by reason (every reason, zeros included)."""
        return rejected_by_reason(self.consumer)

    @property
    def optimizer(self):
        return self.policy.optimizer

    @property
    def scheduler(self):
        return self.policy.scheduler

    # -- lifecycle --------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.threads)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # First: a tracker asked for but not installed fails the start before etcd or the model.
        # W&B records the config as the start-up log shows it (secrets masked).
        self.trackers = make_trackers(cfg.tracking, self.run_dir, cfg.trainer_id,
                                      yaml.safe_load(dump_config(cfg)))
        if self.coordinator is None:
            self.coordinator = make_coordinator(cfg.etcd, cfg.job)
        self.status = StatusWriter(self.coordinator, "trainer status")
        self.publisher = relay_publisher(cfg, self.coordinator, self.stopping, self._curve) \
            if self.publish_fn is None else WeightPublisher(self.publish_fn, stop=self.stopping)
        start = begin(cfg, self.policy, self.logs, self.resume)
        self.step, self.version = start.step, start.version
        self.durable.last_step = self._first_step = start.step
        self.buffer.consumed = start.consumed
        self._restored = start.door_state
        tok = self.policy.tokenizer
        self.records = make_step_records(
            cfg, self.step, self.dist.world_size if self.dist is not None else 1,
            None if tok is None else lambda ids: tok.decode(list(ids)))
        self.samples = SampleLogger(self.run_dir, cfg.samples, self.policy.tokenizer, self.trackers)
        latest = self.coordinator.latest_version()
        published = -1 if latest is None else latest.version
        if self.step > 0 or published >= 0:
            # A resumed (or restarted) trainer publishes its weights as a new version:
            # versions only move forward, and workers must leave rolled-back weights.
            self.version = max(self.version, published) + 1
        resume_floor = max(0, self.version - cfg.buffer.max_staleness) if self.step > 0 else 0
        self._publish(initial=True)
        if self.stopping.is_set():
            return  # a signal while waiting for a relay master: run_forever closes at once
        where = cfg.addresses()
        extra = {Extra.STEP: str(self.step), Extra.VERSION: str(self.version)}
        if cfg.metrics.port is not None:
            self.metrics = MetricsServer(Role.TRAINER, cfg.job, cfg.trainer_id, self._metrics)
            extra[Extra.METRICS] = self.metrics.start(cfg.metrics.host, cfg.metrics.port,
                                                      where.advertise)
        self.consumer = self._open_door(cfg.listen or where.tcp(cfg.port), where.advertise,
                                        extra)
        self.intake = Intake(self.consumer, self.buffer, resume_floor, cfg.buffer.max_staleness)
        log.info("trainer %s ready at %s: step %d, v%d", cfg.trainer_id, self.consumer.endpoint,
                 self.step, self.version)
        self.spawn(lambda: self.intake.run(self.stopping), "receive")
        self.spawn(self._train_loop, "train")

    def _open_door(self, listen: str, advertise: str, extra: dict[str, str]) -> TrajectoryConsumer:
        """The trajectory consumer: registers this trainer (workers push to it from now
        on), checks each trajectory against the model and this trainer's version, and
        holds final rejections for the checkpoint that records them."""
        cfg = self.config
        door = TrajectoryConsumer(
            self.coordinator, member_id=cfg.trainer_id, listen=listen, advertise_host=advertise,
            host_id=cfg.host, auth=self._curve, vocab_size=self.policy.vocab_size,
            max_rejections=cfg.max_rejections, state=self._restored, extra=extra,
            temperature=cfg.temperature, version_bound=lambda: self.version,
            hold_final_rejections=bool(cfg.checkpoint.dir), on_failed=self.buffer.fail)
        door.step, door.version = self.step, self.version
        return door

    def _metrics(self) -> list[Metric]:
        return prometheus_metrics(
            step=self.step, version=self.version, tokens_consumed=self._tokens_consumed,
            last=self.reporter.last, buffer=self.buffer, door=self.consumer,
            nonfinite_steps=self.nonfinite_steps, publisher=self.publisher.stats)

    def _close(self) -> None:
        self.trackers.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self.status is not None:
            self.status.close(timeout_s=2)
        if self.publisher is not None:
            # A publish in flight is given a moment, not its whole retry budget: with no
            # relay reachable a stop must not hang (the next trainer publishes anew).
            self.publisher.close(timeout_s=5)
        if self.consumer is not None:
            self.consumer.close(timeout_s=5)  # what is queued for the manager goes first
        if self.coordinator is not None:
            self.coordinator.close()

    # -- model ------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        return self.policy.snapshot(self.version, self.step)

    def _publish(self, initial: bool = False) -> float:
        stall = self.publisher.submit(self._snapshot())
        if initial:
            self.publisher.wait_idle(timeout_s=300)
        return stall

    # -- loops ------------------------------------------------------------------

    def _train_loop(self) -> None:
        self._train_steps()
        if self.stopping.is_set() and not self.finished.is_set() and self.failure is None:
            self.durable.final(self.step, self.version)
        # Only on a clean exit: after a failure mid-collective the followers cannot
        # read a command any more, and torchrun stops them when this rank exits.
        if self.dist is not None:
            self.dist.send_command(Command.STOP)

    def _train_steps(self) -> None:
        cfg = self.config
        if self.heldout.enabled and self.step == 0:
            self.heldout.run_before(self.step)
            self.reporter.track(self.step, self.heldout.last)
        while self.step < cfg.total_steps and not self.stopping.is_set():
            if not self._hold_for_publishing():
                break
            t0 = time.monotonic()
            if self._streaming:
                # optim.stream: the step starts on its first mini-batch; the later ones
                # are taken as their updates come due (GroupFeed.more).
                groups = self.feed.take_exactly(cfg.batch_groups // cfg.optim.mini_batches)
                if not groups:
                    break
            else:
                groups = self.feed.take(cfg.batch_groups)
                if groups is None:
                    break
                if not groups:
                    continue
            waited = time.monotonic() - t0
            self._wait_s += waited
            self._one_step(groups, waited)
        if self.step < cfg.total_steps and self.ended_early is None:
            return  # stopped early (a signal): no summary, no DONE
        if self.ended_early is not None:
            # The steps since the last checkpoint, and their acks.
            self.durable.final(self.step, self.version)
        self._finish()

    def _hold_for_publishing(self) -> bool:
        """With ``max_unpublished_steps``: wait while this trainer is that many steps
        ahead of the newest version the relays took; False if it is stopping."""
        limit = self.config.max_unpublished_steps
        if limit is None or self.publisher is None:
            return True
        return self.publisher.hold(self.step, lambda: self.version, limit,
                                   self.config.publish_every, self._resend_weights)

    def _resend_weights(self) -> None:
        """The send gave up (``publish_timeout_s``, or a version the relays refused as
        not newer: a dead master made it visible before it could answer): these weights
        again, as a version newer than the published one."""
        try:
            latest = self.coordinator.latest_version()
        except LaminarError as exc:
            log.warning("paused for publishing: etcd does not answer (%s); re-sending "
                        "weights v%d as they are", exc, self.version)
            latest = None
        if latest is not None and latest.version >= self.version:
            self.version = latest.version + 1
        self._publish()

    @property
    def _streaming(self) -> bool:
        return self.config.optim.stream and self.policy.can_stream

    def _one_step(self, groups: list[Group], waited: float) -> None:
        """One step of the loop: train, publish, account, eval, report, checkpoint/ack."""
        consume_version = self.version
        self._check_rewards(groups)
        if self._t_first_step is None:
            self._t_first_step = time.monotonic() - waited
        self.feed.start_step()
        result, train_s = self._train(groups)
        # A streamed step also took the groups of its later mini-batches while it trained,
        # and waited for them: that time is waiting (_train leaves it out of train_s).
        groups = groups + self.feed.stream_groups
        waited += self.feed.stream_wait
        self._wait_s += self.feed.stream_wait
        trajs = [t for g in groups for t in g.trajectories()]
        record_s = self._record(groups, consume_version)
        stall = self._maybe_publish()
        self._account(trajs, result)
        metrics = self._step_metrics(trajs, result, consume_version, train_s, waited, stall)
        if self._streaming:
            metrics["stream_wait_s"] = self.feed.stream_wait
        if self.records is not None:
            metrics["record_s"] = record_s
        if self.heldout.due(self.step):
            self.heldout.run(self.step)
            metrics.update(self.heldout.last)
        self.reporter.report(metrics, result, stall,
                             elapsed=time.monotonic() - self._t_first_step,
                             steps_run=self.step - self._first_step,
                             eval_last=self.heldout.last, eval_step=self.heldout.step)
        # After the step's row: W&B refuses anything logged at a step below one it saw.
        self.samples.maybe_log(self.step, self.version, groups)
        # Last: a checkpoint's step has its metrics and samples rows. A trainer killed
        # between the two would resume after a step whose rows are missing for good; now
        # it resumes from the checkpoint before, drops the later rows and logs them again.
        self.durable.step_done(self.step, self.version)

    def _record(self, groups: list[Group], version: int) -> float:
        """Write the step's record (before its checkpoint: a checkpoint's step always has
        one); returns the seconds it took."""
        if self.records is None:
            return 0.0
        t0 = time.monotonic()
        try:
            self.records.write(self.step, version, groups)
        except (OSError, ValueError, LaminarError) as exc:
            # Provenance must not end a run: say so where the user looks, and go on.
            print(f"STEP RECORDS OFF at step {self.step}: cannot write to "
                  f"{self.records.directory}: {exc}; steps from here are not recorded "
                  "(records.enabled / records.dir)", flush=True)
            log.error("step record of step %d not written: %s", self.step, exc)
            self.records = None
        return time.monotonic() - t0

    def _train(self, groups: list[Group]) -> tuple[StepResult, float]:
        """The optimizer step (across ranks, in one process, or simulated)."""
        t0 = time.monotonic()
        result = self.policy.train(groups, self.version,
                                   self.feed.more if self._streaming else None)
        self.step += 1
        train_s = time.monotonic() - t0 - self.feed.stream_wait
        self._train_s += train_s
        if result.stats.get("skipped_nonfinite"):
            self.nonfinite_steps += 1
            log.warning("step %d: non-finite loss or gradient; the update was skipped", self.step)
        return result, train_s

    def _maybe_publish(self) -> float:
        """Publish a new version when due; returns how long the step loop stalled for it."""
        cfg = self.config
        if self.step % cfg.publish_every == 0 or self.step == cfg.total_steps:
            self.version += 1
            return self._publish()
        return 0.0

    def _account(self, trajs: list[Trajectory], result: StepResult) -> None:
        """Record what this step consumed (the consumed log; acks once durable), and in
        ``_filtered_last_step`` how many groups dynamic sampling dropped since the last
        step."""
        ids = [t.trajectory_id for t in trajs]
        # The manager hears of filtered groups before their acks (one ordered socket):
        # it credits a group only while it still knows it.
        self.feed.note_filtered()
        # Too stale, or filtered: consumed untrained, acked all the same.
        dropped = self.buffer.pop_dropped()
        self._filtered_last_step = self.feed.step_done()
        self._tokens_consumed += result.tokens
        self.logs.consumed(self.step, self.version, ids, dropped)
        self.consumer.step, self.consumer.version = self.step, self.version
        self.durable.consumed(ids + dropped)

    def _step_metrics(self, trajs: list[Trajectory], result: StepResult, consume_version: int,
                      train_s: float, waited: float, stall: float) -> dict:
        elapsed = time.monotonic() - self._t_first_step
        # The step-0 eval rides on the first step's row: a run stopped before its summary
        # (interrupted, or resumed later) still plots where it started.
        before = self.heldout.before if self.step == 1 else None
        return step_row(
            step=self.step, version=self.version, consume_version=consume_version,
            trajs=trajs, result=result,
            tokens_per_s=self._tokens_consumed / max(elapsed, 1e-9), train_s=train_s,
            waited=waited, stall=stall, buffered=len(self.buffer),
            simulated=self.policy.simulated, groups_filtered=self._filtered_last_step,
            eval_before=before)

    def _check_rewards(self, groups: list[Group]) -> None:
        """See :func:`.console.check_rewards` (a run's first step only)."""
        if self.step == self._first_step:
            check_rewards(self.step + 1, [t for g in groups for t in g.trajectories()])

    def _save_final(self) -> Path | None:
        """The trained model as a Hugging Face directory (``final_dir``, default
        ``<run_dir>/final``), with or without checkpoints; None for a simulated step."""
        path = self.policy.save_final()
        if path is None:
            return None
        log.info("final model of step %d saved in %s", self.step, path)
        return path

    def _finish(self) -> None:
        self.publisher.wait_idle(timeout_s=300)
        final = self._save_final()
        if self.heldout.enabled:
            self.heldout.run_after(self.step)
            self.reporter.track(self.step, self.heldout.last)
        summary = self.summary()
        self.reporter.track(self.step, summary, prefix="summary/")
        # Closing flushes (W&B finishes its run); before summary.json, so that its
        # tracker_errors counts every failure, logging the summary included.
        self.trackers.close()
        summary["tracker_errors"] = self.trackers.errors
        summary["final_model"] = str(final) if final is not None else None
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print("TRAINER DONE " + json.dumps(summary, sort_keys=True), flush=True)
        self.finished.set()
        self.stopping.set()

    def summary(self) -> dict:
        """The run's figures (summary.json, ``TRAINER DONE``, the trackers' summary)."""
        elapsed = (time.monotonic() - self._t_first_step) if self._t_first_step else 0.0
        return run_summary(
            step=self.step, version=self.version, heldout=self.heldout,
            tokens_consumed=self._tokens_consumed, elapsed=elapsed, wait_s=self._wait_s,
            buffer=self.buffer, publisher=self.publisher.stats, door=self.consumer,
            uniform_steps=self.reporter.uniform_steps_total,
            refused_stale_resume=self.refused_stale_resume, ended_early=self.ended_early,
            nonfinite_steps=self.nonfinite_steps, simulated=self.policy.simulated,
            run_dir=self.run_dir, tracker_errors=self.trackers.errors)


def make_trainer_service(config: TrainerConfig, *, resume: bool = False,
                         dist: DistContext | None = None) -> TrainerService:
    """The trainer of ``config`` (``laminar-trainer run``): publishing through the job's
    relay tier, its coordinator made from ``config.etcd`` at start."""
    return TrainerService(config, resume=resume, dist=dist)
