"""The trainer's step loop: take groups, train, publish, account, report, checkpoint.

:class:`StepLoop` runs the steps of one trainer process. Per step it waits for
``batch_groups`` complete groups (:class:`~.feed.GroupFeed`), takes the step's
optimizer updates (the policy backend: a real model or a simulated step), hands a
new weight version to the publisher when one is due (the only stall), records what
the step consumed (the consumed log; acks once a checkpoint covers it), runs the
held-out evaluation when due, reports the step's row and samples, and checkpoints.

:class:`Progress` is where the loop keeps its step, version and tallies. The trainer
service makes it, and everything that must know where the loop is reads it there: the
feed, the trajectory door (the newest version a trajectory may claim), the metrics
and the run's summary. The loop never references the trainer service.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from laminar_common.codec import Trajectory
from laminar_common.consume.consumer import TrajectoryConsumer
from laminar_common.data.provenance import StepRecordWriter
from laminar_common.errors import LaminarError

from .backend import PolicyBackend
from .buffer import ExperienceBuffer, Group
from .config import TrainerConfig
from .console import check_rewards
from .durable import AckAfterCheckpoint
from .feed import GroupFeed
from .heldout import HeldOut
from .publisher import WeightPublisher
from .reporting import StepReporter
from .runfiles import RunFiles
from .samples import SampleLogger
from .step import StepResult
from .telemetry import step_row

__all__ = ["Progress", "StepLoop"]

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the step loop is, and what it has done since this process started."""

    step: int = 0
    """Steps taken (a resumed run starts at its checkpoint's)."""
    version: int = 0
    """The newest weight version this trainer made (published, or being published)."""
    first_step: int = 0
    """The step this process started at."""
    tokens_consumed: int = 0
    wait_s: float = 0.0
    """Seconds the loop waited for groups."""
    nonfinite_steps: int = 0
    """Steps whose update was skipped for a non-finite loss or gradient."""
    groups_filtered: int = 0
    """Groups dynamic sampling dropped between the previous step and the latest one."""
    t_first_step: float | None = None
    """``time.monotonic()`` when the first step began waiting."""

    def position(self) -> tuple[int, int]:
        return self.step, self.version

    def elapsed(self) -> float:
        """Seconds since the first step began (0 before it)."""
        return 0.0 if self.t_first_step is None else time.monotonic() - self.t_first_step


class StepLoop:
    """The steps of one trainer process (see module docstring).

    Args:
        publish: hand the backend's weights at the progress's version to the
            publisher; returns how long the caller stalled for it.
        latest_version: the newest version in etcd, -1 for none (a re-send after a
            refused publish goes out as a newer one); raises :class:`LaminarError` if etcd
            does not answer.
    """

    def __init__(self, config: TrainerConfig, progress: Progress, *, policy: PolicyBackend,
                 feed: GroupFeed, buffer: ExperienceBuffer, door: TrajectoryConsumer,
                 durable: AckAfterCheckpoint, heldout: HeldOut, reporter: StepReporter,
                 samples: SampleLogger, records: StepRecordWriter | None, logs: RunFiles,
                 publisher: WeightPublisher, publish: Callable[[], float],
                 latest_version: Callable[[], int], stopping: threading.Event) -> None:
        self.config = config
        self.progress = progress
        self.policy, self.feed, self.buffer, self.door = policy, feed, buffer, door
        self.durable, self.heldout, self.reporter = durable, heldout, reporter
        self.samples, self.records, self.logs = samples, records, logs
        self.publisher, self._publish, self._latest_version = publisher, publish, latest_version
        self.stopping = stopping
        self.streaming = config.optim.stream and policy.can_stream
        """``optim.stream``: a step starts on its first mini-batch (see :meth:`GroupFeed.more`)."""

    def run(self) -> bool:
        """Steps until ``total_steps``, a stop, or the data ran out. True when the run is
        over (every step taken, or ended early by ``on_data_exhausted``: its last steps
        checkpointed); False when stopped by a signal."""
        cfg, p = self.config, self.progress
        if self.heldout.enabled and p.step == 0:
            self.heldout.run_before(p.step)
            self.reporter.track(p.step, self.heldout.last)
        while p.step < cfg.total_steps and not self.stopping.is_set():
            if not self._hold_for_publishing():
                break
            t0 = time.monotonic()
            if self.streaming:
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
            p.wait_s += waited
            self.one_step(groups, waited)
        if p.step < cfg.total_steps and self.feed.ended_early is None:
            return False  # stopped early (a signal): no summary, no DONE
        if self.feed.ended_early is not None:
            # The steps since the last checkpoint, and their acks.
            self.durable.final(p.step, p.version)
        return True

    def _hold_for_publishing(self) -> bool:
        """With ``max_unpublished_steps``: wait while this trainer is that many steps
        ahead of the newest version the relays took; False if it is stopping."""
        limit = self.config.max_unpublished_steps
        if limit is None:
            return True
        return self.publisher.hold(self.progress.step, lambda: self.progress.version, limit,
                                   self.config.publish_every, self._resend_weights)

    def _resend_weights(self) -> None:
        """The send gave up (``publish_timeout_s``, or a version the relays refused as
        not newer: a dead master made it visible before it could answer): these weights
        again, as a version newer than the published one."""
        try:
            latest = self._latest_version()
        except LaminarError as exc:
            log.warning("paused for publishing: etcd does not answer (%s); re-sending "
                        "weights v%d as they are", exc, self.progress.version)
            latest = -1
        if latest >= self.progress.version:
            self.progress.version = latest + 1
        self._publish()

    def one_step(self, groups: list[Group], waited: float) -> None:
        """One step: train, publish, account, eval, report, checkpoint/ack."""
        p = self.progress
        consume_version = p.version
        if p.step == p.first_step:  # a run's first step: see console.check_rewards
            check_rewards(p.step + 1, [t for g in groups for t in g.trajectories()])
        if p.t_first_step is None:
            p.t_first_step = time.monotonic() - waited
        self.feed.start_step()
        result, train_s = self._train(groups)
        # A streamed step also took the groups of its later mini-batches while it trained,
        # and waited for them: that time is waiting (_train leaves it out of train_s).
        groups = groups + self.feed.stream_groups
        waited += self.feed.stream_wait
        p.wait_s += self.feed.stream_wait
        trajs = [t for g in groups for t in g.trajectories()]
        record_s = self._record(groups, consume_version)
        stall = self._maybe_publish()
        self._account(trajs, result)
        metrics = self._step_metrics(trajs, result, consume_version, train_s, waited, stall)
        if self.streaming:
            metrics["stream_wait_s"] = self.feed.stream_wait
        if self.records is not None:
            metrics["record_s"] = record_s
        if self.heldout.due(p.step):
            self.heldout.run(p.step)
            metrics.update(self.heldout.last)
        self.reporter.report(metrics, result, stall, elapsed=p.elapsed(),
                             steps_run=p.step - p.first_step,
                             eval_last=self.heldout.last, eval_step=self.heldout.step)
        # After the step's row: W&B refuses anything logged at a step below one it saw.
        self.samples.maybe_log(p.step, p.version, groups)
        # Last: a checkpoint's step has its metrics and samples rows. A trainer killed
        # between the two would resume after a step whose rows are missing for good; now
        # it resumes from the checkpoint before, drops the later rows and logs them again.
        self.durable.step_done(p.step, p.version)

    def _record(self, groups: list[Group], version: int) -> float:
        """Write the step's record (before its checkpoint: a checkpoint's step always has
        one); returns the seconds it took."""
        if self.records is None:
            return 0.0
        t0 = time.monotonic()
        step = self.progress.step
        try:
            self.records.write(step, version, groups)
        except (OSError, ValueError, LaminarError) as exc:
            # Provenance must not end a run: say so where the user looks, and go on.
            print(f"STEP RECORDS OFF at step {step}: cannot write to "
                  f"{self.records.directory}: {exc}; steps from here are not recorded "
                  "(records.enabled / records.dir)", flush=True)
            log.error("step record of step %d not written: %s", step, exc)
            self.records = None
        return time.monotonic() - t0

    def _train(self, groups: list[Group]) -> tuple[StepResult, float]:
        """The optimizer step (across ranks, in one process, or simulated)."""
        p = self.progress
        t0 = time.monotonic()
        result = self.policy.train(groups, p.version, self.feed.more if self.streaming else None)
        p.step += 1
        train_s = time.monotonic() - t0 - self.feed.stream_wait
        if result.stats.get("skipped_nonfinite"):
            p.nonfinite_steps += 1
            log.warning("step %d: non-finite loss or gradient; the update was skipped", p.step)
        return result, train_s

    def _maybe_publish(self) -> float:
        """Publish a new version when due; returns how long the step loop stalled for it."""
        cfg, p = self.config, self.progress
        if p.step % cfg.publish_every == 0 or p.step == cfg.total_steps:
            p.version += 1
            return self._publish()
        return 0.0

    def _account(self, trajs: list[Trajectory], result: StepResult) -> None:
        """Record what this step consumed (the consumed log; acks once durable), and how
        many groups dynamic sampling dropped since the last step."""
        p = self.progress
        ids = [t.trajectory_id for t in trajs]
        # The manager hears of filtered groups before their acks (one ordered socket):
        # it credits a group only while it still knows it.
        self.feed.note_filtered()
        # Too stale, or filtered: consumed untrained, acked all the same.
        dropped = self.buffer.pop_dropped()
        p.groups_filtered = self.feed.step_done()
        p.tokens_consumed += result.tokens
        self.logs.consumed(p.step, p.version, ids, dropped)
        self.door.step, self.door.version = p.step, p.version
        self.durable.consumed(ids + dropped)

    def _step_metrics(self, trajs: list[Trajectory], result: StepResult, consume_version: int,
                      train_s: float, waited: float, stall: float) -> dict:
        p = self.progress
        # The step-0 eval rides on the first step's row: a run stopped before its summary
        # (interrupted, or resumed later) still plots where it started.
        before = self.heldout.before if p.step == 1 else None
        return step_row(
            step=p.step, version=p.version, consume_version=consume_version,
            trajs=trajs, result=result,
            tokens_per_s=p.tokens_consumed / max(p.elapsed(), 1e-9), train_s=train_s,
            waited=waited, stall=stall, buffered=len(self.buffer),
            simulated=self.policy.simulated, groups_filtered=p.groups_filtered,
            eval_before=before)
