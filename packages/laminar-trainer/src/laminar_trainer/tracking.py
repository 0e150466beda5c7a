"""Optional experiment trackers: the trainer's metric rows, also sent to TensorBoard or W&B.

Owns the :class:`Tracker` interface, its TensorBoard and Weights & Biases
implementations, :class:`MultiTracker` (the fan-out the service holds) and
:func:`make_trackers`, which turns ``tracking`` config into them.

Two channels: scalars (:meth:`Tracker.log`, every metrics row) and sample rows
(:meth:`Tracker.log_samples`: a few completions with their rewards every so many
steps, from ``laminar_trainer.samples``), shown as a markdown table in
TensorBoard's text tab and as a ``wandb.Table`` in W&B.

Must not import ``tensorboard`` or ``wandb`` at module import: both are optional
extras (``laminar-trainer[tensorboard]``, ``laminar-trainer[wandb]``), imported by
:func:`make_trackers` only when the config turns them on. A tracker that is
asked for but not installed is a :class:`ConfigError` at trainer start naming
the config field and the package to install.

Invariants:

- :meth:`Tracker.log` receives flat ``name -> float`` dicts only (see
  :func:`flatten_scalars` for what is kept, converted and skipped).
- A sample row is a flat dict of strings, numbers and ``None``; every row of one
  call has the same keys (the table's columns). ``log_samples`` is optional:
  :class:`MultiTracker` skips a tracker that has none.
- A tracker that raises while logging or closing never stops training: the
  error is logged as a warning with the tracker's name and counted in
  :attr:`MultiTracker.errors` (the summary's ``tracker_errors``).
- Nothing is logged after :meth:`MultiTracker.close`.
- Only rank 0 tracks: ``TrainerService``, the one holder of a ``MultiTracker``,
  runs only on rank 0.
"""

from __future__ import annotations

import html
import importlib
import logging
import numbers
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from laminar_common.errors import ConfigError, LaminarError

from .config import TrackingConfig

__all__ = ["Tracker", "TensorBoardTracker", "WandbTracker", "MultiTracker", "flatten_scalars",
           "make_trackers", "markdown_table"]

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """Where metric rows go besides metrics.jsonl."""

    name: str

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` (flat names, numbers only) at ``step``."""

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Record sample rows (one table, the rows' keys as columns) at ``step``.

        Optional: :class:`MultiTracker` skips a tracker without this method.
        """

    def close(self) -> None:
        """Flush and release; called once."""


def flatten_scalars(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric part of a metrics row, as flat ``name -> float``.

    Rules: real numbers (ints, floats, numpy scalars) are kept as floats; bools
    become 0.0/1.0; a nested mapping is flattened with ``/`` (the summary's
    ``staleness_hist`` becomes ``staleness_hist/0``, ``staleness_hist/1``, ...);
    everything else (``None``, strings, lists) is skipped. ``prefix`` is put in
    front of every name.
    """
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, numbers.Real):
            out[name] = float(value)
        elif isinstance(value, Mapping):
            out.update(flatten_scalars(value, f"{name}/"))
    return out


class TensorBoardTracker:
    """Scalars in TensorBoard event files under ``log_dir`` (one tag per metric name)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        try:
            self._writer = SummaryWriter(log_dir=str(log_dir))
        except OSError as exc:
            raise LaminarError(f"tracking.tensorboard.dir: cannot write {log_dir}: {exc}") from exc

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        # Rows come once per step (seconds apart): flush so a live TensorBoard sees each one.
        self._writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._writer.add_text("samples", markdown_table(rows), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """One Weights & Biases run; ``config`` is recorded as the run's config."""

    name = "wandb"

    def __init__(self, project: str, mode: str, run_name: str, directory: str | Path,
                 config: Mapping[str, Any]) -> None:
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        try:
            # console="off": stdout carries the trainer's progress lines (STEP, EVAL, DONE)
            # that launchers parse; wandb must not wrap it.
            self._run = wandb.init(project=project, mode=mode, name=run_name, dir=str(directory),
                                   config=dict(config), settings=wandb.Settings(console="off"))
        except (wandb.Error, OSError) as exc:
            raise LaminarError(f"tracking.wandb: wandb.init failed: {exc}") from exc

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        columns = list(rows[0])
        table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        self._run.finish()


class MultiTracker:
    """Fans metric rows out to trackers; a failing tracker is reported and counted, never fatal.

    Thread-safe: the train loop logs, and the service's close may run on another thread.
    """

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self.trackers = list(trackers)
        self.errors = 0
        self._errors_by_name: dict[str, int] = {}
        self._closed = False
        self._lock = threading.Lock()

    def log(self, step: int, row: Mapping[str, Any], prefix: str = "") -> None:
        """Send the numeric part of ``row`` (see :func:`flatten_scalars`) to every tracker."""
        if not self.trackers:
            return
        scalars = flatten_scalars(row, prefix)
        with self._lock:
            if self._closed:
                return
            for tracker in self.trackers:
                try:
                    tracker.log(step, scalars)
                except Exception as exc:  # noqa: BLE001 - any library error; reported below
                    self._report(tracker, f"log step {step}", exc)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Send sample rows to every tracker that takes them (see :meth:`Tracker.log_samples`)."""
        if not self.trackers or not rows:
            return
        rows = [dict(row) for row in rows]
        with self._lock:
            if self._closed:
                return
            for tracker in self.trackers:
                log_samples = getattr(tracker, "log_samples", None)
                if log_samples is None:
                    continue
                try:
                    log_samples(step, rows)
                except Exception as exc:  # noqa: BLE001 - any library error; reported below
                    self._report(tracker, f"log samples at step {step}", exc)

    def close(self) -> None:
        """Close every tracker once; later calls return at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tracker in self.trackers:
                try:
                    tracker.close()
                except Exception as exc:  # noqa: BLE001 - any library error; reported below
                    self._report(tracker, "close", exc)

    def _report(self, tracker: Tracker, what: str, exc: Exception) -> None:
        self.errors += 1
        count = self._errors_by_name.get(tracker.name, 0) + 1
        self._errors_by_name[tracker.name] = count
        # The traceback once per tracker: a broken tracker fails at every step.
        log.warning("tracker %s failed to %s (its error %d; training goes on): %r",
                    tracker.name, what, count, exc, exc_info=count == 1)


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def _markdown_cell(value: Any) -> str:
    """``value`` as text that stays inside one markdown table cell and renders literally:
    markdown punctuation escaped, HTML escaped (a chat template's ``<|im_start|>`` would
    otherwise be dropped as a tag), newlines as ``<br>``."""
    text = "" if value is None else str(value)
    text = html.escape(_MARKDOWN_SPECIAL.sub(r"\\\1", text), quote=False)
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` as one markdown table, the first row's keys as columns (TensorBoard's text)."""
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(_markdown_cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_markdown_cell(row.get(c)) for c in columns) + " |"
              for row in rows]
    return "\n".join(lines)


def _require(module: str, field: str, package: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"trainer config: {field} is set but the '{package}' package is not installed "
            f"(pip install {package}, or the laminar-trainer[{package}] extra)") from exc


def make_trackers(config: TrackingConfig, run_dir: str | Path, run_name: str,
                  run_config: Mapping[str, Any]) -> MultiTracker:
    """The trackers ``config`` turns on (none by default), libraries imported only then.

    Args:
        config: the trainer's ``tracking`` section.
        run_dir: the trainer's run directory (W&B files go there unless ``wandb.dir``).
        run_name: W&B run name unless ``wandb.run_name`` is set.
        run_config: recorded as the W&B run's config (the resolved trainer config).

    Raises:
        ConfigError: a tracker is turned on but its package is not installed.
        LaminarError: a tracker could not start (directory not writable, wandb.init failed).
    """
    tb, wb = config.tensorboard, config.wandb
    use_wandb = wb.project is not None and wb.mode != "disabled"
    # Check every package before starting any tracker: a config error leaves nothing behind.
    if tb.dir is not None:
        _require("tensorboard", "tracking.tensorboard.dir", "tensorboard")
    if use_wandb:
        _require("wandb", "tracking.wandb.project", "wandb")
    trackers: list[Tracker] = []
    try:
        if tb.dir is not None:
            trackers.append(TensorBoardTracker(tb.dir))
        if use_wandb:
            trackers.append(WandbTracker(wb.project, wb.mode, wb.run_name or run_name,
                                         wb.dir or run_dir, run_config))
    except BaseException:
        MultiTracker(trackers).close()
        raise
    if trackers:
        log.info("tracking to %s", ", ".join(t.name for t in trackers))
    return MultiTracker(trackers)
