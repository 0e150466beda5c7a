"""Checking every tier's config before ``laminar up`` starts anything.

Owns running each tier replica's own validation — its command with the config
file the launcher wrote, the job file's ``args`` and the tier's check flag
(``--print-config``; the relay's ``--check``) — as parallel subprocesses with
a deadline, and turning the failures into one :class:`ConfigError` naming the
tier, the replica's config file, the job file section it came from and the
tier's own error text (its field paths). It imports no tier: each tier
validates exactly what it will run with (the same file, arguments and
environment, so ``LAMINAR_*`` variables count), except that an embedded
etcd's endpoint is a placeholder until etcd starts.

Set-up products: a job's set-up commands may write what the tiers check (the
demo's model directory and prompt files). A failure whose every line names a
path that a set-up command names is *deferred*: checked again after the
set-up, still before etcd or any tier starts. Any other failure stops the
launch before the set-up.

Invariants: every process started here is ended here (by its pid) before
:func:`run_checks` returns; nothing is started when a check fails.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from laminar_common.config import PREFLIGHT_WARNING_PREFIX as WARNING_PREFIX
from laminar_common.errors import ConfigError, LaminarError

__all__ = ["TierCheck", "CheckFailure", "WARNING_PREFIX", "default_check_args", "run_checks",
           "setup_paths", "is_deferred", "failures_text", "raise_for"]

_CHECK_ARGS = {
    ("laminar-relay", "serve"): ("--check",),
    ("laminar-rollout", "serve"): ("--print-config",),
    ("laminar-rollout", "manage"): ("--print-config",),
    ("laminar-trainer", "run"): ("--print-config",),
}
"""The flag with which each of Laminar's own tier commands validates its config and exits."""

_SHOWN_LINES = 40
"""Lines of a tier's error text shown (a traceback is cut to its end)."""


@dataclass(frozen=True)
class TierCheck:
    """One replica's validation: which tier, its config file, the command to run."""

    tier: str
    replica: str
    config_path: str
    argv: tuple[str, ...]
    shown: str = ""
    """The command as the job file names it (for messages; default: ``argv``)."""


@dataclass(frozen=True)
class CheckFailure:
    """A check that did not exit 0: its code (None: timed out) and what it printed."""

    check: TierCheck
    code: int | None
    text: str


def default_check_args(command: Sequence[str]) -> tuple[str, ...]:
    """The check flag of a Laminar tier command (``[laminar-trainer, run]``); () for others."""
    return _CHECK_ARGS.get(tuple(command[:2]), ())


def setup_paths(setup: Iterable[Sequence[str]], run_dir: str | os.PathLike[str]) -> list[str]:
    """Paths the set-up commands name (arguments holding a ``/``, ``--opt=path`` values).

    The run dir itself and its parents are left out: naming them says nothing about
    what a set-up step writes.
    """
    run = os.path.normpath(str(run_dir))
    ancestors = {run, *(os.path.normpath(str(p)) for p in Path(run).parents)}
    out: list[str] = []
    for argv in setup:
        for arg in argv[1:]:
            value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
            if "/" not in value or value.startswith("-"):
                continue
            path = os.path.normpath(value)
            if path not in ancestors and path not in out:
                out.append(path)
    return out


def is_deferred(text: str, paths: Sequence[str]) -> bool:
    """Whether every line of a tier's error text names one of the set-up ``paths``.

    A header line ending with ``:`` (``invalid TrainerConfig (file ...):``) is
    not a problem of its own and is skipped; a text with no other line is not
    deferred.
    """
    if not paths:
        return False
    forms = [p for path in paths for p in (path, os.path.abspath(path))]
    problems = [line for line in text.splitlines() if line.strip()
                and not line.rstrip().endswith(":")]
    return bool(problems) and all(any(p in line for p in forms) for line in problems)


def run_checks(checks: Sequence[TierCheck], timeout_s: float = 60.0, parallel: int | None = None,
               stop: threading.Event | None = None,
               warn: Callable[[str], None] | None = None) -> list[CheckFailure]:
    """Run every check, at most ``parallel`` at a time; return the failures in check order.

    Args:
        timeout_s: a check still running after this fails (its process is killed).
        parallel: processes at once (default: the CPU count, 2 to 8).
        stop: set (Ctrl-C) to kill the checks still running and raise.
        warn: called with ``tier replica: text`` for each :data:`WARNING_PREFIX` line
            (each distinct text once).

    Raises:
        LaminarError: ``stop`` was set, or a check's command cannot be started.
    """
    width = parallel or min(8, max(2, os.cpu_count() or 2))
    pending = list(enumerate(checks))
    running: dict[int, tuple[subprocess.Popen, object, float]] = {}
    results: dict[int, CheckFailure | None] = {}
    warned: set[str] = set()
    stop = stop or threading.Event()
    try:
        while pending or running:
            while pending and len(running) < width:
                index, check = pending.pop(0)
                out = tempfile.TemporaryFile(mode="w+")
                try:
                    proc = subprocess.Popen(list(check.argv), stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, text=True)
                except OSError as exc:
                    out.close()
                    raise LaminarError(f"tier {check.tier}: cannot run "
                                       f"{check.argv[0]!r} to check its config: {exc}") from exc
                running[index] = (proc, out, time.monotonic() + timeout_s)
            if stop.wait(0.02):
                raise LaminarError("interrupted while checking the tier configs")
            for index, (proc, out, deadline) in list(running.items()):
                code = proc.poll()
                if code is None and time.monotonic() < deadline:
                    continue
                if code is None:
                    proc.kill()
                    proc.wait()
                del running[index]
                out.seek(0)
                text = out.read()
                out.close()
                if code is None:
                    text = f"no answer within {timeout_s:g}s\n{text}"
                results[index] = None if code == 0 else CheckFailure(checks[index], code, text)
                for line in text.splitlines():
                    if warn is not None and line.startswith(WARNING_PREFIX):
                        said = line[len(WARNING_PREFIX):]
                        if said not in warned:
                            warned.add(said)
                            warn(f"{checks[index].replica}: {said}")
    finally:
        for proc, out, _ in running.values():
            proc.kill()
            proc.wait()
            out.close()
    return [f for _, f in sorted(results.items()) if f is not None]


def failures_text(failures: Sequence[CheckFailure], job_file: str = "the job file",
                  after_setup: bool = False) -> str:
    """One message for every failed check: tier, config file, job-file section, error text."""
    what = ("after the set-up; etcd and the tiers were not started" if after_setup
            else "nothing was started")
    lines = [f"{len(failures)} tier config check(s) failed ({what}):"]
    for f in failures:
        how = "no answer" if f.code is None else f"exit {f.code}"
        lines.append(f"tier {f.check.tier} ({f.check.replica}): config {f.check.config_path} "
                     f"(tiers.{f.check.tier}.config in {job_file}) rejected by "
                     f"`{f.check.shown or ' '.join(f.check.argv)}` ({how}):")
        text = f.text.strip("\n").rstrip().splitlines() or ["(no output)"]
        if len(text) > _SHOWN_LINES:
            text = [f"... ({len(text) - _SHOWN_LINES} lines before)", *text[-_SHOWN_LINES:]]
        lines.extend(f"    {line}" for line in text)
    return "\n".join(lines)


def raise_for(failures: Sequence[CheckFailure], job_file: str = "the job file",
              after_setup: bool = False) -> None:
    """Raise :class:`ConfigError` with :func:`failures_text` when there are failures."""
    if failures:
        raise ConfigError(failures_text(failures, job_file, after_setup))
