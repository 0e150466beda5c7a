"""Running model-written Python snippets in a separate, limited process.

This module owns :class:`CodeSandbox` (run one snippet, get a
:class:`SandboxResult`) and :class:`SandboxPool` (a bounded pool of concurrent
runs). It must not import the rest of the rollout tier: a tool call's executor
uses it, nothing here knows about prompts or engines.

Invariants:

* The user's code misbehaving (crash, exception, timeout, memory or CPU limit,
  huge output, forking) always yields a :class:`SandboxResult`; only our own
  misconfiguration raises (:class:`~laminar_common.errors.ConfigError` at
  construction, :class:`SandboxError` if the sandbox itself cannot start).
* ``run`` returns only after every process the snippet started is dead: the
  whole tree is killed and reaped, whether the snippet exited or timed out.
* Output held in memory is bounded: each stream keeps ``output_bytes`` and
  counts (but drops) the rest.

How a run is built. Every run starts a small *supervisor* (``_SUPERVISOR``,
plain stdlib Python run with ``-I -S``) that forks the snippet's interpreter,
sets the rlimits in that child between ``fork`` and ``exec`` and waits for it.
Doing the ``setrlimit`` there, in a single-threaded process of our own, is why
there is no ``preexec_fn`` (unsafe in a threaded parent such as the pool) and
no dependency on util-linux ``prlimit``. The supervisor also

* enforces ``wall_s`` itself and reports ``exit <status>`` or
  ``timeout <status>`` on a private pipe, so a death by signal is told apart
  from an exit code (bubblewrap folds both into ``128 + n``);
* is a child subreaper (``PR_SET_CHILD_SUBREAPER``): orphans of the snippet,
  even ones that called ``setsid``, are re-parented to it, and it kills and
  reaps all of them before it reports;
* dies with its host-side parent (``PR_SET_PDEATHSIG``), as does the snippet.

The host side starts the supervisor in its own process group, reads stdout
and stderr with a bound, and as a backstop kills the group by pid (never by
name) ``_HOST_GRACE_S`` after ``wall_s``.

Isolation ``"bwrap"`` (bubblewrap) adds: new pid, net, ipc, uts and cgroup
namespaces (the net namespace has only its own loopback, so nothing outside is
reachable); ``--new-session`` (no TIOCSTI into our terminal); ``--die-with-parent``;
a read-only root built from ``/usr`` (plus the ``/bin``, ``/lib*`` symlinks or dirs),
the interpreter's prefix, ``extra_ro_paths`` and a few ``/etc`` files (``_ETC_FILES``;
not ``/etc/shadow``, not ``$HOME``, not the repo), ``/proc/sys`` and
``/proc/sysrq-trigger`` read-only, no ``/sys``. The only writable places are a
private ``/tmp`` (cwd) and ``/dev/shm`` tmpfs, gone when the run ends. The pid
namespace means the death of its init kills every process in it. The snippet never
holds host privileges:

* worker as root: no user namespace (its only mapping would be root onto root); the
  supervisor keeps CAP_SETUID, CAP_SETGID and CAP_KILL only, and runs the snippet as
  ``sandbox_uid`` (default ``DEFAULT_SANDBOX_UID``, no groups, no capabilities). The
  supervisor is then another uid: the snippet cannot signal, trace or open its
  ``/proc`` files, so its status pipe cannot be forged;
* worker not root: a user namespace with every capability dropped; the snippet runs
  as the worker's uid, which may signal its supervisor (a stopped supervisor ends
  the run at the host's backstop, ``wall_s`` + ``_HOST_GRACE_S``).

Both isolation modes add, where available:

* a seccomp filter (``sandbox_seccomp``: ptrace, process_vm_*, mount, namespaces,
  keyctl, bpf, perf_event_open, modules, kexec, ... refused), installed by the
  supervisor in the snippet after ``PR_SET_NO_NEW_PRIVS``; without libseccomp the
  sandbox warns once and runs without one (``CodeSandbox.seccomp``);
* a cgroup per run (``sandbox_cgroup``: v2, or v1's memory and pids hierarchies,
  where this process may make one, i.e. as root or with a delegated subtree):
  ``memory_bytes`` and ``processes`` bound the whole run (memfds, tmpfs and every
  process together; the snippet's tree is OOM-killed first), and everything still in
  it when the run ends is killed, whatever the snippet did to its supervisor
  (``CodeSandbox.whole_run_bound`` says ``cgroup`` or ``rlimit``).

Isolation ``"rlimit"`` (the fallback where bwrap is missing or cannot create
namespaces, e.g. in an unprivileged container) keeps the same rlimits, clean
environment, supervisor and tree kill, the seccomp filter and the cgroup, and runs
in a fresh temp directory that is removed afterwards; as root it runs the snippet as
``sandbox_uid`` where that uid can execute the interpreter (not one under root's
0700 home; then it runs as root and warns). It has no filesystem, network or pid
isolation and says so in a WARNING once per process; as root without the uid drop
the snippet can write host files and kernel settings.

Limits that are set but not fully enforced without a cgroup (see the tests):

* ``RLIMIT_NPROC`` counts all processes *and threads* of the real uid, host
  wide; the kernel never applies it to uid 0, so for a root snippet it is inert.
* ``RLIMIT_CPU`` and ``RLIMIT_AS`` are per process: a snippet that forks gets
  ``cpu_s`` (and ``memory_bytes``) per child; ``wall_s`` bounds the total time.
* ``tmp_bytes`` (size of the private tmpfs mounts) needs bubblewrap >= 0.10
  (``--size``); older bwrap mounts them with the kernel default (half of RAM)
  and only ``file_bytes`` bounds each file (the run's cgroup bounds them all).
* A snippet that kills its supervisor (same uid: non-root worker, or rlimit as
  root without the drop) can leave a ``setsid`` daemon behind when there is no
  cgroup; with one, the run's end kills it.
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from laminar_common.errors import ConfigError, LaminarError

from .sandbox_cgroup import RunCgroup, cgroup_layout
from .sandbox_seccomp import compile_filter, seccomp_unavailable

__all__ = [
    "CodeSandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxPoolFullError",
    "SandboxResult",
]

log = logging.getLogger(__name__)

ISOLATIONS = ("auto", "bwrap", "rlimit")
DEFAULT_SANDBOX_UID = 65533
"""The host uid (and gid) snippets run as when the worker is root: unprivileged, with no
passwd entry and no files of its own. Give it a dedicated account if 65533 is taken."""
_HOST_GRACE_S = 5.0  # supervisor startup + tree kill, before the host kills the group itself
_REAP_TIMEOUT_S = 10.0
_READ_CHUNK = 65536
_SNIPPET_IN_BWRAP = "/sandbox/snippet.py"
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/alternatives",
)
_ROOT_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# Runs as ``python -I -S -B -c _SUPERVISOR STATUS_FD WALL_S LIMITS DROP SECCOMP_FD ARGV...``;
# LIMITS is ``NAME=soft:hard,...`` of resource.RLIMIT_* names, DROP ``uid:gid`` (or ``-``)
# the snippet runs as, SECCOMP_FD an fd holding the BPF filter the snippet runs under
# (or -1). Stdlib only, single-threaded.
_SUPERVISOR = r"""
import ctypes, os, resource, signal, sys, time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
MAX_ROUNDS = 100000


class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def confine(libc, prog):
    # no_new_privs (nothing exec'd regains privileges), then the seccomp filter: the
    # last steps before exec, after the uid drop, so the supervisor is never filtered.
    if prog:
        if libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0),
                      ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        buf = ctypes.create_string_buffer(prog, len(prog))
        fprog = Fprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
        if libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog),
                      ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def set_limits(spec):
    for item in spec.split(","):
        name, values = item.split("=")
        soft, hard = (int(v) for v in values.split(":"))
        res = getattr(resource, name)
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
        resource.setrlimit(res, (min(soft, hard), hard))


def exec_snippet(libc, spec, drop, prog, argv):
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # the run's cgroup OOM-kills the snippet's tree first, never its supervisor (set
        # before the uid drop, which makes /proc/self root's; inherited by every child)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        if drop != "-":
            uid, gid = (int(x) for x in drop.split(":"))
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            if os.getuid() != uid or os.geteuid() != uid:
                raise OSError("uid drop to %d did not take" % uid)
            # the uid drop cleared PDEATHSIG: set it again
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        set_limits(spec)
        confine(libc, prog)
        os.execv(argv[0], argv)
    except BaseException as exc:
        os.write(2, ("sandbox: cannot start the snippet: %r\n" % (exc,)).encode())
    os._exit(127)


def reap_ready(pid):
    # Reap every exited child (the snippet and re-parented orphans); return the
    # snippet's wait status if it was among them.
    found = None
    for _ in range(MAX_ROUNDS):
        try:
            wpid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if wpid == 0:
            break
        if wpid == pid:
            found = status
    return found


def children():
    me = os.getpid()
    try:
        with open("/proc/self/task/%d/children" % me) as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        pass  # kernel without CONFIG_PROC_CHILDREN: scan /proc for our children instead
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited while we listed /proc
            if ppid == me:
                kids.append(int(name))
    return kids


def kill_tree(pid, status):
    for _ in range(MAX_ROUNDS):
        for kid in children():
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # died since listed; reaped below
        try:
            wpid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if wpid == pid:
            status = st
    return status


def main():
    status_fd, wall_s, spec = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    drop, seccomp_fd, argv = sys.argv[4], int(sys.argv[5]), sys.argv[6:]
    os.set_inheritable(status_fd, False)
    prog = read_all(seccomp_fd) if seccomp_fd >= 0 else b""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    deadline = time.monotonic() + wall_s
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        exec_snippet(libc, spec, drop, prog, argv)
    status, timed_out = None, False
    while status is None:
        status = reap_ready(pid)
        remaining = deadline - time.monotonic()
        if status is None and remaining <= 0:
            timed_out = True
            break
        if status is None:
            signal.sigtimedwait([signal.SIGCHLD], remaining)
    status = kill_tree(pid, status)
    os.write(status_fd, ("%s %s\n" % ("timeout" if timed_out else "exit", status)).encode())


main()
"""


class SandboxError(LaminarError):
    """The sandbox itself could not run (not the snippet failing: that is a result)."""


class SandboxPoolFullError(SandboxError):
    """A :class:`SandboxPool` refused a submission: its running and queued slots are all taken."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one snippet run.

    Attributes:
        cpu_s: RLIMIT_CPU seconds (SIGXCPU at ``cpu_s``, SIGKILL one second later).
        memory_bytes: RLIMIT_AS, address space of each process.
        file_bytes: RLIMIT_FSIZE, largest file a process may write.
        processes: RLIMIT_NPROC; counts every process and thread of the uid, and is
            not enforced by the kernel for root (see the module docstring).
        wall_s: wall-clock seconds before the whole process tree is killed.
        output_bytes: stdout and stderr are each kept up to this many bytes.
        tmp_bytes: size of the private tmpfs mounts under bwrap >= 0.10.
    """

    cpu_s: int = 5
    memory_bytes: int = 512 * 1024 * 1024
    file_bytes: int = 1024 * 1024
    processes: int = 64
    wall_s: float = 10.0
    output_bytes: int = 8 * 1024
    tmp_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in (
            "cpu_s",
            "memory_bytes",
            "file_bytes",
            "processes",
            "output_bytes",
            "tmp_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"SandboxLimits.{name} must be a positive int, got {value!r}")
        if not isinstance(self.wall_s, (int, float)) or not self.wall_s > 0:
            raise ConfigError(
                f"SandboxLimits.wall_s must be a positive number, got {self.wall_s!r}"
            )

    def rlimit_spec(self) -> str:
        """The ``NAME=soft:hard,...`` string the supervisor applies to the snippet."""
        pairs = (
            ("RLIMIT_CPU", self.cpu_s, self.cpu_s + 1),
            ("RLIMIT_AS", self.memory_bytes, self.memory_bytes),
            ("RLIMIT_FSIZE", self.file_bytes, self.file_bytes),
            ("RLIMIT_NPROC", self.processes, self.processes),
            ("RLIMIT_CORE", 0, 0),
        )
        return ",".join(f"{name}={soft}:{hard}" for name, soft, hard in pairs)


@dataclass(frozen=True)
class SandboxResult:
    """What one snippet run did.

    Attributes:
        stdout: decoded (UTF-8, invalid bytes replaced), truncated to ``output_bytes``
            plus a ``...[truncated N bytes]`` marker.
        stderr: the same for stderr.
        exit_code: the snippet's exit status, or None when a signal ended it.
        timed_out: ``wall_s`` passed and the tree was killed.
        truncated: stdout or stderr was cut.
        duration_s: wall time of the whole run, sandbox startup included.
        killed_by: name of the signal that ended the snippet ("SIGXCPU", "SIGKILL"...).
        isolation: "bwrap" or "rlimit".
        whole_run_bound: "cgroup" (memory and processes bounded for the run as a
            whole) or "rlimit" (per process only).
        memory_peak_bytes: the run's peak memory where its cgroup reports it.
        leftover_killed: processes of the run still alive after its supervisor
            ended, killed by the run's cgroup (e.g. daemons of a snippet that killed
            its supervisor).
        oom_kills: processes the run's cgroup killed for going over ``memory_bytes``.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    duration_s: float
    killed_by: str | None
    isolation: str
    whole_run_bound: str = "rlimit"
    memory_peak_bytes: int | None = None
    leftover_killed: int = 0
    oom_kills: int = 0

    @property
    def ok(self) -> bool:
        """The snippet exited by itself with status 0."""
        return self.exit_code == 0 and not self.timed_out


class _Capture:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = self.data.decode("utf-8", "replace")
        if self.dropped:
            out += f"\n...[truncated {self.dropped} bytes]"
        return out


_probe_lock = threading.Lock()
_probe_cache: dict[tuple[str, ...], str | None] = {}
_weak_warned = False


def _warn_weak_once(reason: str) -> None:
    global _weak_warned
    with _probe_lock:
        if _weak_warned:
            return
        _weak_warned = True
    log.warning(
        "code sandbox uses rlimit isolation (%s): resource limits only, NO filesystem, "
        "network or pid isolation",
        reason,
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _interpreter_prefix(python: str) -> str:
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        return os.path.realpath(sys.base_prefix)
    return os.path.dirname(os.path.dirname(python))


class CodeSandbox:
    """Runs Python snippets in a separate process under limits; thread-safe.

    Args:
        limits: resource limits of every run (defaults: :class:`SandboxLimits`).
        isolation: "bwrap" (require bubblewrap), "rlimit" (limits only) or
            "auto" (bwrap when its probe succeeds, else rlimit with a WARNING).
        python: interpreter for the snippet; default this process's base interpreter.
            Its prefix (``<prefix>/bin/python``) is bound read-only under bwrap.
        bwrap: name or path of the bubblewrap executable.
        site_packages: let the snippet import the interpreter's site-packages (and
            have ``exit()``/``quit()``); off runs it with ``-S``, stdlib only.
        extra_ro_paths: more host paths bound read-only at the same place (bwrap).
        sandbox_uid: the unprivileged host uid (and gid) snippets run as when this
            process is root; ignored otherwise (they run as this process's uid).
        seccomp: install the seccomp filter (``sandbox_seccomp``) in every snippet;
            where libseccomp is missing the sandbox runs without one and says so.
        cgroups: bound memory and processes per run with a cgroup where this process
            may make one (``sandbox_cgroup``); else rlimits only, said so.

    Raises:
        ConfigError: unknown isolation, invalid limits, a missing interpreter,
            "bwrap" without a working bubblewrap, or a trivial snippet failing
            under these limits (e.g. ``memory_bytes`` too small for Python).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: str = "auto",
        python: str | None = None,
        bwrap: str = "bwrap",
        site_packages: bool = False,
        extra_ro_paths: Sequence[str] = (),
        sandbox_uid: int = DEFAULT_SANDBOX_UID,
        seccomp: bool = True,
        cgroups: bool = True,
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ConfigError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
        self.limits = limits if limits is not None else SandboxLimits()
        self.python = os.path.realpath(python or sys.executable)
        if not (os.path.isfile(self.python) and os.access(self.python, os.X_OK)):
            raise ConfigError(f"sandbox python {self.python!r} is not an executable file")
        self._snippet_flags = ["-I", "-B", "-X", "utf8"] + ([] if site_packages else ["-S"])
        for path in extra_ro_paths:
            if not os.path.exists(path):
                raise ConfigError(f"sandbox extra_ro_paths entry {path!r} does not exist")
        prefix = _interpreter_prefix(self.python)
        ro_paths = [prefix, *extra_ro_paths]
        if not self.python.startswith(prefix.rstrip("/") + "/"):
            ro_paths.append(os.path.dirname(self.python))  # e.g. a venv made with --copies
        self._ro_paths = [os.path.realpath(p) for p in ro_paths if not _under_usr(p)]
        if not isinstance(sandbox_uid, int) or not 0 < sandbox_uid < 2**32 - 1:
            raise ConfigError(f"sandbox_uid must be an unprivileged uid (> 0), got {sandbox_uid!r}")
        self._privileged = os.geteuid() == 0
        self.run_uid = sandbox_uid if self._privileged else os.geteuid()
        """The host uid snippets run as."""
        self._seccomp_prog = b""
        self.seccomp = False
        """Whether snippets run under the seccomp filter."""
        if seccomp:
            why = seccomp_unavailable()
            if why is None:
                self._seccomp_prog = compile_filter()
                self.seccomp = True
            else:
                _warn_once("no-seccomp", "code sandbox runs WITHOUT a seccomp filter: %s", why)
        self._cgroup_layout = cgroup_layout() if cgroups else None
        self.whole_run_bound = "cgroup" if self._cgroup_layout else "rlimit"
        """How memory and process count are bounded: per run (``cgroup``: every process
        of the run together, shared memory included) or per process (``rlimit``)."""
        if cgroups and self._cgroup_layout is None:
            _warn_once("no-cgroup", "code sandbox: no cgroup this process may make, so memory "
                       "and process limits hold per process (rlimits), not per run")
        self._bwrap = shutil.which(bwrap)
        self._bwrap_head: list[str] = []
        self._bwrap_tail: list[str] = []
        self._fallback_reason = "requested"
        self.isolation = self._choose(isolation, bwrap)
        if self.isolation == "rlimit":
            _warn_weak_once(self._fallback_reason)
        self._drop = self._drop_for_isolation()
        self._self_check()

    def _choose(self, isolation: str, bwrap: str) -> str:
        if isolation == "rlimit":
            return "rlimit"
        if self._bwrap is None:
            if isolation == "bwrap":
                raise ConfigError(
                    f"sandbox isolation='bwrap' but the bubblewrap executable {bwrap!r} is not on "
                    "PATH; install the 'bubblewrap' package or use isolation='auto' or 'rlimit'"
                )
            self._fallback_reason = f"bubblewrap {bwrap!r} is not on PATH"
            return "rlimit"
        self._bwrap_head, self._bwrap_tail = _bwrap_args(self._bwrap, self._ro_paths, self.limits,
                                                         privileged=self._privileged)
        argv = [*self._bwrap_head, *self._bwrap_tail, self.python, "-I", "-S", "-c", "pass"]
        error = _probe(tuple(argv))
        if error is None:
            return "bwrap"
        if isolation == "bwrap":
            raise ConfigError(f"sandbox isolation='bwrap' but bubblewrap cannot run here: {error}")
        self._fallback_reason = f"bubblewrap cannot run here: {error}"
        return "rlimit"

    def _drop_for_isolation(self) -> str:
        """The supervisor's DROP argument: ``uid:gid`` where this process is root.

        Under bwrap the interpreter is bound into a tree the sandbox uid can walk. Under
        rlimit the snippet sees the host's tree, so the drop holds only where that uid
        can run the interpreter; where it cannot (a Python under root's 0700 home), the
        snippet keeps root's uid, which rlimit isolation documents and warns about.
        """
        if not self._privileged:
            return "-"
        drop = f"{self.run_uid}:{self.run_uid}"
        if self.isolation == "rlimit" and not _reachable_by(self.python, self.run_uid):
            _warn_once("rlimit-root", "code sandbox (rlimit isolation, run as root): uid %d "
                       "cannot run %s, so snippets run as root; install bubblewrap or put "
                       "the interpreter where that uid can run it", self.run_uid, self.python)
            self.run_uid = 0
            return "-"
        return drop

    def _self_check(self) -> None:
        key = (
            "self-check",
            self.isolation,
            self._drop,
            str(self.seccomp),
            str(self.whole_run_bound),
            *self._bwrap_head,
            self.python,
            *self._snippet_flags,
            *self._ro_paths,
            repr(self.limits),
        )
        with _probe_lock:
            if key in _probe_cache:
                error = _probe_cache[key]
            else:
                result = self.run("pass")
                error = (
                    None
                    if result.ok
                    else f"exit {result.exit_code}, {result.killed_by}: {result.stderr[-2000:]}"
                )
                _probe_cache[key] = error
        if error is not None:
            raise ConfigError(f"sandbox cannot run a trivial snippet under {self.limits}: {error}")

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run ``code`` as ``__main__`` with ``stdin`` on its standard input.

        Never raises for what the code does; raises :class:`SandboxError` only when
        the sandbox process itself cannot be started.
        """
        workdir = tempfile.mkdtemp(prefix="laminar-sandbox-")
        try:
            snippet = os.path.join(workdir, "snippet.py")
            with open(snippet, "wb") as f:
                f.write(code.encode("utf-8", "surrogatepass"))
            if self._drop != "-":  # the sandbox uid reads the snippet, nothing else here
                os.chmod(workdir, 0o711)
                os.chmod(snippet, 0o644)
            if self.isolation == "bwrap":
                argv = [
                    *self._bwrap_head,
                    "--ro-bind",
                    snippet,
                    _SNIPPET_IN_BWRAP,
                    *self._bwrap_tail,
                ]
                snippet_path, cwd = _SNIPPET_IN_BWRAP, workdir
                env = {"PATH": _SANDBOX_PATH, "LANG": "C.UTF-8"}
            else:
                cwd = os.path.join(workdir, "work")
                os.mkdir(cwd, 0o700)
                if self._drop != "-":
                    os.chown(cwd, self.run_uid, self.run_uid)
                argv, snippet_path = [], snippet
                env = _sandbox_env(home=cwd)
            return self._execute(
                argv, snippet_path, cwd, env, stdin.encode("utf-8", "surrogatepass")
            )
        finally:
            _remove_tree(workdir)

    def _execute(
        self, prefix: list[str], snippet: str, cwd: str, env: dict[str, str], stdin: bytes
    ) -> SandboxResult:
        cgroup = self._run_cgroup()
        status_r, status_w = os.pipe()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        bpf_fd = _bpf_fd(self._seccomp_prog) if self._seccomp_prog else -1
        argv = self._supervised(prefix, snippet, status_w, bpf_fd)
        if cgroup is not None:
            argv = cgroup.enter(argv)
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(status_w,) + ((bpf_fd,) if bpf_fd >= 0 else ()),
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            for fd in (status_r, in_w, out_r, err_r):
                os.close(fd)
            if cgroup is not None:
                cgroup.remove()
            raise SandboxError(f"cannot start the sandbox ({argv[0]}): {exc}") from exc
        finally:
            for fd in (status_w, in_r, out_w, err_w) + ((bpf_fd,) if bpf_fd >= 0 else ()):
                os.close(fd)
        out, err, status = (
            _Capture(self.limits.output_bytes),
            _Capture(self.limits.output_bytes),
            _Capture(4096),
        )
        try:
            backstop = _pump(
                {out_r: out, err_r: err, status_r: status},
                in_w,
                stdin,
                started + self.limits.wall_s + _HOST_GRACE_S,
            )
        finally:
            # The leader is not reaped yet, so its pid still names our group.
            _kill_group(proc.pid)
            try:
                proc.wait(timeout=_REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                self._end_cgroup(cgroup)
                raise SandboxError(f"sandbox process {proc.pid} survived SIGKILL") from exc
            # what is left of the run outlived its supervisor and group (setsid daemons)
            leftover, peak, oom = self._end_cgroup(cgroup)
        duration = time.monotonic() - started
        exit_code, killed_by, timed_out = self._outcome(status.data.decode(), proc, backstop, err)
        if leftover:
            log.warning("sandbox run left %d process(es) behind its supervisor; killed them "
                        "through its cgroup", leftover)
        return SandboxResult(
            stdout=out.text(), stderr=err.text(), exit_code=exit_code, timed_out=timed_out,
            truncated=bool(out.dropped or err.dropped), duration_s=duration,
            killed_by=killed_by, isolation=self.isolation,
            whole_run_bound=self.whole_run_bound, memory_peak_bytes=peak,
            leftover_killed=leftover, oom_kills=oom)

    def _supervised(self, prefix: list[str], snippet: str, status_w: int,
                    bpf_fd: int) -> list[str]:
        """The command line: the isolation ``prefix``, then the supervisor (``-I -S -B``:
        isolated, no site, no bytecode), which applies the limits, drops privileges,
        installs the seccomp filter from ``bpf_fd`` and runs ``snippet``, reporting on
        ``status_w``."""
        return [*prefix, self.python, "-I", "-S", "-B", "-c", _SUPERVISOR, str(status_w),
                repr(float(self.limits.wall_s)), self.limits.rlimit_spec(), self._drop,
                str(bpf_fd), self.python, *self._snippet_flags, snippet]

    def _run_cgroup(self) -> RunCgroup | None:
        if self._cgroup_layout is None:
            return None
        try:
            return RunCgroup(self._cgroup_layout, self.limits.memory_bytes,
                             self.limits.processes)
        except OSError as exc:
            raise SandboxError(f"cannot make the run's cgroup: {exc}") from exc

    @staticmethod
    def _end_cgroup(cgroup: RunCgroup | None) -> tuple[int, int | None, int]:
        """Kill whatever of the run is still alive, remove its cgroup: (killed, peak
        memory, OOM kills)."""
        if cgroup is None:
            return 0, None, 0
        try:
            peak, oom = cgroup.peak_memory_bytes(), cgroup.oom_kills()
            return cgroup.kill_all(), peak, oom
        except RuntimeError as exc:
            raise SandboxError(str(exc)) from exc
        finally:
            cgroup.remove()

    def _outcome(
        self, line: str, proc: subprocess.Popen, backstop: bool, err: _Capture
    ) -> tuple[int | None, str | None, bool]:
        words = line.split()
        if len(words) == 2 and words[0] in ("exit", "timeout") and words[1].isdigit():
            raw = int(words[1])
            timed_out = words[0] == "timeout"
            if os.WIFSIGNALED(raw):
                return None, _signal_name(os.WTERMSIG(raw)), timed_out
            return os.waitstatus_to_exitcode(raw), None, timed_out
        if backstop:
            return None, "SIGKILL", True
        log.warning(
            "sandbox supervisor ended (status %s) without reporting the snippet's status; stderr: %s",
            proc.returncode,
            err.text()[-500:],
        )
        killed_by = _signal_name(-proc.returncode) if proc.returncode < 0 else None
        return None, killed_by, False


def _bpf_fd(prog: bytes) -> int:
    """A memfd holding ``prog``, positioned at its start, for the supervisor to read."""
    fd = os.memfd_create("laminar-sandbox-seccomp")
    os.write(fd, prog)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _reachable_by(path: str, uid: int) -> bool:
    """Whether ``uid`` (with no groups) may execute ``path``: every directory above it
    searchable and the file executable by "other" or by that uid as owner."""
    real = os.path.realpath(path)
    parts = real.split("/")
    for i in range(1, len(parts)):
        target = "/".join(parts[: i + 1]) or "/"
        try:
            st = os.stat(target)
        except OSError:
            return False
        bits = (st.st_mode >> 6) & 0o7 if st.st_uid == uid else st.st_mode & 0o7
        if not bits & 0o1:  # search (directories) or execute (the file)
            return False
    return True


_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    with _probe_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


def _under_usr(path: str) -> bool:
    real = os.path.realpath(path)
    return real == "/usr" or real.startswith("/usr/")


def _sandbox_env(home: str) -> dict[str, str]:
    # MALLOC_ARENA_MAX: glibc reserves 64 MiB of address space per thread arena,
    # which would make threads fail early under RLIMIT_AS.
    return {
        "PATH": _SANDBOX_PATH,
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MALLOC_ARENA_MAX": "2",
    }


@functools.cache
def _bwrap_supports_size(bwrap: str) -> bool:
    """Whether this bubblewrap has ``--size`` (0.10+) to bound a tmpfs."""
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("cannot read %s --help, assuming no --size: %s", bwrap, exc)
        return False
    return "--size" in done.stdout + done.stderr


def _bwrap_args(
    bwrap: str, ro_paths: Sequence[str], limits: SandboxLimits, *, privileged: bool
) -> tuple[list[str], list[str]]:
    """The bwrap argv up to where the per-run binds go, and after them (to ``--``).

    ``privileged`` (this process is root): no user namespace, whose only mapping would
    be the sandbox's root onto the host's root; the supervisor keeps CAP_SETUID and
    CAP_SETGID (to run the snippet as the unprivileged sandbox uid) and CAP_KILL (to
    kill that uid's processes at the run's end), nothing else. Otherwise a
    user namespace (``--unshare-all``) with every capability dropped.
    """
    if privileged:
        head = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session",
                "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                "--cap-add", "CAP_KILL"]
    else:
        head = [bwrap, "--unshare-all", "--die-with-parent", "--new-session",
                "--cap-drop", "ALL"]
    head += ["--hostname", "sandbox"]
    for top in _ROOT_DIRS:
        if os.path.islink(top):
            head += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            head += ["--ro-bind", top, top]
    for path in _ETC_FILES:
        head += ["--ro-bind-try", path, path]
    made: set[str] = set()
    for path in ro_paths:
        # bwrap would make the directories above a bind with their source's modes
        # (root's home is 0700): make them 0755 so the sandbox uid can walk to it
        parts = path.rstrip("/").split("/")
        for i in range(2, len(parts)):
            parent = "/".join(parts[:i])
            if parent not in made and not _under_usr(parent):
                made.add(parent)
                head += ["--perms", "0755", "--dir", parent]
        head += ["--ro-bind", path, path]
    size = ["--size", str(limits.tmp_bytes)] if _bwrap_supports_size(bwrap) else []
    head += [
        *size,
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--dev",
        "/dev",
        *size,
        "--perms",
        "1777",
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--proc",
        "/proc",
        # kernel settings stay read-only whatever uid the snippet has
        "--ro-bind",
        "/proc/sys",
        "/proc/sys",
        "--ro-bind-try",
        "/proc/sysrq-trigger",
        "/proc/sysrq-trigger",
        "--perms",
        "0755",
        "--dir",
        os.path.dirname(_SNIPPET_IN_BWRAP),
    ]
    tail = ["--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
    for key, value in _sandbox_env(home="/tmp").items():
        tail += ["--setenv", key, value]
    return head, [*tail, "--"]


def _probe(argv: tuple[str, ...]) -> str | None:
    """Run ``argv`` once per process (cached); None if it exited 0, else why not."""
    with _probe_lock:
        if argv in _probe_cache:
            return _probe_cache[argv]
        try:
            done = subprocess.run(
                list(argv),
                capture_output=True,
                text=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
                cwd="/",
            )
            error = (
                None
                if done.returncode == 0
                else f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = f"{type(exc).__name__}: {exc}"
        _probe_cache[argv] = error
        return error


def _pump(captures: dict[int, _Capture], in_fd: int, stdin: bytes, deadline: float) -> bool:
    """Feed stdin and drain the pipes until all close or ``deadline``; True if it passed.

    Closes every fd it was given.
    """
    sel = selectors.DefaultSelector()
    try:
        for fd in captures:
            sel.register(fd, selectors.EVENT_READ)
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            os.close(in_fd)
        while len(sel.get_map()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == in_fd:
                    try:
                        pending = pending[os.write(fd, pending[:_READ_CHUNK]) :]
                    except BrokenPipeError:
                        pending = pending[:0]  # the snippet closed stdin or exited unread
                    if not pending:
                        sel.unregister(fd)
                        os.close(fd)
                    continue
                chunk = os.read(fd, _READ_CHUNK)
                if chunk:
                    captures[fd].feed(chunk)
                else:
                    sel.unregister(fd)
                    os.close(fd)
        return False
    finally:
        for key in list(sel.get_map().values()):
            os.close(key.fd)
        sel.close()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        log.debug("sandbox process group %d already gone", pgid)


def _remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
    except OSError as exc:
        log.warning("could not remove sandbox directory %s: %s", path, exc)


class SandboxPool:
    """Runs snippets on ``size`` threads, each run its own sandboxed process.

    At most ``size`` runs execute at once and ``max_queued`` more wait; a
    submission beyond that is refused with :class:`SandboxPoolFullError` instead
    of queueing without bound.

    Args:
        sandbox: the :class:`CodeSandbox` every run uses.
        size: concurrent runs.
        max_queued: submissions allowed to wait for a free worker.
    """

    def __init__(self, sandbox: CodeSandbox, size: int = 4, max_queued: int = 16) -> None:
        if size < 1 or max_queued < 0:
            raise ConfigError(
                f"SandboxPool needs size >= 1 and max_queued >= 0, got {size}, {max_queued}"
            )
        self.sandbox = sandbox
        self.size = size
        self.max_queued = max_queued
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="laminar-sandbox")
        self._lock = threading.Lock()
        self._outstanding = 0
        self._closed = False

    @property
    def outstanding(self) -> int:
        """Submitted runs that have not finished (running plus queued)."""
        with self._lock:
            return self._outstanding

    def submit(self, code: str, stdin: str = "") -> Future[SandboxResult]:
        """Queue one run; its future resolves to a :class:`SandboxResult`.

        Raises:
            SandboxPoolFullError: ``size + max_queued`` runs are already outstanding.
            SandboxError: the pool is closed.
        """
        with self._lock:
            if self._closed:
                raise SandboxError("SandboxPool is closed")
            if self._outstanding >= self.size + self.max_queued:
                raise SandboxPoolFullError(
                    f"SandboxPool is full: {self.size} running and {self.max_queued} queued"
                )
            self._outstanding += 1
        try:
            future = self._executor.submit(self.sandbox.run, code, stdin)
        except RuntimeError as exc:
            self._release(None)
            raise SandboxError("SandboxPool is closed") from exc
        future.add_done_callback(self._release)
        return future

    def _release(self, _future: Future[SandboxResult] | None) -> None:
        with self._lock:
            self._outstanding -= 1

    def close(self, wait: bool = True) -> None:
        """Refuse new work, cancel queued runs, and (``wait``) let running ones finish.

        Running ones end within ``wall_s`` plus a few seconds of grace.
        """
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
