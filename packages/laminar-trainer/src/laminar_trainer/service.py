"""The trainer (``laminar-trainer run``): streaming GRPO on finished trajectories.

A composition root: the trajectory door (:class:`~laminar_common.consume.
TrajectoryConsumer`, the same one a custom trainer uses: it registers the
``trainer`` member, checks every trajectory, drops copies by id, and sends acks,
rejections and filtered groups to the manager), the experience buffer, a policy
backend (:mod:`.backend`: the model and optimizer, or a simulated step), the
step loop (:mod:`.loop`, which keeps its step and version in a
:class:`~.loop.Progress` the other parts read), the weight publisher and checkpoints.

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
from pathlib import Path

import torch
import yaml

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
from .buffer import ExperienceBuffer
from .config import TrainerConfig
from .distributed import Command, DistContext
from .durable import AckAfterCheckpoint
from .feed import GroupFeed
from .heldout import HeldOut
from .intake import Intake
from .loop import Progress, StepLoop
from .publisher import WeightPublisher, relay_publisher
from .reporting import StepReporter
from .resume import begin
from .runfiles import RunFiles, make_step_records
from .samples import SampleLogger
from .telemetry import prometheus_metrics, rejected_by_reason, run_summary
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
        self.progress = Progress()
        """The step loop's step, version and tallies (:mod:`.loop`): everything that must
        know where the loop is reads them there."""
        self.buffer = ExperienceBuffer(
            capacity=config.buffer.capacity, policy=config.buffer.policy,
            max_staleness=config.buffer.max_staleness, stale_action=config.buffer.stale_action,
            downweight=config.buffer.downweight, dynamic_sampling=config.buffer.dynamic_sampling)
        self.feed = GroupFeed(config, self.buffer, lambda: self.consumer, lambda: self.status,
                              lambda: self.coordinator, self.stopping, self.progress.position,
                              lambda: len(self.durable.unacked))
        """Complete groups for the step loop (:mod:`.feed`)."""
        self.consumer: TrajectoryConsumer | None = None
        """The trajectory door (built in ``_start``, after the initial publish)."""
        self.publisher: WeightPublisher | None = None
        self.metrics: MetricsServer | None = None
        self.trackers = MultiTracker()
        self._curve = config.auth.curve()
        self.status: StatusWriter | None = None
        self.intake: Intake | None = None
        """The receive loop, door to buffer (:mod:`.intake`): after a resume (first
        version V published) it refuses trajectories generated by weights older than
        V - buffer.max_staleness, whatever the buffer's policy."""
        self.durable = AckAfterCheckpoint(config, self.policy, lambda: self.consumer)
        """Checkpoints, and the acks after them (:mod:`.durable`)."""
        self.heldout = HeldOut(config, self.policy)
        """Held-out evaluations before, during and after training (:mod:`.heldout`)."""
        self.loop: StepLoop | None = None
        """The step loop (built in ``_start``, with the door)."""
        self.finished = threading.Event()

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def version(self) -> int:
        return self.progress.version

    @property
    def model(self):
        """The policy's model (None for a simulated step)."""
        return self.policy.model

    @property
    def records(self) -> StepRecordWriter | None:
        """Where step records go (None when off, or after a write failed)."""
        return self.loop.records if self.loop is not None else None

    @property
    def rejected(self) -> dict[str, int]:
        """Trajectories refused by content, by reason (every reason, zeros included)."""
        return rejected_by_reason(self.consumer)

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
        p = self.progress
        p.step, p.version = start.step, start.version
        self.durable.last_step = p.first_step = start.step
        self.buffer.consumed = start.consumed
        tok = self.policy.tokenizer
        records = make_step_records(
            cfg, p.step, self.dist.world_size if self.dist is not None else 1,
            None if tok is None else lambda ids: tok.decode(list(ids)))
        samples = SampleLogger(self.run_dir, cfg.samples, tok, self.trackers)
        published = self._latest_version()
        if p.step > 0 or published >= 0:
            # A resumed (or restarted) trainer publishes its weights as a new version:
            # versions only move forward, and workers must leave rolled-back weights.
            p.version = max(p.version, published) + 1
        resume_floor = max(0, p.version - cfg.buffer.max_staleness) if p.step > 0 else 0
        self._publish()
        self.publisher.wait_idle(timeout_s=300)
        if self.stopping.is_set():
            return  # a signal while waiting for a relay master: run_forever closes at once
        where = cfg.addresses()
        extra = {Extra.STEP: str(p.step), Extra.VERSION: str(p.version)}
        if cfg.metrics.port is not None:
            self.metrics = MetricsServer(Role.TRAINER, cfg.job, cfg.trainer_id, self._metrics)
            extra[Extra.METRICS] = self.metrics.start(cfg.metrics.host, cfg.metrics.port,
                                                      where.advertise)
        self.consumer = self._open_door(cfg.listen or where.tcp(cfg.port), where.advertise,
                                        extra, start.door_state)
        self.intake = Intake(self.consumer, self.buffer, resume_floor, cfg.buffer.max_staleness)
        self.loop = self._make_loop(records, samples)
        log.info("trainer %s ready at %s: step %d, v%d", cfg.trainer_id, self.consumer.endpoint,
                 p.step, p.version)
        self.spawn(lambda: self.intake.run(self.stopping), "receive")
        self.spawn(self._train_loop, "train")

    def _open_door(self, listen: str, advertise: str, extra: dict[str, str],
                   restored: dict | None) -> TrajectoryConsumer:
        """The trajectory consumer: registers this trainer (workers push to it from now
        on), checks each trajectory against the model and this trainer's version, and
        holds final rejections for the checkpoint that records them. ``restored``: the
        door's state in the checkpoint resumed from."""
        cfg, p = self.config, self.progress
        door = TrajectoryConsumer(
            self.coordinator, member_id=cfg.trainer_id, listen=listen, advertise_host=advertise,
            host_id=cfg.host, auth=self._curve, vocab_size=self.policy.vocab_size,
            max_rejections=cfg.max_rejections, state=restored, extra=extra,
            temperature=cfg.temperature, version_bound=lambda: p.version,
            hold_final_rejections=bool(cfg.checkpoint.dir), on_failed=self.buffer.fail)
        door.step, door.version = p.step, p.version
        return door

    def _make_loop(self, records: StepRecordWriter | None, samples: SampleLogger) -> StepLoop:
        cfg = self.config
        return StepLoop(
            cfg, self.progress, policy=self.policy, feed=self.feed, buffer=self.buffer,
            door=self.consumer, durable=self.durable, heldout=self.heldout,
            reporter=self.reporter, records=records, logs=self.logs, samples=samples,
            publisher=self.publisher, publish=self._publish,
            latest_version=self._latest_version, stopping=self.stopping)

    def _metrics(self) -> list[Metric]:
        p = self.progress
        return prometheus_metrics(
            step=p.step, version=p.version, tokens_consumed=p.tokens_consumed,
            last=self.reporter.last, buffer=self.buffer, door=self.consumer,
            nonfinite_steps=p.nonfinite_steps, publisher=self.publisher.stats)

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

    # -- the loop ---------------------------------------------------------------

    def _publish(self) -> float:
        """The policy's weights, as the progress's version, to the publisher; returns how
        long the caller stalled for the snapshot."""
        p = self.progress
        return self.publisher.submit(self.policy.snapshot(p.version, p.step))

    def _latest_version(self) -> int:
        """The newest version in etcd (-1: none yet)."""
        latest = self.coordinator.latest_version()
        return -1 if latest is None else latest.version

    def _train_loop(self) -> None:
        if self.loop.run():
            self._finish()
        elif self.stopping.is_set() and self.failure is None:
            self.durable.final(self.step, self.version)
        # Only on a clean exit: after a failure mid-collective the followers cannot
        # read a command any more, and torchrun stops them when this rank exits.
        if self.dist is not None:
            self.dist.send_command(Command.STOP)

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
        p = self.progress
        return run_summary(
            step=p.step, version=p.version, heldout=self.heldout,
            tokens_consumed=p.tokens_consumed, elapsed=p.elapsed(), wait_s=p.wait_s,
            buffer=self.buffer, publisher=self.publisher.stats, door=self.consumer,
            uniform_steps=self.reporter.uniform_steps_total,
            refused_stale_resume=self.intake.refused_stale_resume if self.intake else 0,
            ended_early=self.feed.ended_early,
            nonfinite_steps=p.nonfinite_steps, simulated=self.policy.simulated,
            run_dir=self.run_dir, tracker_errors=self.trackers.errors)


def make_trainer_service(config: TrainerConfig, *, resume: bool = False,
                         dist: DistContext | None = None) -> TrainerService:
    """The trainer of ``config`` (``laminar-trainer run``): publishing through the job's
    relay tier, its coordinator made from ``config.etcd`` at start."""
    return TrainerService(config, resume=resume, dist=dist)
