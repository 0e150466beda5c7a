"""The run directory's logs, and a fresh start's clean-up of an earlier run.

``run_dir`` holds three JSONL logs, one row per step (``step`` field):

- ``consumed.jsonl``: the ids each step consumed (trained, or ``dropped``: too
  stale or filtered) and the version it consumed them at;
- ``metrics.jsonl``: each step's metrics row;
- ``samples.jsonl``: completions logged every ``samples.every_steps``
  (:mod:`.samples` writes it; this module only cuts it back).

A fresh start (no ``--resume``) deletes them; a resumed run cuts them back to its
checkpoint's step, so the steps after it, trained again, are logged once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from laminar_common.config import dump_config
from laminar_common.data.provenance import StepRecordWriter

from .config import TrainerConfig

__all__ = ["RunFiles", "clear_old_checkpoints", "make_step_records"]

log = logging.getLogger(__name__)


class RunFiles:
    """The step logs of one run directory (see module docstring)."""

    LOGS = ("consumed.jsonl", "metrics.jsonl", "samples.jsonl")

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def start_fresh(self) -> None:
        """A new run: an earlier run's logs go."""
        for name in self.LOGS:
            (self.run_dir / name).unlink(missing_ok=True)

    def cut_back(self, step: int) -> None:
        """Keep every log's rows up to ``step`` (rows without a step stay)."""
        for name in self.LOGS:
            path = self.run_dir / name
            if not path.exists():
                continue
            kept = [line for line in path.read_text().splitlines()
                    if line and json.loads(line).get("step", 0) <= step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)

    def consumed(self, step: int, version: int, ids: list[str],
                 dropped: Iterable[str] = ()) -> None:
        row: dict = {"step": step, "version": version, "ids": ids}
        dropped = list(dropped)
        if dropped:
            row["dropped"] = dropped
        self._append("consumed.jsonl", row)

    def metrics(self, row: dict) -> None:
        self._append("metrics.jsonl", row)

    def _append(self, name: str, row: dict) -> None:
        with open(self.run_dir / name, "a") as fh:
            fh.write(json.dumps(row) + "\n")


def clear_old_checkpoints(root: Path) -> None:
    """A fresh start (no --resume) begins a new run, as it does for the logs in
    run_dir: an earlier run's checkpoints in ``root`` go. Kept, they would be pruned
    against this run's by step number, deleting this run's newest (LATEST then names a
    missing checkpoint and --resume fails)."""
    old = sorted(p for p in root.glob("step-*") if p.is_dir())
    if not old and not (root / "LATEST").exists():
        return
    log.warning("fresh start: removing %d checkpoints of an earlier run from %s (%s); "
                "pass --resume to continue that run instead", len(old), root,
                ", ".join(p.name for p in old[-3:]))
    for path in old:
        shutil.rmtree(path)
    (root / "LATEST").unlink(missing_ok=True)


def make_step_records(config: TrainerConfig, step: int, world_size: int,
                      decode: Callable[[Sequence[int]], str] | None) -> StepRecordWriter | None:
    """The step-record writer (None: records are off). ``records.dir``, else
    ``<checkpoint.dir>/records``, else ``<run_dir>/records``; the records after ``step``
    go (a resumed run trains those steps again; a fresh one, step 0, drops an earlier
    run's)."""
    if not config.records.enabled:
        return None
    root = config.checkpoint.dir
    where = config.records.dir or (Path(root) / "records" if root
                                   else Path(config.run_dir) / "records")
    writer = StepRecordWriter(where, dump_config(config), config.records.keep_steps,
                              decode=decode, meta={"world_size": str(world_size)})
    writer.drop_after(step)
    return writer
