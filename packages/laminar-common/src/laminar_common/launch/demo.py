"""``laminar demo``: the shared core end to end, with real processes and etcd.

Starts a local etcd and N probe members (separate processes), watches them
join, SIGKILLs one and times how long until its record vanishes (lease
expiry), restarts etcd under the survivors and times their re-registration,
then shuts everything down. Prints what it saw; exit code 0 when every
expectation held.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time

from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.local_etcd import LocalEtcd
from laminar_common.launch.processes import ChildProcess
from laminar_common.membership import MembershipEvent

__all__ = ["run_demo"]


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def run_demo(n_members: int = 3, ttl_s: int = 3, job: str = "demo") -> int:
    workdir = tempfile.mkdtemp(prefix="laminar-demo-")
    ok = True
    with LocalEtcd() as etcd:
        print(f"[demo] etcd {etcd.endpoint}, logs in {workdir}")
        watcher = EtcdCoordinator([etcd.endpoint], job, ttl_s=ttl_s)
        live: set[str] = set()
        lock = threading.Lock()

        def on_event(ev: MembershipEvent) -> None:
            with lock:
                (live.add if ev.kind == "put" else live.discard)(ev.member_id)
            print(f"[demo] {time.strftime('%H:%M:%S')} {ev.kind:<6} {ev.role}/{ev.member_id}")

        watcher.watch_members(on_event)
        members = []
        for i in range(n_members):
            cmd = [sys.executable, "-m", "laminar_common.launch.cli", "member",
                   "--set", f"job={job}", "--set", f"member_id=probe-{i}",
                   "--set", f"etcd.endpoints=[{etcd.endpoint}]", "--set", f"etcd.ttl_s={ttl_s}"]
            members.append(ChildProcess(f"probe-{i}", cmd, f"{workdir}/probe-{i}.log"))
        try:
            for m in members:
                m.wait_for_line("REGISTERED", 30)
            ok &= _wait(lambda: len(live) == n_members, 10)
            print(f"[demo] {len(live)} members registered")

            victim = members[0]
            t0 = time.monotonic()
            victim.kill()
            gone = _wait(lambda: "probe-0" not in live, 2 * ttl_s + 2)
            print(f"[demo] SIGKILLed probe-0: record vanished after {time.monotonic() - t0:.2f}s "
                  f"(TTL {ttl_s}s) -> {'ok' if gone else 'FAILED'}")
            ok &= gone

            t0 = time.monotonic()
            etcd.stop()
            time.sleep(1.0)
            etcd.start()
            survivors = {f"probe-{i}" for i in range(1, n_members)}
            back = _wait(lambda: survivors <= set(watcher.members()), 30)
            alive = all(m.alive() for m in members[1:])
            print(f"[demo] restarted etcd: survivors registered again after "
                  f"{time.monotonic() - t0:.2f}s, none exited: {alive} -> "
                  f"{'ok' if back and alive else 'FAILED'}")
            ok &= back and alive
        finally:
            for m in members:
                m.stop()
            watcher.close()
    print(f"[demo] {'all expectations held' if ok else 'SOME EXPECTATIONS FAILED'}")
    return 0 if ok else 1
