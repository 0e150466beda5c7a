"""The code sandbox against a hostile model: one test per class of attack, both isolation
modes, run as this process's user (root in CI) and, in the last test, as an
unprivileged user.

What each mode guarantees (the sandbox's README section says the same):

- bwrap, any caller: the snippet runs as an unprivileged uid with no capabilities
  (as root: the sandbox uid, no user namespace; otherwise: the caller's uid in a
  user namespace), ``/proc/sys`` read-only, a seccomp filter (ptrace,
  process_vm_*, mount, namespaces, keyctl, bpf, perf_event_open, modules, kexec),
  no network, a private read-only tree; when run as root its supervisor is
  another uid, out of its reach.
- rlimit: resource limits, the seccomp filter, and (as root, where the sandbox uid
  can run the interpreter) the uid drop; no filesystem, network or pid isolation.
- both, where a cgroup can be made (root here): memory and processes bounded for the
  whole run, and every process of the run killed at its end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from test_sandbox import BWRAP, needs_bwrap

from laminar_rollout.sandbox import CodeSandbox, SandboxLimits

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(params=[pytest.param("bwrap", marks=needs_bwrap), "rlimit"])
def sandbox(request):
    return CodeSandbox(SandboxLimits(wall_s=8, cpu_s=4), isolation=request.param)


def _confined(sandbox: CodeSandbox) -> bool:
    """Whether this sandbox promises that the snippet holds no host privileges."""
    return sandbox.isolation == "bwrap" or sandbox.run_uid != 0


def _run(sandbox: CodeSandbox, code: str):
    return sandbox.run(textwrap.dedent(code))


# -- kernel settings ------------------------------------------------------------------


def test_kernel_settings_cannot_be_changed(sandbox):
    # Each write puts back the value already there: nothing changes even where it works.
    out = _run(sandbox, """
        import os
        print(os.getuid())
        for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/vm/swappiness",
                     "/proc/sysrq-trigger"):
            try:
                value = open(path).read() if "sysrq" not in path else ""
                with open(path, "w") as fh:
                    fh.write(value)
                print(path, "WRITTEN")
            except OSError as exc:
                print(path, "refused", exc.errno)
        """)
    lines = out.stdout.splitlines()
    assert out.exit_code == 0, out
    if _confined(sandbox):
        assert int(lines[0]) != 0
        assert all("refused" in line for line in lines[1:]), lines
    else:  # rlimit as root with an interpreter the sandbox uid cannot reach: documented
        assert int(lines[0]) == 0 and sandbox.run_uid == 0


def test_the_snippet_holds_no_capabilities_under_bwrap():
    if not BWRAP:
        pytest.skip("bubblewrap missing")
    sb = CodeSandbox(isolation="bwrap")
    out = sb.run("print([l.split()[1] for l in open('/proc/self/status') "
                 "if l.startswith(('CapEff', 'CapPrm', 'NoNewPrivs', 'Seccomp:'))])")
    cap_eff, cap_prm, no_new_privs, seccomp = eval(out.stdout)  # noqa: S307 - our own output
    assert int(cap_eff, 16) == 0 and int(cap_prm, 16) == 0
    if sb.seccomp:
        assert no_new_privs == "1" and seccomp == "2"


# -- secrets, network, writes ------------------------------------------------------------


def test_secrets_of_the_worker_are_not_visible(sandbox, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("LAMINAR_TEST_SECRET", secret)
    out = _run(sandbox, f"""
        import os
        print("env", "LAMINAR_TEST_SECRET" in os.environ)
        try:
            print("worker-environ", {secret!r} in open("/proc/{os.getpid()}/environ").read())
        except OSError as exc:
            print("worker-environ refused", exc.errno)
        try:
            open("/etc/shadow").read()
            print("shadow READ")
        except OSError as exc:
            print("shadow refused", exc.errno)
        """)
    lines = out.stdout.splitlines()
    assert lines[0] == "env False"
    if _confined(sandbox):
        assert lines[1] != "worker-environ True" and lines[2].startswith("shadow refused")


@needs_bwrap
def test_no_network_and_no_writes_outside_tmp_under_bwrap():
    out = CodeSandbox(isolation="bwrap").run(textwrap.dedent("""
        import socket
        s = socket.socket()
        s.settimeout(1)
        try:
            s.connect(("198.18.0.1", 80)); print("CONNECTED")
        except OSError as exc:
            print("net refused", exc.errno)
        for path in ("/etc/x", "/usr/x", "/sandbox/x", "/proc/x"):
            try:
                open(path, "w").write("x"); print(path, "WRITTEN")
            except OSError as exc:
                print(path, "refused")
        open("/tmp/ok", "w").write("x"); print("tmp ok")
        """))
    lines = out.stdout.splitlines()
    assert lines[0].startswith("net refused")
    assert all(line.endswith("refused") for line in lines[1:5]) and lines[5] == "tmp ok"


# -- resources -----------------------------------------------------------------------


def test_memory_is_bounded_for_the_whole_run_memfds_included(sandbox):
    limits = sandbox.limits
    out = _run(sandbox, """
        import os
        held = []
        for i in range(700):  # 700 memfds of 1 MiB: each under RLIMIT_FSIZE and RLIMIT_AS
            fd = os.memfd_create("m%d" % i)
            os.write(fd, b"x" * (1 << 20))
            held.append(fd)
        print("HELD", len(held))
        """)
    if sandbox.whole_run_bound == "cgroup":
        assert "HELD" not in out.stdout and out.killed_by == "SIGKILL", out
        assert out.oom_kills >= 1 and out.exit_code is None, out
        assert out.memory_peak_bytes is not None
        assert out.memory_peak_bytes <= limits.memory_bytes + (1 << 20)
    else:  # per-process rlimits only: documented weaker bound
        assert sandbox.whole_run_bound == "rlimit"


def test_a_fork_bomb_is_bounded(sandbox):
    if sandbox.run_uid == 0 and sandbox.whole_run_bound != "cgroup":
        pytest.skip("root without a cgroup: RLIMIT_NPROC is inert for uid 0 (documented)")
    out = _run(sandbox, """
        import os, time
        n = 0
        try:
            for _ in range(400):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as exc:
            print("fork refused after", n, exc.errno)
        print("forked", n)
        """)
    last = out.stdout.splitlines()[-1]
    assert int(last.split()[1]) < sandbox.limits.processes or out.timed_out, out


# -- signals and supervisor tampering ---------------------------------------------------


def test_the_supervisor_cannot_be_traced_stopped_or_forged(sandbox):
    out = _run(sandbox, """
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        sup = os.getppid()
        print("ptrace", libc.ptrace(16, sup, 0, 0), ctypes.get_errno(), flush=True)
        try:
            fds = os.listdir("/proc/%d/fd" % sup)
            forged = 0
            for fd in fds:
                try:
                    with open("/proc/%d/fd/%s" % (sup, fd), "w") as fh:
                        fh.write("exit 0\\n")
                    forged += 1
                except OSError:
                    pass
            print("forged", forged, flush=True)
        except OSError as exc:
            print("fds refused", exc.errno, flush=True)
        try:
            os.kill(sup, signal.SIGSTOP)
            print("STOPPED", flush=True)
        except OSError as exc:
            print("stop refused", exc.errno, flush=True)
        raise SystemExit(3)
        """)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ptrace -1") if sandbox.seccomp else True
    if sandbox.run_uid != 0 and os.geteuid() == 0:  # the supervisor is another uid
        assert lines[1] in ("fds refused 13", "forged 0"), lines
        assert lines[2].startswith("stop refused"), lines
        assert out.exit_code == 3 and not out.timed_out  # the real status, in time
    assert out.duration_s < sandbox.limits.wall_s + 6  # never past the host backstop


def test_nothing_outlives_the_run_even_if_the_supervisor_is_killed(sandbox):
    token = f"100.{uuid.uuid4().int % 10**12:012d}"
    out = _run(sandbox, f"""
        import os, signal, subprocess
        subprocess.Popen(["sleep", "{token}"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            os.kill(os.getppid(), signal.SIGKILL)
        except OSError as exc:
            print("kill refused", exc.errno)
        print("done", flush=True)
        """)
    assert out.duration_s < sandbox.limits.wall_s + 6
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, token)]
    assert alive == [], (alive, out)


def _cmdline_has(pid: str, token: str) -> bool:
    try:
        return token.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


# -- the same attacks from an unprivileged worker -------------------------------------------


_AS_USER = r"""
import json, os, sys
from laminar_rollout.sandbox import CodeSandbox, SandboxLimits
out = {}
for isolation in sys.argv[1:]:
    sb = CodeSandbox(SandboxLimits(wall_s=8), isolation=isolation)
    r = sb.run('''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
res = {"uid": os.getuid()}
try:
    open("/proc/sys/vm/swappiness", "w").write(open("/proc/sys/vm/swappiness").read())
    res["sys"] = "written"
except OSError as exc:
    res["sys"] = exc.errno
res["ptrace"] = [libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno()]
print(repr(res))
''')
    out[isolation] = {"stdout": r.stdout, "stderr": r.stderr[-400:], "seccomp": sb.seccomp,
                      "uid": sb.run_uid, "bound": sb.whole_run_bound}
print(json.dumps(out))
"""


def test_the_attacks_fail_as_an_unprivileged_user_too(tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to become an unprivileged user")
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python for the unprivileged user")
    libs = tmp_path / "libs"
    libs.mkdir()
    import pyseccomp  # copied next to the sources: the test env's site-packages is root's

    shutil.copy(pyseccomp.__file__, libs / "pyseccomp.py")
    sources = [REPO / "packages" / "laminar-common" / "src",
               REPO / "packages" / "laminar-rollout" / "src"]
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "test", "-r", str(sources[1] / "laminar_rollout" / "sandbox.py")])
    if probe.returncode != 0:
        pytest.skip(f"the checkout at {REPO} is not readable by an unprivileged user")
    os.chmod(tmp_path, 0o755)
    modes = ["rlimit"] + (["bwrap"] if BWRAP else [])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(map(str, [*sources, libs])),
           "HOME": str(tmp_path)}
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           python, "-c", _AS_USER, *modes], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for mode, r in results.items():
        res = eval(r["stdout"])  # noqa: S307 - our own repr
        assert res["uid"] == 65534 and r["uid"] == 65534, (mode, r)
        assert res["sys"] != "written", (mode, r)
        if r["seccomp"]:
            assert res["ptrace"][0] == -1, (mode, r)


if __name__ == "__main__":  # pragma: no cover - run by hand: python test_sandbox_attacks.py
    sys.exit(pytest.main([__file__, "-q"]))
