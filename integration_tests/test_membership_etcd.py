"""Issue 2 acceptance: membership on real etcd with real member processes."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from conftest import wait_until
from laminar_common import codec
from laminar_common.errors import CoordinationError
from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.local_etcd import LocalEtcd
from laminar_common.membership import MemberRecord, VersionRecord
from laminar_common.testing import check_election_fencing
from laminar_common.transport import ZmqPushSender

TTL = 2


def _member_args(etcd, member_id, *extra):
    return ("member", "--set", "job=itest", "--set", f"member_id={member_id}",
            "--set", f"etcd.endpoints=[{etcd.endpoint}]", "--set", f"etcd.ttl_s={TTL}", *extra)


def test_sigkilled_member_vanishes_within_two_ttl(etcd, spawn):
    watcher = EtcdCoordinator([etcd.endpoint], "itest", ttl_s=TTL)
    gone = threading.Event()
    joined = threading.Event()

    def on_event(ev):
        if ev.member_id == "victim":
            (joined if ev.kind == "put" else gone).set()

    watcher.watch_members(on_event)
    victim = spawn("victim", "laminar_common.launch.cli", *_member_args(etcd, "victim"))
    victim.wait_for_line("REGISTERED", 30)
    assert joined.wait(10)
    t0 = time.monotonic()
    victim.kill()
    assert gone.wait(2 * TTL + 1), "record of the SIGKILLed member did not vanish"
    assert time.monotonic() - t0 <= 2 * TTL
    assert "victim" not in watcher.members()
    watcher.close()


def test_member_survives_etcd_restart_and_wipe(etcd, spawn):
    member = spawn("survivor", "laminar_common.launch.cli", *_member_args(etcd, "survivor"))
    member.wait_for_line("REGISTERED", 30)
    watcher = EtcdCoordinator([etcd.endpoint], "itest", ttl_s=TTL)
    assert "survivor" in watcher.members()

    etcd.stop()
    time.sleep(0.5)
    etcd.start()
    assert wait_until(lambda: "survivor" in watcher.members(), 20)

    # A wiped etcd (new data dir, same port): the lease is gone, the member must re-register.
    etcd.stop(kill=True)
    shutil.rmtree(etcd.data_dir + "/data")
    etcd.start()
    assert wait_until(lambda: "survivor" in watcher.members(), 20), "member did not re-register"
    assert member.alive(), "member exited during the etcd outage"
    member.wait_for_line("re-registering", 5)
    watcher.close()


def test_member_with_other_protocol_version_is_refused(etcd, spawn):
    ok = spawn("current", "laminar_common.launch.cli", *_member_args(etcd, "current"))
    ok.wait_for_line("REGISTERED", 30)
    old = spawn("old", "laminar_common.launch.cli",
                *_member_args(etcd, "old", "--set", f"protocol_version={codec.PROTOCOL_VERSION + 1}"))
    old.wait_for_line(r"error: .*speaks protocol version", 30)
    assert old.proc.wait(10) == 2
    watcher = EtcdCoordinator([etcd.endpoint], "itest", ttl_s=TTL)
    assert "old" not in watcher.members()
    watcher.close()


def test_member_sink_rejects_bad_frames_and_counts_them(etcd, spawn):
    member = spawn("sink", "laminar_common.launch.cli", *_member_args(etcd, "sink"))
    endpoint = member.wait_for_line(r"REGISTERED sink (\S+)", 30).group(1)
    sender = ZmqPushSender(endpoint)
    other_version = bytearray(codec.encode(codec.Refused(reason="x")))
    other_version[5] = 77
    for frame in (b"", b"garbage", codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + b"\xff\xff", bytes(other_version),
                  codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + b"\x00" * (70 * 1024 * 1024)):
        sender.send_frame(frame)
    sender.send(codec.Ack(trajectory_ids=("t",), trainer_step=1, trainer_version=1))
    line = member.wait_for_line(r"SINK received=1 kind=Ack rejected=(.*)", 60).group(1)
    assert line == "{'malformed': 3, 'oversized': 1, 'version': 1}"
    assert member.alive()
    sender.close()


def test_weights_latest_is_monotonic_compare_and_swap(etcd):
    a = EtcdCoordinator([etcd.endpoint], "cas", ttl_s=TTL)
    b = EtcdCoordinator([etcd.endpoint], "cas", ttl_s=TTL)
    seen = []
    b.watch_latest(lambda rec: seen.append(rec.version))
    a.publish_version(VersionRecord(version=1))
    b.publish_version(VersionRecord(version=2))
    with pytest.raises(CoordinationError, match="not newer"):
        a.publish_version(VersionRecord(version=2))
    assert b.latest_version().version == 2
    assert wait_until(lambda: seen == [1, 2], 10), seen
    a.close()
    b.close()


def test_election_fails_over_when_owner_lease_ends(etcd):
    a = EtcdCoordinator([etcd.endpoint], "elect", ttl_s=TTL)
    b = EtcdCoordinator([etcd.endpoint], "elect", ttl_s=TTL)
    a.register(MemberRecord(member_id="a", role="relay"))
    b.register(MemberRecord(member_id="b", role="relay"))
    assert a.campaign("relay-master", "a")
    assert not b.campaign("relay-master", "b")
    a.close()
    assert wait_until(lambda: b.campaign("relay-master", "b"), 10)
    assert b.leader("relay-master") == "b"
    b.resign("relay-master")
    assert b.leader("relay-master") is None
    b.close()


def test_an_election_is_held_by_the_process_that_won_it_and_fences_publishing(etcd):
    check_election_fencing(lambda: EtcdCoordinator([etcd.endpoint], "fence", ttl_s=TTL))


def test_watch_converges_across_compaction(etcd):
    watcher = EtcdCoordinator([etcd.endpoint], "compact", ttl_s=TTL)
    writer = EtcdCoordinator([etcd.endpoint], "compact", ttl_s=TTL)
    names = set()
    lock = threading.Lock()

    def on_event(ev):
        with lock:
            (names.add if ev.kind == "put" else names.discard)(ev.member_id)

    watcher.watch_members(on_event)
    writer.register(MemberRecord(member_id="m1", role="worker"))
    assert wait_until(lambda: names == {"m1"}, 10)
    # Churn, then compact everything: the watch must resync and converge.
    for i in range(20):
        writer.put_state("churn", str(i).encode())
    rev = writer._call("status", lambda c: c.get_prefix_response("/"))
    writer._call("compact", lambda c: c.compact(rev.header.revision))
    extra = EtcdCoordinator([etcd.endpoint], "compact", ttl_s=TTL)
    extra.register(MemberRecord(member_id="m2", role="worker"))
    assert wait_until(lambda: names == {"m1", "m2"}, 10), names
    # A watch that resumes from a revision compacted away (a stream that ended
    # while behind) fails with RevisionCompactedError while iterating: the
    # error the watch loop catches to list the prefix again.
    import pyetcd.exceptions as etcd_exc

    iterator, cancel = writer._call(
        "watch", lambda c: c.watch_prefix_response("/", start_revision=2))
    with pytest.raises(etcd_exc.RevisionCompactedError):
        next(iter(iterator))
    cancel()
    for c in (extra, writer, watcher):
        c.close()


def test_unreachable_etcd_gives_clear_error():
    from laminar_common.errors import EtcdUnavailableError
    from laminar_common.launch.local_etcd import free_port

    with pytest.raises(EtcdUnavailableError, match="cannot reach etcd"):
        EtcdCoordinator([f"127.0.0.1:{free_port()}"], "x", connect_timeout_s=1)


def test_local_etcd_restart_keeps_data():
    with LocalEtcd() as server:
        c = EtcdCoordinator([server.endpoint], "keep", ttl_s=TTL)
        c.put_state("k", b"v")
        server.stop()
        server.start()
        assert wait_until(lambda: _safe_get(c, "k") == b"v", 20)
        c.close()


def _safe_get(c, name):
    from laminar_common.errors import EtcdUnavailableError

    try:
        return c.get_state(name)
    except EtcdUnavailableError:
        return None
