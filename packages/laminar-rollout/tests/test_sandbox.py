import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from laminar_common.errors import ConfigError, LaminarError
from laminar_rollout import sandbox as sandbox_module
from laminar_rollout.sandbox import (
    CodeSandbox,
    SandboxError,
    SandboxLimits,
    SandboxPool,
    SandboxPoolFullError,
)

REPO = Path(__file__).resolve().parents[3]


def _bwrap_works() -> bool:
    """bubblewrap present and able to create namespaces on this machine (not our args)."""
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(
        ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


BWRAP = _bwrap_works()
needs_bwrap = pytest.mark.skipif(not BWRAP, reason="bubblewrap missing or cannot create namespaces")
BOTH = [pytest.param("bwrap", marks=needs_bwrap), "rlimit"]


@pytest.fixture(params=BOTH)
def isolation(request):
    return request.param


def _sandbox(isolation, **limits):
    return CodeSandbox(SandboxLimits(**limits), isolation=isolation)


def _token() -> str:
    """A unique, valid ``sleep`` argument to find a process by in /proc."""
    return f"100.{uuid.uuid4().int % 10**12:012d}"


def _pids_with(token: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we listed /proc
        if token.encode() in cmdline.split(b"\0"):
            pids.append(int(name))
    return pids


def _is_running(pid: int, marker: bytes) -> bool:
    """``pid`` is alive and still the process whose cmdline holds ``marker`` (not a reuse)."""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait_for_pids(token, future, deadline_s=20.0):
    """Poll /proc until a process with ``token`` shows up; fail if the run ended first."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not future.done():
        pids = _pids_with(token)
        if pids:
            return pids
        threading.Event().wait(0.01)
    pytest.fail(f"no process with {token} appeared while the run was live")


# -- basics -----------------------------------------------------------------------


def test_prints_exit_codes_and_exceptions(isolation):
    sandbox = _sandbox(isolation)
    assert sandbox.isolation == isolation

    result = sandbox.run("print('hello'); print('warn', file=__import__('sys').stderr)")
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "warn\n", 0)
    assert result.ok and not result.timed_out and not result.truncated
    assert result.killed_by is None and result.isolation == isolation

    assert sandbox.run("raise SystemExit(3)").exit_code == 3

    crashed = sandbox.run("x = 1\n1 / 0\n")
    assert crashed.exit_code == 1 and crashed.killed_by is None
    assert "ZeroDivisionError" in crashed.stderr and "line 2" in crashed.stderr

    # A null byte in the source is the code's problem (a SyntaxError), not ours.
    assert sandbox.run("print('a\0b')").exit_code == 1


def test_runs_leak_no_file_descriptors(isolation):
    sandbox = _sandbox(isolation)
    sandbox.run("pass")
    before = len(os.listdir("/proc/self/fd"))
    for code in ("print(1)", "1 / 0", "print('x' * 100_000)", "import os; os.close(1)"):
        sandbox.run(code, stdin="data")
    assert len(os.listdir("/proc/self/fd")) == before


def test_stdin_is_delivered_and_unread_stdin_does_not_block(isolation):
    sandbox = _sandbox(isolation)
    assert (
        sandbox.run("import sys; print(sys.stdin.read().upper())", stdin="héllo").stdout
        == "HÉLLO\n"
    )
    # Far more than a pipe buffer, never read: the run must still end normally.
    result = sandbox.run("print('done')", stdin="x" * (4 << 20))
    assert result.stdout == "done\n" and result.exit_code == 0 and not result.timed_out


def test_site_packages_flag_controls_site_import(isolation):
    assert "NameError" in _sandbox(isolation).run("exit(4)").stderr  # -S: no site builtins
    with_site = CodeSandbox(SandboxLimits(), isolation=isolation, site_packages=True)
    assert with_site.run("exit(4)").exit_code == 4


@needs_bwrap
def test_bwrap_environment_is_clean_and_unprivileged():
    code = (
        "import os, socket\n"
        "print(sorted(os.environ))\n"
        "print(os.environ['HOME'], os.getcwd(), socket.gethostname())\n"
        "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])\n"
        "print(os.path.exists('/work'), os.path.exists('/etc/shadow'), os.getpid())\n"
    )
    lines = _sandbox("bwrap").run(code).stdout.splitlines()
    assert "LAMINAR" not in lines[0] and "VIRTUAL_ENV" not in lines[0]
    assert lines[1] == "/tmp /tmp sandbox"
    assert int(lines[2], 16) == 0  # no capabilities
    exists_work, exists_shadow, pid = lines[3].split()
    assert (exists_work, exists_shadow) == ("False", "False")
    assert int(pid) < 10  # its own pid namespace


# -- network ----------------------------------------------------------------------


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    with server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # reachable from here
        yield port


_CONNECT = (
    "import socket\n"
    "try:\n"
    "    socket.create_connection(('127.0.0.1', {port}), timeout=3).close()\n"
    "    print('connected')\n"
    "except OSError as exc:\n"
    "    print('blocked', type(exc).__name__)\n"
    "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
)


@needs_bwrap
def test_bwrap_has_no_network(listener):
    result = _sandbox("bwrap").run(_CONNECT.format(port=listener))
    first, interfaces = result.stdout.splitlines()
    assert first.startswith("blocked"), result.stdout
    assert interfaces == "['lo']"  # a private loopback only


def test_rlimit_fallback_does_not_isolate_the_network(listener):
    """The known weakness of the fallback: the host's loopback is reachable."""
    result = _sandbox("rlimit").run(_CONNECT.format(port=listener))
    assert result.stdout.splitlines()[0] == "connected"


# -- time, memory, output ------------------------------------------------------------


def test_cpu_limit_kills_a_busy_loop_before_the_wall_clock(isolation):
    result = _sandbox(isolation, cpu_s=1, wall_s=60).run("while True: pass")
    assert result.killed_by in ("SIGXCPU", "SIGKILL") and result.exit_code is None
    assert not result.timed_out and result.duration_s < 60


def test_wall_clock_limit_kills_a_sleeper(isolation):
    result = _sandbox(isolation, wall_s=1).run(
        "import time\nprint('up', flush=True)\ntime.sleep(100)"
    )
    assert result.timed_out and result.killed_by == "SIGKILL" and result.exit_code is None
    assert result.stdout == "up\n"  # output before the kill is kept
    assert 1 <= result.duration_s < 1 + sandbox_module._HOST_GRACE_S


def test_memory_limit_gives_memory_error(isolation):
    result = _sandbox(isolation, memory_bytes=256 << 20).run("b = bytearray(1 << 30)")
    assert result.exit_code not in (0, None) and "MemoryError" in result.stderr


def test_output_is_truncated_with_a_marker(isolation):
    sandbox = _sandbox(isolation, output_bytes=8192)
    result = sandbox.run("import sys\nprint('x' * 1_000_000)\nsys.stderr.write('e' * 9000)")
    assert result.truncated and result.exit_code == 0
    assert result.stdout == "x" * 8192 + f"\n...[truncated {1_000_001 - 8192} bytes]"
    assert result.stderr == "e" * 8192 + f"\n...[truncated {9000 - 8192} bytes]"

    flood = _sandbox(isolation, wall_s=1).run("while True: print('y' * 10_000)")
    assert flood.timed_out and flood.truncated and len(flood.stdout) < 8192 + 100


# -- files ------------------------------------------------------------------------


@needs_bwrap
def test_bwrap_tmp_is_private_and_gone_afterwards():
    sandbox = _sandbox("bwrap")
    name = f"laminar-sandbox-test-{uuid.uuid4().hex}"
    wrote = sandbox.run(f"open('/tmp/{name}', 'w').write('hi'); print(open('/tmp/{name}').read())")
    assert wrote.stdout == "hi\n" and wrote.exit_code == 0
    assert not Path("/tmp", name).exists()
    assert sandbox.run(f"import os; print(os.path.exists('/tmp/{name}'))").stdout == "False\n"


def test_rlimit_workdir_is_fresh_and_removed():
    sandbox = _sandbox("rlimit")
    result = sandbox.run(
        "import os; open('x', 'w').write('hi'); print(os.getcwd(), os.listdir('.'))"
    )
    cwd, listing = result.stdout.split(" ", 1)
    assert listing.strip() == "['x']" and cwd != os.getcwd()
    assert not Path(cwd).exists()


@needs_bwrap
def test_bwrap_cannot_write_outside_tmp():
    name = f"laminar-sandbox-test-{uuid.uuid4().hex}"
    targets = [
        f"/{name}",
        f"/etc/{name}",
        f"/usr/{name}",
        str(Path.home() / name),
        str(REPO / name),
    ]
    code = (
        "import errno\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print(errno.errorcode[exc.errno])\n"
    )
    try:
        lines = _sandbox("bwrap").run(code).stdout.splitlines()
        assert len(lines) == len(targets)
        assert all(line in ("EROFS", "EACCES", "ENOENT") for line in lines), lines
    finally:
        leaked = [t for t in targets if Path(t).exists()]
        for path in leaked:
            Path(path).unlink()
    assert leaked == []


def test_file_size_limit(isolation):
    result = _sandbox(isolation, file_bytes=1 << 20).run(
        "import os, tempfile\n"
        "with open(os.path.join(tempfile.gettempdir(), 'big'), 'wb') as f:\n"
        "    f.write(b'x' * (10 << 20))\n"
    )
    assert result.exit_code != 0
    assert os.strerror(errno.EFBIG) in result.stderr or result.killed_by == "SIGXFSZ"


def test_nproc_is_set_and_holds_unless_the_snippet_is_root_without_a_cgroup(isolation):
    """RLIMIT_NPROC: the kernel exempts uid 0, so it holds only for a snippet that is not
    root (the sandbox uid when the worker is root); a run's cgroup (pids.max) holds for
    any uid."""
    code = (
        "import os, resource, subprocess\n"
        "print(resource.getrlimit(resource.RLIMIT_NPROC)[0], os.getuid())\n"
        "kids = []\n"
        "try:\n"
        "    for _ in range(12):\n"
        "        kids.append(subprocess.Popen(['sleep', '30']))\n"
        "except OSError as exc:\n"
        "    print('refused', type(exc).__name__)\n"
        "print('spawned', len(kids))\n"
    )
    sandbox = _sandbox(isolation, processes=4)
    lines = sandbox.run(code).stdout.splitlines()
    limit, uid = lines[0].split()
    assert limit == "4"
    if int(uid) == 0 and sandbox.whole_run_bound != "cgroup":
        assert lines[-1] == "spawned 12"
    else:
        assert lines[-2].startswith("refused") and lines[-1] != "spawned 12"


# -- no process left behind --------------------------------------------------------


_BACKGROUND = (
    "import signal, subprocess, time\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1}})\n"
    "subprocess.Popen(['sleep', '{token}'], start_new_session={setsid})\n"
    "print('started', flush=True)\n"
    "{wait}\n"
    "print('released')\n"
)


@pytest.mark.parametrize("setsid", [False, True], ids=["same-group", "setsid"])
def test_background_children_die_when_the_snippet_exits(isolation, setsid):
    token = _token()
    code = _BACKGROUND.format(
        token=token, setsid=setsid, wait="signal.sigtimedwait({signal.SIGUSR1}, 30)"
    )
    with ThreadPoolExecutor(1) as runner:
        future = runner.submit(_sandbox(isolation, wall_s=40).run, code)
        (sleep_pid,) = _wait_for_pids(token, future)
        main_pid = _ppid(sleep_pid)
        assert _is_running(main_pid, b"snippet.py")
        os.kill(main_pid, signal.SIGUSR1)  # let the snippet exit normally
        result = future.result(timeout=60)
    assert result.stdout == "started\nreleased\n" and result.exit_code == 0 and not result.timed_out
    assert not _is_running(sleep_pid, token.encode()) and not _is_running(main_pid, b"snippet.py")
    assert _pids_with(token) == []


def test_everything_dies_on_timeout(isolation):
    token = _token()
    code = _BACKGROUND.format(token=token, setsid=True, wait="time.sleep(100)")
    with ThreadPoolExecutor(1) as runner:
        future = runner.submit(_sandbox(isolation, wall_s=4).run, code)
        (sleep_pid,) = _wait_for_pids(token, future)
        main_pid = _ppid(sleep_pid)
        result = future.result(timeout=60)
    assert result.timed_out and result.killed_by == "SIGKILL"
    assert not _is_running(sleep_pid, token.encode()) and not _is_running(main_pid, b"snippet.py")
    assert _pids_with(token) == []


# -- pool -------------------------------------------------------------------------


def test_pool_runs_snippets_concurrently(isolation):
    code = "import time\nprint(time.time())\ntime.sleep(1.5)\nprint(time.time())"
    with SandboxPool(_sandbox(isolation), size=2) as pool:
        futures = [pool.submit(code) for _ in range(2)]
        spans = [[float(x) for x in f.result(timeout=60).stdout.split()] for f in futures]
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # the runs overlapped
    assert pool.outstanding == 0


def test_pool_refuses_beyond_its_bound_and_after_close():
    pool = SandboxPool(_sandbox("rlimit", wall_s=1), size=2, max_queued=1)
    futures = [pool.submit("import time; time.sleep(100)") for _ in range(3)]
    with pytest.raises(SandboxPoolFullError, match="full"):
        pool.submit("print(1)")
    assert pool.outstanding == 3
    pool.close()
    assert all(f.done() for f in futures)
    assert all(f.result().timed_out for f in futures if not f.cancelled())
    assert pool.outstanding == 0
    with pytest.raises(SandboxError, match="closed"):
        pool.submit("print(1)")


def test_pool_validates_its_size():
    with pytest.raises(ConfigError):
        SandboxPool(_sandbox("rlimit"), size=0)


# -- configuration ----------------------------------------------------------------


def test_bwrap_required_but_missing_is_a_config_error():
    with pytest.raises(ConfigError, match="bubblewrap"):
        CodeSandbox(isolation="bwrap", bwrap="laminar-no-such-bwrap")


def test_auto_falls_back_to_rlimit_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module, "_weak_warned", False)
    with caplog.at_level(logging.WARNING, logger="laminar_rollout.sandbox"):
        first = CodeSandbox(isolation="auto", bwrap="laminar-no-such-bwrap")
        second = CodeSandbox(isolation="rlimit")
    assert first.isolation == second.isolation == "rlimit"
    warnings = [r for r in caplog.records if "NO filesystem" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert first.run("print(2)").stdout == "2\n"


@needs_bwrap
def test_auto_prefers_bwrap():
    assert CodeSandbox(isolation="auto").isolation == "bwrap"


@pytest.mark.parametrize(
    "make",
    [
        lambda: CodeSandbox(isolation="docker"),
        lambda: SandboxLimits(cpu_s=0),
        lambda: SandboxLimits(wall_s=-1),
        lambda: SandboxLimits(memory_bytes=True),
        lambda: CodeSandbox(python="/nonexistent/python3"),
        lambda: CodeSandbox(extra_ro_paths=["/nonexistent/data"]),
        lambda: CodeSandbox(SandboxLimits(memory_bytes=1 << 20), isolation="rlimit"),
    ],
    ids=["isolation", "cpu", "wall", "bool", "python", "ro-path", "too-little-memory"],
)
def test_misconfiguration_raises_config_error(make):
    with pytest.raises(ConfigError):
        make()


def test_errors_are_laminar_errors():
    assert issubclass(SandboxPoolFullError, SandboxError) and issubclass(SandboxError, LaminarError)
