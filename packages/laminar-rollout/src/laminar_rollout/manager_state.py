"""The manager's saved state (``state_dir/manager_state.json``) for ``--resume``.

What a resumed manager needs: the prompt cursor (epoch and position, with the
shuffle and seed it was taken with), the open batch, the ledger (every group not
settled yet, with its trajectories' states), and what weights it had seen (a
resumed manager sends no new work until the running trainer's weights reach the
workers). Written atomically every couple of seconds and at close; read once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from laminar_common.errors import LaminarError
from laminar_common.membership import MemberRecord, VersionRecord

from .config import ManagerConfig
from .ledger import TrajectoryLedger
from .prompts import PromptCursor, check_resume

__all__ = ["Restored", "StateFile", "ResumeHold", "RESUME_HOLD_SAY_EVERY_S"]

log = logging.getLogger(__name__)

RESUME_HOLD_SAY_EVERY_S = 60.0
"""A resumed manager holding new work for the resumed weights says so this often."""


@dataclass
class Restored:
    """What ``--resume`` restored."""

    cursor: PromptCursor
    batch: int
    ledger: TrajectoryLedger
    hold: tuple[int, float] | None
    """(the newest version the saved manager had seen, when it saved); None: no hold."""


class StateFile:
    """``<state_dir>/manager_state.json`` (see module docstring)."""

    def __init__(self, config: ManagerConfig, every_s: float = 2.0) -> None:
        self.config = config
        self.every_s = every_s
        self._last_write = 0.0

    @property
    def path(self) -> str | None:
        if self.config.state_dir is None:
            return None
        return os.path.join(self.config.state_dir, "manager_state.json")

    def restore(self, records: list[dict], sampling: Any) -> Restored | None:
        """The saved cursor, batch, ledger and hold; None when nothing was saved.

        The saved cursor resumes in the order it was taken in: a config whose
        ``data.shuffle`` / ``data.seed`` differ from the saved ones, or a prompt file
        of another length, is refused (:func:`~laminar_rollout.prompts.check_resume`).

        Raises:
            LaminarError: no ``state_dir``, or the file cannot be restored (names it).
        """
        cfg, path = self.config, self.path
        if path is None:
            raise LaminarError("manager --resume needs state_dir (where the state was saved)")
        if not os.path.exists(path):
            log.warning("--resume: no saved state at %s; starting fresh", path)
            return None
        try:
            with open(path) as fh:
                data = json.load(fh)
            saved = data["summary"]["cursor"]
            shuffle, seed = cfg.data.shuffle, cfg.data.seed
            check_resume(saved, len(records), shuffle, seed)
            cursor = PromptCursor(records, cfg.epochs, cfg.max_prompts,
                                  epoch=int(saved["epoch"]), position=int(saved["position"]),
                                  shuffle=shuffle, seed=seed)
            batch = int(data["summary"].get("batch", -1))
            # A manager itself resumed and still holding saved what it waits for (a fresh
            # etcd left it at latest v0): a second interruption keeps the hold.
            seen = int(data.get("resume_seen", data["summary"].get("latest_version", 0)))
            # Weights v0 are every worker's initial ones: nothing newer seen, nothing to wait for.
            hold = (seen, float(data.get("saved_at", 0.0))) if seen > 0 else None
            ledger = TrajectoryLedger.restored(data["ledger"], cursor.lookup, sampling,
                                               cfg.ledger_keep_groups)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LaminarError(f"manager --resume: cannot restore {path}: {exc}") from exc
        log.info("resumed from %s: cursor %s, batch %d, ledger %s", path, cursor.state(),
                 batch, ledger.counts())
        return Restored(cursor, batch, ledger, hold)

    def write(self, summary: dict, ledger: TrajectoryLedger, latest: int,
              hold: tuple[int, float] | None, force: bool = False) -> None:
        """Save now (``force``) or when ``every_s`` passed since the last save."""
        path = self.path
        if path is None:
            return
        now = time.monotonic()
        if not force and now - self._last_write < self.every_s:
            return
        self._last_write = now
        os.makedirs(self.config.state_dir, exist_ok=True)
        seen, saved_at = latest, time.time()
        if hold is not None:  # still waiting for what the last save had seen
            seen, saved_at = max(seen, hold[0]), hold[1]
        data = {"summary": summary, "ledger": ledger.snapshot(), "saved_at": saved_at,
                "resume_seen": seen}
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)


class ResumeHold:
    """After ``--resume``: no new work until the weights workers load are the running
    trainer's, a version published after the last save, or a trainer alive since before
    it (only the manager restarted). Until then the workers hold their initial weights
    (or a dead trainer's, rolled back by its resume), and what they generated would be
    older than any staleness bound.

    Args:
        hold: (the newest version the saved manager had seen, when it saved); None: no
            hold.
    """

    def __init__(self, hold: tuple[int, float] | None = None) -> None:
        self.hold = hold
        self._said = 0.0

    @property
    def holding(self) -> bool:
        return self.hold is not None

    def start(self, latest: VersionRecord | None, trainers: dict[str, MemberRecord]) -> None:
        """At start (one etcd read): end the hold if etcd's latest version came after the
        save, or a trainer registered since before it (it published what etcd holds, and a
        trainer waiting for data would publish nothing new to end the hold)."""
        if self.hold is None:
            return
        self._said = time.monotonic()
        self.published(latest)
        if self.hold is not None:
            lived = [m for m in trainers.values() if m.started_at < self.hold[1]]
            if lived:
                self.hold = None
                log.info("resumed: trainer %s ran all along (since before the last save); "
                         "new work goes out at v%s", lived[0].member_id,
                         "?" if latest is None else latest.version)
        if self.hold is not None:
            log.warning("resumed: no new work until the trainer publishes its resumed "
                        "weights (this manager had seen v%d; etcd has %s)", self.hold[0],
                        "none" if latest is None else f"v{latest.version}")

    def published(self, record: VersionRecord | None) -> None:
        """A version was published: the hold ends if after the save."""
        if self.hold is None or record is None:
            return
        if record.published_at > self.hold[1]:
            self.hold = None
            log.info("resumed: new work goes out at v%d", record.version)

    def check(self, latest: int) -> bool:
        """Still holding (said every ``RESUME_HOLD_SAY_EVERY_S``)."""
        if self.hold is None:
            return False
        now = time.monotonic()
        if now - self._said >= RESUME_HOLD_SAY_EVERY_S:
            self._said = now
            log.warning("resumed: still holding new work until the trainer publishes its "
                        "resumed weights (this manager had seen v%d; latest v%d)",
                        self.hold[0], latest)
        return True
