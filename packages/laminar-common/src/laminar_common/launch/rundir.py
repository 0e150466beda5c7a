"""The run directory of one ``laminar up`` launch.

Owns what makes a run dir this launch's and no one else's: an exclusive lock
for the launcher's lifetime (a second ``laminar up`` into the same run dir is
refused while the first runs), the launch stamp (``launch.json``: id, start
time, pid, job), and a fresh start for what the launcher itself keeps there
per launch: ``logs/`` (the previous launch's move to ``logs.previous/``) and
the embedded etcd's data (``etcd/``, removed: each launch's etcd starts
empty, so no member record, election or weight version of an earlier launch
is seen). Set-up products (a model, prompt files) and the tiers' own outputs
stay: the set-up commands skip what exists, and each tier starts a new run in
its dirs on a fresh start (the trainer removes an earlier run's metrics and
checkpoints). What a report reads is filtered by :attr:`RunDir.started_at`.

Invariants: the lock is held from :meth:`RunDir.lock` to :meth:`RunDir.release`
(or the process's end); nothing is removed before the lock is held.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path

from laminar_common.errors import LaminarError

__all__ = ["RunDir", "LOCK_NAME", "STAMP_NAME"]

LOCK_NAME = ".laminar-up.lock"
STAMP_NAME = "launch.json"


class RunDir:
    """``path`` as the run dir of the launch that starts now."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.started_at = time.time()
        """Wall time this launch began: files older than this are an earlier launch's."""
        self.launch_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.started_at)) + \
            "-" + secrets.token_hex(3)
        self._fd: int | None = None

    def lock(self) -> None:
        """Create the dir and take its lock.

        Raises:
            LaminarError: another ``laminar up`` holds it (named by its pid).
        """
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LaminarError(
                f"run_dir {str(self.path)!r} is in use by another `laminar up` (pid {holder}): "
                "let it finish or stop it, or give this launch another run_dir "
                "(--set run_dir=...)") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def begin(self, job: str, job_file: str | None, embedded_etcd: bool) -> None:
        """Stamp the dir as this launch's; start ``logs/`` and the embedded etcd afresh."""
        assert self._fd is not None, "lock() first"
        stamp = {"launch_id": self.launch_id, "started_at": self.started_at,
                 "pid": os.getpid(), "job": job, "job_file": job_file}
        (self.path / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
        logs = self.path / "logs"
        if logs.is_dir() and any(logs.iterdir()):
            previous = self.path / "logs.previous"
            if previous.exists():
                shutil.rmtree(previous)
            logs.rename(previous)
        if embedded_etcd and (self.path / "etcd").exists():
            shutil.rmtree(self.path / "etcd")

    def record(self, **fields: object) -> None:
        """Add ``fields`` to this launch's stamp (e.g. the etcd endpoints, once known, which
        ``laminar status RUN_DIR`` reads)."""
        path = self.path / STAMP_NAME
        stamp = json.loads(path.read_text())
        stamp.update(fields)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(stamp, indent=2) + "\n")
        os.replace(tmp, path)

    def release(self) -> None:
        """Give the lock back (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
