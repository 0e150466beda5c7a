"""The trainer's Prometheus metrics, read from its parts on each scrape.

Per-step figures come from the last metrics row (:data:`STEP_GAUGES`); counters from
the buffer, the trajectory door (:class:`~laminar_common.consume.TrajectoryConsumer`)
and the weight publisher. Nothing here is computed per step or waits on anything.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from laminar_common.codec import Trajectory
from laminar_common.consume.consumer import TrajectoryConsumer
from laminar_common.consume.validation import REASONS
from laminar_common.metrics import Metric

from .buffer import ExperienceBuffer
from .heldout import HeldOut
from .publisher import PublishStats
from .step import StepResult, trajectory_metrics

__all__ = ["STEP_GAUGES", "prometheus_metrics", "rejected_by_reason", "step_row", "run_summary"]

STEP_GAUGES = (
    ("grad_norm", "gradient norm before clipping, mean over the last step's updates"),
    ("entropy", "mean token entropy of the policy on the last step's completions"),
    ("clip_fraction_low", "tokens clipped below 1 - clip_low (negative advantage)"),
    ("clip_fraction_high", "tokens clipped above 1 + clip_high (positive advantage)"),
    ("behaviour_kl", "k3 KL(behaviour || proximal) of the last step"),
    ("proximal_kl", "k3 KL(proximal || trained) over the last step's updates"),
    ("is_weight_mean", "mean truncated importance weight of the last step"),
    ("is_weight_max", "largest truncated importance weight of the last step"),
    ("is_truncated_fraction", "tokens whose importance weight was truncated"),
    ("response_length_mean", "mean completion length of the last step (tokens)"),
    ("response_length_max", "longest completion of the last step (tokens)"),
    ("truncation_rate", "completions of the last step cut at max_tokens"),
)
"""Per-step figures exported as Prometheus gauges (name, help), from the metrics row."""




def rejected_by_reason(door: TrajectoryConsumer | None) -> dict[str, int]:
    """Trajectories the door refused by content, by reason (every reason, zeros too)."""
    got = door.stats.rejected if door is not None else {}
    return {k: got.get(k, 0) for k in REASONS} | dict(got)


def prometheus_metrics(*, step: int, version: int, tokens_consumed: int, last: dict,
                       buffer: ExperienceBuffer, door: TrajectoryConsumer | None,
                       nonfinite_steps: int, publisher: PublishStats) -> list[Metric]:
    """The trainer's metrics now (``last``: the latest step's metrics row)."""
    b, pub = buffer.stats, publisher
    stats = door.stats if door is not None else None
    rejected = rejected_by_reason(door)
    return [
        Metric("steps_total", "counter", "optimizer steps", step),
        Metric("weight_version", "gauge", "version of the trainer's weights", version),
        Metric("tokens_consumed_total", "counter", "trajectory tokens trained on",
               tokens_consumed),
        Metric("tokens_per_second", "gauge", "tokens consumed per second since the first step",
               last.get("tokens_per_s", 0.0)),
        Metric("reward_mean", "gauge", "mean reward of the last step",
               last.get("reward_mean", 0.0)),
        Metric("loss", "gauge", "loss of the last step (mean over its updates)",
               last.get("loss", 0.0)),
        *(Metric(name, "gauge", help_text, float(last.get(name, 0.0)))
          for name, help_text in STEP_GAUGES),
        Metric("reward_by_source", "gauge", "mean reward of the last step per data_source",
               labels=("data_source",),
               values={(k,): v for k, v in last.get("reward_by_source", {}).items()}),
        Metric("groups_filtered_total", "counter",
               "groups dropped by dynamic sampling (all rewards equal)", b.filtered),
        Metric("buffer_trajectories", "gauge", "trajectories buffered", len(buffer)),
        Metric("buffer_received_total", "counter", "trajectories received (every copy)",
               stats.received if stats else 0),
        Metric("buffer_refused_total", "counter", "trajectories refused", labels=("reason",),
               values={("duplicate",): stats.duplicates - stats.reacked if stats else 0,
                       ("consumed",): stats.reacked if stats else 0,
                       ("full",): b.dropped_full, ("stale",): b.dropped_stale}),
        Metric("staleness_trajectories", "gauge", "consumed trajectories by staleness",
               labels=("versions",),
               values={(str(k),): v for k, v in sorted(b.staleness.items())}),
        Metric("trajectories_rejected_total", "counter",
               "trajectories refused by content validation", labels=("reason",),
               values={(k,): v for k, v in rejected.items()}),
        Metric("trajectories_failed_total", "counter",
               "trajectory ids given up on after max_rejections", b.failed),
        Metric("nonfinite_steps_total", "counter",
               "steps whose loss or gradient was not finite (update skipped)",
               nonfinite_steps),
        Metric("publishes_total", "counter", "weight versions handed to the relay",
               pub.published),
        Metric("publish_stall_seconds", "gauge", "stall of the last publish",
               pub.stall_s[-1] if pub.stall_s else 0.0),
        Metric("rejected_frames_total", "counter", "frames refused by the trajectory socket",
               labels=("reason",),
               values={(k,): v for k, v in door.transport_stats.rejected.items()}
               if door is not None else {}),
    ]


def step_row(*, step: int, version: int, consume_version: int, trajs: list[Trajectory],
             result: StepResult, tokens_per_s: float, train_s: float, waited: float,
             stall: float, buffered: int, simulated: bool, groups_filtered: int,
             eval_before: float | None = None) -> dict:
    """A step's metrics.jsonl row (``eval_before``: the step-0 eval, on step 1's row)."""
    staleness = [consume_version - t.policy_version for t in trajs]
    first = {"eval_before": eval_before} if eval_before is not None else {}
    return {
        **first,
        "step": step, "version": version, "time": time.time(),
        "loss": result.loss, "reward_mean": result.reward_mean,
        "tokens": result.tokens, "tokens_per_s": tokens_per_s,
        "step_s": train_s, "wait_s": waited, "stall_s": stall,
        "staleness_mean": statistics.fmean(staleness), "staleness_max": max(staleness),
        "buffer": buffered, "simulated": simulated,
        "groups_filtered": groups_filtered, **trajectory_metrics(trajs),
        **result.stats,
    }


def run_summary(*, step: int, version: int, heldout: HeldOut, tokens_consumed: int,
                elapsed: float, wait_s: float, buffer: ExperienceBuffer,
                publisher: PublishStats, door: TrajectoryConsumer | None, uniform_steps: int,
                refused_stale_resume: int, ended_early: str | None, nonfinite_steps: int,
                simulated: bool, run_dir: Path, tracker_errors: int) -> dict:
    """The run's summary (summary.json; ``elapsed`` since the first step)."""
    hist = dict(sorted(buffer.stats.staleness.items()))
    total = sum(hist.values()) or 1
    pub = publisher
    return {
        "steps": step, "version": version, "eval_before": heldout.before,
        "eval_after": heldout.after, "tokens_consumed": tokens_consumed,
        "tokens_per_s": tokens_consumed / elapsed if elapsed else 0.0,
        "trainer_idle_fraction": wait_s / elapsed if elapsed else 0.0,
        "staleness_hist": hist,
        "staleness_mean": sum(k * v for k, v in hist.items()) / total,
        "publishes": pub.published, "publish_failed": pub.failed,
        "stall_mean_s": statistics.fmean(pub.stall_s) if pub.stall_s else 0.0,
        "send_mean_s": statistics.fmean(pub.send_s) if pub.send_s else 0.0,
        "buffer": vars(buffer.stats) | {"staleness": hist},
        "reward_errors": buffer.stats.reward_errors,
        "uniform_steps": uniform_steps,
        "rejected": {k: v for k, v in rejected_by_reason(door).items() if v},
        "door": vars(door.stats) | {"rejected": dict(door.stats.rejected)}
        if door is not None else {},
        "refused_stale_after_resume": refused_stale_resume,
        "ended_early": ended_early,
        "nonfinite_steps": nonfinite_steps,
        "simulated_step": simulated, "run_dir": str(run_dir),
        "tracker_errors": tracker_errors,
    }
