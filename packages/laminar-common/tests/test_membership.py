"""Coordinator semantics on the in-memory twin (the etcd one is in integration_tests)."""

import pytest

from laminar_common.errors import CoordinationError, ProtocolError
from laminar_common.membership import (
    InMemoryCoordinator,
    InMemoryEtcd,
    MemberRecord,
    VersionRecord,
)
from laminar_common.testing import check_election_fencing


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def store():
    return InMemoryEtcd(clock=FakeClock())


def test_register_watch_and_lease_expiry(store):
    a = InMemoryCoordinator(store, "job", ttl_s=5, keepalive=False)
    b = InMemoryCoordinator(store, "job", ttl_s=5, keepalive=False)
    events = []
    b.watch_members(lambda ev: events.append((ev.kind, ev.member_id)))
    a.register(MemberRecord(member_id="w1", role="worker", address="tcp://x"))
    assert b.members("worker")["w1"].address == "tcp://x"
    store._clock.now = 3
    assert a.keepalive()
    store._clock.now = 7
    assert "w1" in b.members()
    store._clock.now = 20
    assert b.members() == {}
    assert events == [("put", "w1"), ("delete", "w1")]
    assert not a.registered


def test_protocol_mismatch_refused_at_registration(store):
    InMemoryCoordinator(store, "job").register(MemberRecord(member_id="a", role="worker"))
    other = InMemoryCoordinator(store, "job")
    with pytest.raises(ProtocolError, match="protocol version 99"):
        other.register(MemberRecord(member_id="b", role="worker", protocol_version=99))
    assert "b" not in other.members()


def test_versions_only_move_forward(store):
    c = InMemoryCoordinator(store, "job")
    seen = []
    c.watch_latest(lambda rec: seen.append(rec.version))
    assert c.latest_version() is None
    c.publish_version(VersionRecord(version=1))
    c.publish_version(VersionRecord(version=3))
    for bad in (3, 2):
        with pytest.raises(CoordinationError, match="not newer"):
            c.publish_version(VersionRecord(version=bad))
    assert c.latest_version().version == 3
    assert seen == [1, 3]


def test_election_bound_to_lease(store):
    a = InMemoryCoordinator(store, "job")
    b = InMemoryCoordinator(store, "job")
    a.register(MemberRecord(member_id="a", role="relay"))
    b.register(MemberRecord(member_id="b", role="relay"))
    assert a.campaign("master", "a")
    assert not b.campaign("master", "b")
    assert b.leader("master") == "a"
    a.close()
    assert b.leader("master") is None
    assert b.campaign("master", "b")
    b.resign("master")
    assert b.leader("master") is None


def test_an_election_is_held_by_the_process_that_won_it_and_fences_publishing():
    store = InMemoryEtcd()
    check_election_fencing(lambda: InMemoryCoordinator(store, "job", keepalive=False))


def test_a_win_whose_answer_was_lost_is_adopted_not_held_forever():
    store = InMemoryEtcd()
    a = InMemoryCoordinator(store, "job", keepalive=False)
    a.register(MemberRecord(member_id="a", role="relay"))
    # The key went in under a's lease but a never heard back (an etcd error after the put).
    store.put_if(a.keys.election("master"), b"a", None, a.lease)
    assert a.owns("master"), "a holds the key under its own lease but does not own it"
    a.publish_version(VersionRecord(version=1), fence="master")
    assert a.latest_version().version == 1


def test_campaign_needs_registration(store):
    with pytest.raises(CoordinationError):
        InMemoryCoordinator(store, "job").campaign("master", "x")


def test_jobs_are_isolated(store):
    InMemoryCoordinator(store, "a").register(MemberRecord(member_id="w", role="worker"))
    assert InMemoryCoordinator(store, "b").members() == {}


def test_new_watch_replays_existing_members_and_latest(store):
    a = InMemoryCoordinator(store, "job")
    a.register(MemberRecord(member_id="w1", role="worker"))
    a.publish_version(VersionRecord(version=4))
    seen, latest = [], []
    a.watch_members(lambda ev: seen.append((ev.kind, ev.member_id)))
    a.watch_latest(lambda rec: latest.append(rec.version))
    assert seen == [("put", "w1")]
    assert latest == [4]


def test_keepalive_thread_holds_the_lease_until_crash():
    store = InMemoryEtcd()
    a = InMemoryCoordinator(store, "job", ttl_s=0.3)
    a.register(MemberRecord(member_id="w1", role="worker"))
    import time

    time.sleep(0.8)
    assert a.registered, "the keepalive thread did not refresh the lease"
    a.crash()
    time.sleep(0.8)
    assert not a.registered and InMemoryCoordinator(store, "job").members() == {}
