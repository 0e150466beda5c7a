"""Child processes started by Laminar itself (demo, ``laminar up``, tests).

Owns starting a command with its output teed to a log file, waiting for a
line on it with a deadline, the tail of its output once it has exited, and
stopping it — only the pid it started (SIGTERM, then SIGKILL after a grace
period).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from laminar_common.errors import LaminarError

__all__ = ["ChildProcess"]


TIER_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                     "TQDM_DISABLE": "1"}
"""Environment every tier process gets unless the launching environment sets it: the
tiers share the machine's cores, and OpenMP threads that spin while they wait for work
(the default) take cycles from the other tiers (on a 2-core machine, one demo run each: the
trainer's mean step 0.68 s with spinning, 0.62 s without). Third-party progress bars
(Hugging Face's "Loading weights" and the like) are off: a tier's log is lines."""


def tier_env(environ) -> dict[str, str]:
    """The variables of :data:`TIER_ENV_DEFAULTS` that ``environ`` does not set."""
    return {k: v for k, v in TIER_ENV_DEFAULTS.items() if k not in environ}


class ChildProcess:
    """A subprocess whose output lines are kept and written to ``log_path``.

    ``append=False`` starts the log file afresh instead of adding to it.
    """

    def __init__(self, name: str, cmd: Sequence[str], log_path: str,
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 append: bool = True) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = log_path
        self.lines: list[str] = []
        self._cond = threading.Condition()
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(log_path, "a" if append else "w", buffering=1)
        self.started_at = time.time()
        """Wall time just before the process started (a member record it writes is newer)."""
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, cwd=cwd, text=True, bufsize=1,
        )
        self.pid = self.proc.pid
        self._cpu_s: float | None = None
        self._reader = threading.Thread(target=self._read, name=f"out-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, pattern: str, timeout_s: float, start: int = 0) -> re.Match[str]:
        """First output line (from index ``start``) matching ``pattern``.

        Raises:
            LaminarError: the process exited or the deadline passed first.
        """
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = start
        with self._cond:
            while True:
                for i in range(seen, len(self.lines)):
                    m = rx.search(self.lines[i])
                    if m:
                        return m
                seen = len(self.lines)
                if self.poll() is not None and not self._reader.is_alive():
                    raise LaminarError(
                        f"{self.name} exited with {self.proc.returncode} before printing "
                        f"/{pattern}/; last lines:\n" + "\n".join(self.lines[-20:])
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LaminarError(
                        f"{self.name} did not print /{pattern}/ within {timeout_s}s; last lines:\n"
                        + "\n".join(self.lines[-20:])
                    )
                self._cond.wait(min(left, 0.5))

    def tail(self, n: int | None = 40) -> list[str]:
        """The last ``n`` output lines (None: all); once the process has exited, up to
        its last line."""
        if self.poll() is not None:
            self._reader.join(timeout=5)
        with self._cond:
            return list(self.lines) if n is None else self.lines[-n:] if n > 0 else []

    def poll(self) -> int | None:
        """``Popen.poll``, after reading the CPU count (an exited process's final one,
        before poll reaps it). Use this, not ``proc.poll()``, to keep that count."""
        if self.proc.returncode is None and not self.wait_exit(0):
            self.cpu_seconds()  # running: the count so far
        return self.proc.poll()

    def alive(self) -> bool:
        return self.poll() is None

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the process (every thread) and of the children it
        reaped, read from ``/proc/PID/stat``; once it is gone, the last value read (the
        final one when :meth:`alive` or :meth:`stop` saw it exit). None without /proc."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return self._cpu_s
        if self.proc.returncode is not None:
            return self._cpu_s  # reaped: the pid may belong to another process now
        # fields after the ")" of the command name: utime, stime, cutime, cstime are 12-15
        fields = stat.rsplit(")", 1)[1].split()
        self._cpu_s = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
        return self._cpu_s

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the process to exit *without* reaping it, then
        read its final CPU time; True if it exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                done = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped already
                return True
            if done is not None:
                self.cpu_seconds()
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL this pid (a crash, as far as the rest of the job can tell)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.wait_exit(10)
            self.proc.wait(10)

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            if not self.wait_exit(grace_s):
                self.proc.kill()
                self.wait_exit(grace_s)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(grace_s)
        self._reader.join(timeout=5)
        self._log.close()
        return self.proc.returncode
