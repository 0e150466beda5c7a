"""Where a trainer process starts: a fresh run, or the latest checkpoint.

:func:`begin` loads the policy (fresh weights, or the checkpoint's weights, optimizer
and scheduler) and says where the run stands: its step and version, the consumed ids
for the trajectory door and the buffer, and the run logs cut back to the checkpoint
(steps after it are trained again, by other ids or the same ones re-sent, and logged
again). A fresh start (no ``--resume``) removes an earlier run's logs and checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar_common.consume.consumed import ConsumedIds

from .backend import PolicyBackend
from .checkpoint import latest_checkpoint
from .config import TrainerConfig
from .runfiles import RunFiles, clear_old_checkpoints

__all__ = ["Start", "begin"]

log = logging.getLogger(__name__)


@dataclass
class Start:
    """Where the run stands when this process starts."""

    step: int = 0
    version: int = 0
    door_state: dict[str, Any] | None = None
    """The trajectory door's state (``TrajectoryConsumer(state=...)``); None: fresh."""
    consumed: ConsumedIds = field(default_factory=ConsumedIds)
    """The ids the checkpoint trained (the buffer's exactly-once memory)."""

    @property
    def resumed(self) -> bool:
        return self.door_state is not None


def begin(config: TrainerConfig, policy: PolicyBackend, logs: RunFiles,
          resume: bool) -> Start:
    """Load ``policy`` and the run's position (see module docstring)."""
    root = config.checkpoint.dir
    if not resume and root:
        clear_old_checkpoints(Path(root))
    ckpt = latest_checkpoint(root) if resume and root else None
    if resume and ckpt is None:
        log.warning("--resume: no checkpoint in %s; starting fresh", root)
    state = policy.load(ckpt)
    if state is None:  # a fresh start (or --resume with nothing to resume: fresh too)
        logs.start_fresh()
        return Start()
    seqs = state.consumed_seqs or [-1] * len(state.consumed)
    failed = dict(state.failed or {})
    consumed = ConsumedIds(state.consumed, seqs, state.settled_below)
    consumed.failed.update(failed)
    logs.cut_back(state.step)
    log.info("resumed from %s: step %d, version %d, %d consumed ids", ckpt, state.step,
             state.version, len(state.consumed))
    return Start(step=state.step, version=state.version, consumed=consumed,
                 door_state={"consumed": list(zip(state.consumed, seqs)),
                             "settled_below": state.settled_below, "failed": failed})
