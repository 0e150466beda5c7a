"""The emulated-hosts fixture itself: separate stacks, capped links, cuts that hold and heal,
the observer's forward, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from laminar_common.testing.hosts import EmulatedHosts, start_etcd, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))

SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9000)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
SEND = """
import socket, sys
c = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[3]))
c.sendall(b"x" * int(sys.argv[2])); c.close()
"""


def _transfer(hosts, src, dst, nbytes, timeout_s=20.0):
    """Seconds host ``src`` takes to send ``nbytes`` to ``dst``, as ``dst`` measured."""
    sink = subprocess.Popen(hosts.cmd(dst, [sys.executable, "-c", SINK, hosts.address(dst)]),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "listening"
        hosts.run(src, [sys.executable, "-c", SEND, hosts.address(dst), str(nbytes),
                        str(timeout_s)])
        got, seconds = sink.stdout.readline().split()
        assert int(got) == nbytes
        return float(seconds)
    finally:
        sink.kill()
        sink.wait()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_hosts_have_their_own_stacks_capped_links_and_cuts_that_heal(tmp_path):
    with EmulatedHosts(["a", "b", "c"], rate_mbit=80) as hosts:
        assert [hosts.address(h) for h in "abc"] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        # Each host has its own stack: its address is there and in no other host.
        for h in "abc":
            addrs = hosts.run(h, ["ip", "-4", "-o", "addr"]).stdout
            assert hosts.address(h) in addrs
            assert all(hosts.address(o) not in addrs for o in "abc" if o != h)
        # The cap holds: 4 MB at 80 Mbit/s takes about 0.4 s (the bucket's burst is tiny).
        size = 4_000_000
        ideal = size * 8 / 80e6
        took = _transfer(hosts, "a", "b", size)
        assert 0.8 * ideal < took < 2.0 * ideal, (took, ideal)
        # Uncapped, the same bytes go several times faster.
        hosts.cap("a", None)
        hosts.cap("b", None)
        assert _transfer(hosts, "a", "b", size) < took / 3

        # A cut is silent (a connect times out, nothing refuses) and only between a and b.
        hosts.cut("a", ["b"])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="timed out"):
            _transfer(hosts, "a", "b", 1000, timeout_s=1.0)
        assert time.monotonic() - t0 >= 0.9
        assert _transfer(hosts, "a", "c", 1000) >= 0
        assert hosts.cuts() == {"a": {"b"}}
        hosts.heal("a")
        assert _transfer(hosts, "a", "b", 1000) >= 0
        # Cut from everything: c cannot reach a, a cannot reach b; b and c still talk.
        hosts.cut("a")
        with pytest.raises(RuntimeError, match="timed out"):
            _transfer(hosts, "c", "a", 1000, timeout_s=1.0)
        assert _transfer(hosts, "b", "c", 1000) >= 0
        hosts.heal("a")

        # The observer reaches a real etcd on host c through a forward, and the hosts reach
        # it at c's address; a cut of c does not cut the observer off.
        etcd, local = start_etcd(hosts, "c", str(tmp_path / "etcd"))
        try:
            from laminar_common.etcd import EtcdCoordinator
            coord = EtcdCoordinator([local], "hosts-test", connect_timeout_s=10)
            try:
                coord.put_state("probe", b"ok")
                hosts.cut("c")
                assert coord.get_state("probe") == b"ok"
            finally:
                coord.close()
            assert etcd.endpoint == "198.18.0.3:2379"
        finally:
            etcd.close()
        # Processes still running on a host are the caller's; close kills them.
        sleeper = subprocess.Popen(hosts.cmd("b", ["sleep", "600"]))
        names = [hosts[h].netns for h in "abc"] + [hosts.switch]
        assert all(n in _namespaces() for n in names)
    assert sleeper.wait(10) == -9
    assert not any(n in _namespaces() for n in names)
