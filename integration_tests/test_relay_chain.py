"""Issue 3 acceptance: the relay tier on real etcd with separate relay processes.

Each test starts its own relays (``python -m laminar_relay.cli serve``) in its
own job on one shared etcd, with a 2 s lease TTL so failures are noticed fast.
Only the pids started here are ever signalled.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

import pytest

from laminar_common.errors import LaminarError
from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.local_etcd import LocalEtcd
from laminar_common.launch.processes import ChildProcess
from laminar_common.relay.client import RelayClient
from laminar_common.relay.wire import MASTER_ELECTION, RELAY_ROLE, VersionNotFoundError

# One pytest-xdist worker runs this file's tests (the "relay_chain" group): they share a
# module fixture.
pytestmark = pytest.mark.xdist_group("relay_chain")

TTL = 2
SIZE = 4 * 1024 * 1024 + 321
_jobs = itertools.count()


def tensors_for(version: int):
    """Content that differs per version (and per byte position)."""
    block = bytes((version * 31 + i) % 256 for i in range(4096))
    big = (block * (SIZE // len(block) + 1))[:SIZE]
    return [("model.w", "uint8", (SIZE,), big), ("model.b", "float32", (4,), bytes([version]) * 16)]


def deadline_wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = cond()
        except LaminarError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def relay_etcd():
    server = LocalEtcd().start()
    yield server
    server.close()


class RelayCluster:
    """Relay processes of one job, plus a coordinator and client that watch them."""

    def __init__(self, etcd: LocalEtcd, log_dir, *extra: str) -> None:
        self.job = f"relay-it-{next(_jobs)}"
        self.etcd = etcd
        self.log_dir = log_dir
        self.extra = extra
        self.procs: dict[str, ChildProcess] = {}
        self.coord = EtcdCoordinator([etcd.endpoint], self.job, ttl_s=TTL)
        self.client = RelayClient(
            self.coord, rpc_timeout_s=5.0, publish_timeout_s=60.0, failover_wait_s=2 * TTL + 1
        )

    def start(self, member_id: str) -> ChildProcess:
        args = [
            "serve",
            "--set",
            f"job={self.job}",
            "--set",
            f"member_id={member_id}",
            "--set",
            "bind_host=127.0.0.1",
            "--set",
            "advertise_host=127.0.0.1",
            "--set",
            f"etcd.endpoints=[{self.etcd.endpoint}]",
            "--set",
            f"etcd.ttl_s={TTL}",
            "--set",
            "store.max_bytes=134217728",
            "--set",
            "chain.control_interval_s=0.3",
            "--set",
            "chain.commit_timeout_s=10",
            "--set",
            "data.send_timeout_s=3",
            *self.extra,
        ]
        proc = ChildProcess(
            member_id,
            [sys.executable, "-m", "laminar_relay.cli", *args],
            str(self.log_dir / f"{self.job}-{member_id}.log"),
        )
        self.procs[member_id] = proc
        return proc

    def wait_chain(self, members: list[str], timeout_s: float = 30.0) -> list[str]:
        """Wait until exactly ``members`` are live and every one agrees on the chain."""

        def agreed():
            if sorted(self.coord.members(RELAY_ROLE)) != sorted(members):
                return None
            if self.coord.leader(MASTER_ELECTION) not in members:
                return None
            chains = {tuple(self.client.health(m).chain) for m in members}
            if len(chains) != 1:
                return None
            chain = list(chains.pop())
            return chain if sorted(chain) == sorted(members) else None

        return deadline_wait(agreed, timeout_s, f"chain of {members} in job {self.job}")

    def wait_version(self, version: int, members: list[str], timeout_s: float = 30.0) -> None:
        deadline_wait(
            lambda: all(version in self.client.health(m).versions for m in members),
            timeout_s,
            f"version {version} on {members}",
        )

    def assert_identical(self, version: int, members: list[str]) -> None:
        expected = tensors_for(version)
        streamed = RelayClient(self.coord, use_shared_memory=False)
        try:
            for member in members:
                for client, source in ((self.client, "shm"), (streamed, "stream")):
                    with client.fetch(version, relay=member, verify=True) as fetched:
                        assert fetched.source == source
                        tensors = fetched.tensors()
                        assert bytes(tensors["model.w"]) == expected[0][3], (member, source)
                        assert bytes(tensors["model.b"]) == expected[1][3], (member, source)
        finally:
            streamed.close()

    def close(self) -> None:
        self.client.close()
        self.coord.close()
        for proc in self.procs.values():
            proc.stop(grace_s=5)


@pytest.fixture
def cluster(relay_etcd, tmp_path):
    clusters: list[RelayCluster] = []

    def make(*extra: str) -> RelayCluster:
        c = RelayCluster(relay_etcd, tmp_path, *extra)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.close()


def test_a_version_reaches_four_chained_relays_byte_identical(cluster):
    c = cluster()
    names = ["r0", "r1", "r2", "r3"]
    for name in names:
        c.start(name)
    chain = c.wait_chain(names)
    assert chain[0] == c.coord.leader(MASTER_ELECTION)
    result = c.client.publish(1, tensors_for(1), trainer_step=100)
    assert result.master_id == chain[0]
    latest = c.coord.latest_version()
    assert (latest.version, latest.trainer_step, latest.master_id) == (1, 100, chain[0])
    c.wait_version(1, names)
    c.assert_identical(1, names)
    for name in names:
        assert c.client.health(name).rejected == {}


def test_readers_never_see_a_partial_version(cluster):
    c = cluster()
    names = ["a", "b", "c"]
    for name in names:
        c.start(name)
    c.wait_chain(names)
    problems: list[str] = []
    seen: dict[str, list[int]] = {name: [] for name in names}
    done = threading.Event()

    def reader(member: str) -> None:
        client = RelayClient(c.coord, client_id=f"reader-{member}")
        try:
            while not done.is_set():
                try:
                    with client.fetch(relay=member, wait_s=0.0, verify=True) as fetched:
                        want = tensors_for(fetched.version)[0][3]
                        if bytes(fetched.tensors()["model.w"]) != want:
                            problems.append(f"{member}: version {fetched.version} differs")
                        seen[member].append(fetched.version)
                except VersionNotFoundError:
                    pass  # nothing visible yet (or the newest is still arriving here)
        finally:
            client.close()

    threads = [threading.Thread(target=reader, args=(n,)) for n in names]
    for t in threads:
        t.start()
    try:
        for version in range(1, 6):
            c.client.publish(version, tensors_for(version))
        c.wait_version(5, names)
        deadline_wait(
            lambda: all(s and s[-1] == 5 for s in seen.values()),
            20,
            "every reader to see version 5",
        )
    finally:
        done.set()
        for t in threads:
            t.join(30)
    assert not problems
    for member, versions in seen.items():
        assert versions == sorted(versions), f"reader of {member} went back in time"


def test_sigkill_of_a_middle_relay_mid_broadcast_then_next_version_reaches_all_live(cluster):
    # Forwarding paced at 4 MB/s: a 4 MB version spends about a second on each link.
    c = cluster("--set", "chain.max_forward_bytes_per_s=4194304")
    names = ["m0", "m1", "m2", "m3"]
    for name in names:
        c.start(name)
    chain = c.wait_chain(names)
    victim = chain[1]
    c.client.publish(1, tensors_for(1))
    deadline_wait(
        lambda: 1 in c.client.health(victim).receiving, 10, f"version 1 to be arriving on {victim}"
    )
    c.procs[victim].kill()
    live = [n for n in chain if n != victim]
    assert c.wait_chain(live) == live
    c.client.publish(2, tensors_for(2))
    c.wait_version(2, live)
    c.assert_identical(2, live)


def test_sigkill_of_the_master_elects_another_and_the_next_publish_succeeds(cluster):
    c = cluster()
    names = ["k0", "k1", "k2"]
    for name in names:
        c.start(name)
    chain = c.wait_chain(names)
    master = chain[0]
    c.client.publish(1, tensors_for(1))
    c.wait_version(1, names)
    c.procs[master].kill()
    t0 = time.monotonic()
    result = c.client.publish(2, tensors_for(2))
    assert result.master_id != master
    assert time.monotonic() - t0 < 6 * TTL
    assert c.coord.latest_version().version == 2
    live = [n for n in names if n != master]
    assert c.wait_chain(live)[0] == result.master_id
    c.wait_version(2, live)
    c.assert_identical(2, live)


def test_a_paused_master_is_left_behind_then_rejoins_the_chain(cluster):
    """SIGSTOP of the master past its lease (a pause, not a death): the next publish
    moves to the newly elected master without waiting for the old one to wake; once
    it wakes it registers again, is taken back into the chain, and gets new versions."""
    import os
    import signal

    c = cluster()
    names = ["s0", "s1", "s2"]
    for name in names:
        c.start(name)
    master = c.wait_chain(names)[0]
    c.client.publish(1, tensors_for(1))
    c.wait_version(1, names)
    os.kill(c.procs[master].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        result = c.client.publish(2, tensors_for(2))
        took = time.monotonic() - t0
        print(f"publish with the master paused took {took:.2f}s (TTL {TTL}s)")
        assert result.master_id != master
        # Lease expiry (TTL) + election, not the client's 5 s rpc timeout on the paused one.
        assert took < 2 * TTL + 0.5, "the publish waited for the paused master"
        live = [n for n in names if n != master]
        c.wait_version(2, live)
    finally:
        os.kill(c.procs[master].pid, signal.SIGCONT)
    # Healed: the old master is a chain member again and receives the next version.
    c.wait_chain(names, timeout_s=30)
    c.client.publish(3, tensors_for(3))
    c.wait_version(3, names)
    c.assert_identical(3, names)


# -- delta versions (issue 17) ---------------------------------------------------------


def _model(version: int):
    """bf16 weights (as their bits) where each version changes 1% of the elements."""
    import numpy as np

    rng = np.random.default_rng(0)
    w = rng.standard_normal(1 << 20).astype(np.float32).view(np.uint32) >> 16
    w = w.astype(np.uint16)
    b = rng.standard_normal(64).astype(np.float32)
    for v in range(2, version + 1):
        step = np.random.default_rng(v)
        idx = step.choice(w.size, w.size // 100, replace=False)
        w[idx] += 1
        b[v % 64] += 0.5
    return [("model.w", "bfloat16", (w.size,), w), ("model.b", "float32", (64,), b)]


def _flat(version: int) -> bytes:
    from laminar_common.relay.manifests import build_manifest, flatten

    m, buffers = build_manifest(version, _model(version))
    return bytes(flatten(m, buffers))


def test_delta_versions_rebuild_bit_exact_for_every_kind_of_reader(cluster):
    """Deltas travel the chain like full versions. A reader one version behind takes
    one delta; several behind, the deltas in between; a new reader, the full version
    and the deltas after it; every result is checked against the full version's
    checksums and equals the trainer's published bytes. A restarted relay is caught up
    with the newest full version and its deltas."""
    c = cluster()
    names = ["d0", "d1", "d2"]
    for name in names:
        c.start(name)
    c.wait_chain(names)
    pub = RelayClient(c.coord, client_id="trainer", delta_full_every=4)
    readers = []

    def reader(name: str) -> RelayClient:
        readers.append(RelayClient(c.coord, client_id=name, use_shared_memory=False))
        return readers[-1]

    try:
        sent = {v: pub.publish(v, _model(v)) for v in (1, 2, 3, 4)}
        full_bytes = sent[1].manifest.total_bytes
        assert sent[1].manifest.full is None
        for v in (2, 3, 4):  # deltas against the version before, about 2% of the bytes
            m = sent[v].manifest
            assert (m.base_version, m.full.version) == (v - 1, v), m
            assert sent[v].total_bytes < 0.05 * full_bytes, (v, sent[v].total_bytes)
        c.wait_version(4, names)

        one, several, new = reader("one-behind"), reader("several-behind"), reader("new")
        with one.fetch(3, relay="d2") as have3:
            assert have3.source == "delta" and bytes(have3.buffer) == _flat(3)
            got = one.fetch(4, relay="d2", base=have3)
        assert (got.source, got.version, got.wire_bytes) == ("delta", 4, sent[4].total_bytes)
        assert bytes(got.buffer) == _flat(4)
        have2 = several.fetch(2, relay="d1")
        got = several.fetch(4, relay="d1", base=have2)
        assert got.wire_bytes == sent[3].total_bytes + sent[4].total_bytes
        assert bytes(got.buffer) == _flat(4)
        got = new.fetch(relay="d2")
        assert got.version == 4 and bytes(got.buffer) == _flat(4)
        assert got.wire_bytes == full_bytes + sum(sent[v].total_bytes for v in (2, 3, 4))

        # Version 5 is full again (every 4th), 6 a delta; retention keeps 5 and 6.
        sent[5], sent[6] = pub.publish(5, _model(5)), pub.publish(6, _model(6))
        assert sent[5].manifest.full is None and sent[6].manifest.base_version == 5
        c.wait_version(6, names)
        deadline_wait(lambda: all(c.client.health(n).versions == (5, 6) for n in names),
                      10, "retention to keep versions 5 and 6 only")
        got = new.fetch(base=got)  # 4 is no base for 6: full 5 + delta 6
        assert got.wire_bytes == full_bytes + sent[6].total_bytes
        assert bytes(got.buffer) == _flat(6)

        # A relay restarted at the same id is offered the newest full version and its delta.
        # (Not the master: a new master would hold no base, and version 7 below must go
        # as a delta; whichever relay won the election holds the master role.)
        victim = next(n for n in reversed(names) if n != sent[6].master_id)
        c.procs[victim].kill()
        c.wait_chain([n for n in names if n != victim])
        c.start(victim)
        c.wait_chain(names)
        c.wait_version(6, [victim])
        assert 5 in c.client.health(victim).versions
        with reader("after-restart").fetch(relay=victim) as got:
            assert bytes(got.buffer) == _flat(6)

        # A delta taken against the wrong base (the publisher's copy of version 6 holds
        # other bytes: here already version 7's, so the delta is empty) is refused by
        # every reader: the rebuilt bytes fail the full version's checksums.
        pub._delta_base.flat[:] = _flat(7)
        sent[7] = pub.publish(7, _model(7))
        assert sent[7].master_id == sent[6].master_id
        assert sent[7].manifest.base_version == 6
        c.wait_version(7, names)
        with pytest.raises(LaminarError, match=r"delta version 7 over base 6 does not rebuild"):
            reader("refuses").fetch(7, relay="d1")
    finally:
        pub.close()
        for r in readers:
            r.close()


def test_a_master_restarted_at_the_same_id_gets_a_full_version_next(cluster):
    """The master relay restarts empty under the same member id and is elected again:
    the publisher's next version goes in full, since a delta against a base the master
    no longer holds would leave its readers with nothing to rebuild from."""
    c = cluster()
    c.start("solo")
    c.wait_chain(["solo"])
    pub = RelayClient(c.coord, client_id="trainer", delta_full_every=10)
    try:
        assert pub.publish(1, _model(1)).manifest.full is None
        assert pub.publish(2, _model(2)).manifest.base_version == 1
        c.procs["solo"].kill()
        deadline_wait(lambda: not c.coord.members(RELAY_ROLE), 5 * TTL, "the lease to expire")
        c.start("solo")
        c.wait_chain(["solo"])
        third = pub.publish(3, _model(3))
        assert third.manifest.full is None, "a delta went to a master without its base"
        assert pub.publish(4, _model(4)).manifest.base_version == 3
        with RelayClient(c.coord, client_id="reader", use_shared_memory=False) as reader:
            with reader.fetch(4) as got:
                assert got.source == "delta" and bytes(got.buffer) == _flat(4)
    finally:
        pub.close()
