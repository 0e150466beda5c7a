"""The trainer's held-out evaluations: before training, every ``eval.every_steps``,
and after the last step.

:class:`HeldOut` runs the policy backend's evaluation (:mod:`.evaluation`: greedy
accuracy and pass@k on ``eval.prompts``) when due, keeps every metric of the latest
one for the step's row and the console line, and says the before/after accuracy on
the console. It never references the trainer service.
"""

from __future__ import annotations

import time
from typing import Any

from .backend import PolicyBackend
from .config import TrainerConfig

__all__ = ["HeldOut"]


class HeldOut:
    """Held-out evaluations of one run (see module docstring)."""

    def __init__(self, config: TrainerConfig, policy: PolicyBackend) -> None:
        self.config = config
        self.policy = policy
        self.before: float | None = None
        """Greedy accuracy before the first step (a fresh run's)."""
        self.after: float | None = None
        """Greedy accuracy after the last step."""
        self.last: dict[str, float] = {}
        """Every metric of the latest eval (accuracy, pass@k, length, truncation)."""
        self.step = 0
        """The step the latest eval ran at."""
        self._records: list[dict[str, Any]] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.config.eval.prompts) and self.policy.can_evaluate

    def due(self, step: int) -> bool:
        """An eval at ``step`` (every ``eval.every_steps``; the last step's weights are
        evaluated once, after the loop)."""
        every = self.config.eval.every_steps
        return self.enabled and bool(every) and step % every == 0 \
            and step < self.config.total_steps

    def run(self, step: int) -> float:
        """Evaluate now; returns the greedy accuracy (every metric in :attr:`last`)."""
        from .evaluation import load_eval_records

        if self._records is None:
            self._records = load_eval_records(self.config.eval)
        t0 = time.monotonic()
        result = self.policy.evaluate(self._records)
        self.last = {**result.metrics(), "eval_seconds": time.monotonic() - t0}
        self.step = step
        return result.accuracy

    def run_before(self, step: int) -> None:
        self.before = self.run(step)
        print(f"EVAL before step {step}: held-out accuracy {self.before:.3f}"
              f"{self._pass_text()}", flush=True)

    def run_after(self, step: int) -> None:
        self.after = self.run(step)
        print(f"EVAL after step {step}: held-out accuracy {self.after:.3f}"
              f"{self._pass_text()}", flush=True)

    def _pass_text(self) -> str:
        k = self.config.eval.samples
        value = self.last.get(f"eval_pass_at_{k}")
        return f", pass@{k} {value:.3f}" if value is not None else ""
