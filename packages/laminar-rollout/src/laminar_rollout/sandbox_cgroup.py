"""One cgroup per sandbox run: memory and process count bounded for the whole run.

rlimits bound each process (``RLIMIT_AS`` per address space, so one process held
600 MiB in memfds against 512 MiB; ``RLIMIT_NPROC`` per uid, inert for root). A
per-run cgroup bounds the run as a whole, shared memory, memfds and tmpfs pages
included (they are charged to the memory cgroup of the process that touched
them), and lists every process of the run, so that the run's end kills all of
them, whatever the snippet did to its supervisor (a ``setsid`` daemon included).

Two layouts, whichever the host lets this process write:

- cgroup v2 (``/sys/fs/cgroup`` is ``cgroup2``): ``laminar-sandbox/run-*`` under the
  root with ``memory.max``, ``memory.swap.max`` 0 and ``pids.max`` (needs root or a
  delegated subtree writable here);
- cgroup v1: ``laminar-sandbox/run-*`` in the ``memory`` and ``pids`` hierarchies
  (``memory.limit_in_bytes``, ``pids.max``).

Where neither is writable (an unprivileged worker without delegation) there is no
whole-run bound; the sandbox says so (``CodeSandbox.whole_run_bound``).

A process enters its run's cgroup before the sandbox starts (:meth:`RunCgroup.enter`
prefixes the command with a shell that writes its own pid, then ``exec``s), so
nothing of the run is ever outside it. This module imports nothing of the tier.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import time
import uuid

__all__ = ["RunCgroup", "cgroup_layout"]

log = logging.getLogger(__name__)

_ROOT = "/sys/fs/cgroup"
_PARENT = "laminar-sandbox"
_KILL_ROUNDS = 200


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _v2_parent() -> str | None:
    if not os.path.isfile(os.path.join(_ROOT, "cgroup.controllers")):
        return None
    parent = os.path.join(_ROOT, _PARENT)
    try:
        os.makedirs(parent, exist_ok=True)
        with open(os.path.join(_ROOT, "cgroup.subtree_control"), "w") as fh:
            fh.write("+memory +pids")
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as fh:
            fh.write("+memory +pids")
    except OSError as exc:
        log.debug("no cgroup v2 subtree for sandbox runs: %s", exc)
        return None
    return parent


def _v1_parents() -> dict[str, str] | None:
    parents = {}
    for controller in ("memory", "pids"):
        base = os.path.join(_ROOT, controller)
        if not _writable_dir(base):
            return None
        parent = os.path.join(base, _PARENT)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            log.debug("no cgroup v1 %s hierarchy for sandbox runs: %s", controller, exc)
            return None
        parents[controller] = parent
    return parents


def cgroup_layout() -> tuple[str, dict[str, str]] | None:
    """``("v2", {"unified": parent})`` or ``("v1", {"memory": ..., "pids": ...})``: where
    per-run cgroups can be made here; None where this process cannot make them."""
    parent = _v2_parent()
    if parent is not None:
        return "v2", {"unified": parent}
    parents = _v1_parents()
    if parents is not None:
        return "v1", parents
    return None


class RunCgroup:
    """The cgroup(s) of one run: made with its limits, entered by the run's first
    process, emptied (every process SIGKILLed) and removed at its end."""

    def __init__(self, layout: tuple[str, dict[str, str]], memory_bytes: int,
                 processes: int) -> None:
        self.version, parents = layout
        name = f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.dirs = {key: os.path.join(parent, name) for key, parent in parents.items()}
        for path in self.dirs.values():
            os.mkdir(path)
        try:
            if self.version == "v2":
                path = self.dirs["unified"]
                self._write(path, "memory.max", memory_bytes)
                self._write(path, "memory.swap.max", 0, optional=True)
                self._write(path, "pids.max", processes)
            else:
                self._write(self.dirs["memory"], "memory.limit_in_bytes", memory_bytes)
                self._write(self.dirs["memory"], "memory.memsw.limit_in_bytes", memory_bytes,
                            optional=True)
                self._write(self.dirs["pids"], "pids.max", processes)
        except OSError:
            self.remove()
            raise

    @staticmethod
    def _write(path: str, name: str, value: int, optional: bool = False) -> None:
        try:
            with open(os.path.join(path, name), "w") as fh:
                fh.write(str(value))
        except OSError:
            if not optional:
                raise

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first moves itself into this cgroup (and fails
        with status 125 if it cannot), then ``exec``s it."""
        writes = " && ".join(f"echo $$ > {shlex.quote(os.path.join(d, 'cgroup.procs'))}"
                             for d in self.dirs.values())
        return ["/bin/sh", "-c", f'{writes} || exit 125; exec "$@"', "laminar-sandbox", *argv]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in self.dirs.values():
            try:
                with open(os.path.join(path, "cgroup.procs")) as fh:
                    out.update(int(p) for p in fh.read().split())
            except FileNotFoundError:
                continue
        return sorted(out)

    def peak_memory_bytes(self) -> int | None:
        """Most memory the run held at once (None where the kernel does not say)."""
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        path = os.path.join(self.dirs["unified" if self.version == "v2" else "memory"], name)
        try:
            with open(path) as fh:
                return int(fh.read().strip())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the kernel killed in this cgroup for going over its memory limit."""
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        path = os.path.join(self.dirs["unified" if self.version == "v2" else "memory"], name)
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass  # a kernel that does not count them (before 4.13)
        return 0

    def kill_all(self, grace_s: float = 0.25) -> int:
        """SIGKILL every process in the run until none is left; how many were alive
        ``grace_s`` after the call (processes already dying, such as a killed sandbox's
        namespace init, get that long to go by themselves and are not counted).

        Raises:
            RuntimeError: processes were still there after every round (they are
                being created faster than killed, or stuck in the kernel).
        """
        deadline = time.monotonic() + grace_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = 0
        for _ in range(_KILL_ROUNDS):
            pids = self.pids()
            if not pids:
                return killed
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass  # died since listed
            time.sleep(0.005)
        raise RuntimeError(f"sandbox cgroup {self.dirs} still holds {self.pids()} after "
                           f"{_KILL_ROUNDS} rounds of SIGKILL")

    def remove(self) -> None:
        """Remove the (empty) cgroup directories; one that is still busy is logged."""
        for path in self.dirs.values():
            for _ in range(100):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: killed processes not yet gone
                    time.sleep(0.01)
            else:
                log.warning("sandbox cgroup %s could not be removed", path)
