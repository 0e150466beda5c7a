"""Where a finished step's figures go, and the warnings a user must see about them.

:class:`StepReporter` writes a step's metrics row to ``metrics.jsonl``, the trackers
(TensorBoard, W&B), the trainer's status in etcd (in the background: a step never
waits on etcd), the log and the console's ``STEP`` line, and warns when every group
of a step scored the same (zero advantages: a wrong answer key or a failing reward
looks exactly like this). It never references the trainer service.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from laminar_common.roles import State
from laminar_common.status import StatusWriter

from .console import step_line
from .runfiles import RunFiles
from .step import StepResult
from .tracking import MultiTracker

__all__ = ["StepReporter"]

log = logging.getLogger(__name__)

_STATUS_KEYS = ("step", "version", "reward_mean", "tokens_per_s", "staleness_mean",
                "staleness_max", "buffer", "time")
"""What `laminar status` shows of a step (once per step, never per trajectory)."""


class StepReporter:
    """A step's metrics row to every sink (see module docstring).

    Args:
        trackers, status: the trainer's trackers and status writer (made at its start).
        reward_errors: rewards that failed so far (named in the warnings).
    """

    def __init__(self, total_steps: int, logs: RunFiles, trackers: Callable[[], MultiTracker],
                 status: Callable[[], StatusWriter], reward_errors: Callable[[], int]) -> None:
        self.total_steps = total_steps
        self.logs = logs
        self._trackers, self._status, self._reward_errors = trackers, status, reward_errors
        self.last: dict = {}
        """The latest step's metrics row (the Prometheus gauges read it)."""
        self.uniform_steps_total = 0
        """Steps whose every group scored the same."""
        self._uniform_in_a_row = 0

    def track(self, step: int, row: dict, prefix: str = "") -> None:
        """``row`` to the trackers at ``step`` (each stamps its own wall time)."""
        self._trackers().log(step, {k: v for k, v in row.items() if k not in ("step", "time")},
                             prefix)

    def report(self, metrics: dict, result: StepResult, stall: float, *, elapsed: float,
               steps_run: int, eval_last: dict[str, float], eval_step: int) -> None:
        """A finished step: ``metrics`` (its row, with ``step`` and ``version``) to
        metrics.jsonl, the trackers, the status, the log and the console line."""
        step, version = metrics["step"], metrics["version"]
        self.logs.metrics(metrics)
        self.track(step, metrics)
        self.last = metrics
        self._status().put(State.TRAINER, json.dumps(
            {k: metrics[k] for k in _STATUS_KEYS} | {"total_steps": self.total_steps}).encode())
        log.info("step %d v%d loss %.4f reward %.3f grad norm %.3f entropy %.3f clip %.3f "
                 "staleness %.2f tokens/s %.1f stall %.3fs", step, version,
                 result.loss, result.reward_mean, metrics.get("grad_norm", 0.0),
                 metrics.get("entropy", 0.0), metrics.get("clip_fraction", 0.0),
                 metrics["staleness_mean"], metrics["tokens_per_s"], stall)
        print(step_line(step, version, self.total_steps, result.reward_mean, metrics, elapsed,
                        steps_run, eval_last, eval_step, self._reward_errors()), flush=True)
        self._warn_if_uniform(metrics)

    def _warn_if_uniform(self, metrics: dict) -> None:
        """Every group of the step scored the same: zero advantages, nothing learned.
        Logged at the first such step and every 10th in a row."""
        if metrics.get("uniform_group_fraction", 0.0) < 1.0:
            self._uniform_in_a_row = 0
            return
        self._uniform_in_a_row += 1
        self.uniform_steps_total += 1
        if self._uniform_in_a_row % 10 == 1:
            log.warning("step %d: every group scored the same (reward mean %.3f, %d steps in "
                        "a row): zero advantages, the step learns nothing; check the reward, "
                        "the data's answer_key, and reward_errors (%d so far)", metrics["step"],
                        metrics["reward_mean"], self._uniform_in_a_row, self._reward_errors())
