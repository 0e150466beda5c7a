"""Progress of a long loop (a warm start, a set-up step) as plain lines.

Plain lines, not a redrawn bar: set-up steps run under ``laminar up``, which shows
their output as it comes, and logs and CI keep every line. A line is printed at the
first step, then at most every ``every_s`` seconds, and at the last step:
``warm start: step 40/150 (27%) loss 0.812 | 0:12 elapsed, ETA 0:33``.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressLines", "format_clock"]


class ProgressLines:
    """Say how far a loop of ``total`` steps is (see module docstring)."""

    def __init__(self, label: str, total: int, every_s: float = 10.0,
                 stream: TextIO | None = None, clock=time.monotonic) -> None:
        self.label, self.total, self.every_s = label, max(int(total), 0), every_s
        self.stream = stream
        self._clock = clock
        self._t0 = clock()
        self._last: float | None = None

    def update(self, done: int, **figures: float) -> bool:
        """Step ``done`` (1-based) finished; returns whether a line was printed."""
        now = self._clock()
        last = done >= self.total
        if self._last is not None and not last and now - self._last < self.every_s:
            return False
        self._last = now
        elapsed = now - self._t0
        eta = elapsed / done * (self.total - done) if done > 0 else 0.0
        pct = f" ({done / self.total:.0%})" if self.total else ""
        extra = "".join(f" {k} {v:.3f}" for k, v in figures.items())
        print(f"{self.label}: step {done}/{self.total}{pct}{extra} | {format_clock(elapsed)} "
              f"elapsed, ETA {format_clock(eta)}", file=self.stream or sys.stdout, flush=True)
        return True


def format_clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03`` for a console line."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
