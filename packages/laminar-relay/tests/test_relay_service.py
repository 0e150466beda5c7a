"""RelayService with in-memory etcd: broadcast, hand-off, failover, catch-up, no partial reads."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from relay_helpers import tensors_for, wait_for

from laminar_common.errors import TransportError
from laminar_common.relay.manifests import build_manifest
from laminar_common.relay.wire import NotMasterError, VersionNotFoundError
from laminar_relay.election import _refuses
from laminar_relay.service import RelayService


def holders(relays, version):
    return sorted(r.member_id for r in relays if version in r.store.versions())


def assert_everyone_has(client, relays, version):
    expected = tensors_for(version)[0][3]
    for relay in relays:
        with client.fetch(version, relay=relay.member_id, wait_s=5.0) as fetched:
            assert fetched.source == "shm"
            assert bytes(fetched.tensors()["layer.weight"]) == expected, relay.member_id


def test_a_version_reaches_every_relay_in_the_chain(make_relay, make_client):
    relays = [make_relay(f"r{i}") for i in range(3)]
    wait_for(lambda: all(len(r.chain) == 3 for r in relays))
    assert relays[0].is_master and relays[0].chain == ["r0", "r1", "r2"]
    client = make_client()
    result = client.publish(1, tensors_for(1), trainer_step=10)
    assert result.master_id == "r0" and client.latest().version == 1
    assert client.latest().trainer_step == 10
    wait_for(lambda: holders(relays, 1) == ["r0", "r1", "r2"])
    assert_everyone_has(client, relays, 1)
    streamed = make_client(use_shared_memory=False)
    with streamed.fetch(1, relay="r2") as fetched:
        assert fetched.source == "stream"
        assert bytes(fetched.tensors()["layer.bias"]) == tensors_for(1)[1][3]


def test_publish_returns_at_hand_off_not_after_the_chain(make_relay, make_client):
    # The master forwards at 1 MB/s: a 3 MB version needs ~3 s to go down the chain.
    master = make_relay("m", chain={"max_forward_bytes_per_s": 1024 * 1024})
    follower = make_relay("f")
    wait_for(lambda: master.forwarder.downstream is not None)
    client = make_client()
    result = client.publish(1, tensors_for(1))
    assert master.store.versions() == [1]
    assert follower.store.versions() == [], "publish waited for the chain"
    assert result.master_id == "m" and client.latest().version == 1
    wait_for(lambda: follower.store.versions() == [1], timeout_s=10)


def test_master_failover_and_the_client_re_resolves(make_relay, make_client):
    relays = [make_relay(f"r{i}") for i in range(3)]
    wait_for(lambda: all(len(r.chain) == 3 for r in relays))
    client = make_client()
    client.publish(1, tensors_for(1))
    wait_for(lambda: holders(relays, 1) == ["r0", "r1", "r2"])
    relays[0].close("simulated crash")
    live = relays[1:]
    new_master = wait_for(lambda: next((r for r in live if r.is_master), None))
    assert new_master.member_id in ("r1", "r2")
    result = client.publish(2, tensors_for(2))
    assert result.master_id == new_master.member_id
    wait_for(lambda: holders(live, 2) == ["r1", "r2"])
    assert_everyone_has(client, live, 2)


def _sigkill(relay: RelayService) -> None:
    """What a SIGKILL leaves: the process's ports close, its lease stays until it expires
    (3,600 s in these tests: only a takeover that does not wait for it can pass)."""
    relay.coordinator.crash()
    relay.close("simulated SIGKILL")


def test_a_dead_master_is_replaced_at_once_not_after_its_lease(make_relay, make_client):
    relays = [make_relay(f"r{i}") for i in range(3)]
    wait_for(lambda: all(len(r.chain) == 3 for r in relays))
    client = make_client(failover_wait_s=60.0)
    client.publish(1, tensors_for(1))
    wait_for(lambda: holders(relays, 1) == ["r0", "r1", "r2"])
    assert [r.takeovers for r in relays] == [0, 0, 0], "a live master was evicted"
    t0 = time.monotonic()
    _sigkill(relays[0])
    live = relays[1:]
    new_master = wait_for(lambda: next((r for r in live if r.is_master), None), timeout_s=5)
    took = time.monotonic() - t0
    # Only the relay after the master in the chain checks it and revokes its lease; then
    # every relay campaigns, as at a lease's expiry.
    assert [r.takeovers for r in live] == [1, 0] and took < 3.0, took
    result = client.publish(2, tensors_for(2))
    assert result.master_id == new_master.member_id and time.monotonic() - t0 < 10.0
    wait_for(lambda: holders(live, 2) == ["r1", "r2"])
    assert_everyone_has(client, live, 2)


def test_a_relay_restarted_under_its_id_takes_the_master_election_back(make_relay, make_client):
    first = make_relay("r0")
    wait_for(lambda: first.is_master)
    client = make_client(failover_wait_s=60.0)
    client.publish(1, tensors_for(1))
    _sigkill(first)
    again = make_relay("r0")  # the same member id, a new process (and port)
    wait_for(lambda: again.is_master, timeout_s=5)
    assert again.takeovers == 1
    # The client does not hold the new process suspect for the old one's failure.
    t0 = time.monotonic()
    result = client.publish(2, tensors_for(2))
    assert result.master_id == "r0" and time.monotonic() - t0 < 10.0
    assert again.store.versions() == [2] and client.latest().version == 2


def test_a_master_that_lost_the_election_cannot_make_a_version_visible(etcd, make_relay,
                                                                       make_client):
    old, standby = make_relay("r0"), make_relay("r1")
    wait_for(lambda: old.is_master and standby.chain == ["r0", "r1"])
    # r0's lease runs out (a pause past the TTL, as etcd sees it) and r1 wins; r0 has not
    # looked yet when its commit comes.
    old.coordinator.crash()
    etcd.expire_lease(old.coordinator.lease)
    wait_for(lambda: standby.is_master)
    manifest = build_manifest(5, tensors_for(5))[0]
    with pytest.raises(NotMasterError, match="no longer the master"):
        old.position.make_visible(manifest)
    latest = make_client().latest()
    assert latest is None or latest.version != 5


def test_refused_means_nothing_listens_there():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        assert not _refuses(address)
    assert _refuses(address)  # closed now
    assert not _refuses("not-a-host.invalid:1") and not _refuses("no-port")


def test_chain_is_rebuilt_around_a_dead_relay(make_relay, make_client):
    relays = [make_relay(f"r{i}") for i in range(4)]
    wait_for(lambda: all(len(r.chain) == 4 for r in relays))
    client = make_client()
    client.publish(1, tensors_for(1))
    wait_for(lambda: holders(relays, 1) == ["r0", "r1", "r2", "r3"])
    relays[1].close("simulated crash")
    live = [relays[0], relays[2], relays[3]]
    wait_for(lambda: all(r.chain == ["r0", "r2", "r3"] for r in live))
    client.publish(2, tensors_for(2))
    wait_for(lambda: holders(live, 2) == ["r0", "r2", "r3"])
    assert_everyone_has(client, live, 2)


def test_a_relay_that_joins_late_catches_up_with_the_newest_version(make_relay, make_client):
    first = make_relay("r0")
    client = make_client()
    client.publish(1, tensors_for(1))
    client.publish(2, tensors_for(2))
    late = make_relay("r1")
    wait_for(lambda: late.store.versions() == [2])
    assert_everyone_has(client, [late], 2)
    assert first.store.versions() == [1, 2]


def test_readers_never_see_a_partial_version(make_relay, make_client):
    relays = [make_relay(f"r{i}") for i in range(3)]
    wait_for(lambda: all(len(r.chain) == 3 for r in relays))
    publisher = make_client()
    reader = make_client(use_shared_memory=False)
    seen: list[int] = []
    problems: list[str] = []
    done = threading.Event()

    def read_forever():
        while not done.is_set():
            try:
                with reader.fetch(relay="r2", wait_s=0.0, verify=True) as fetched:
                    want = tensors_for(fetched.version)[0][3]
                    if bytes(fetched.tensors()["layer.weight"]) != want:
                        problems.append(f"version {fetched.version} differs")
                    seen.append(fetched.version)
            except VersionNotFoundError:
                pass  # nothing published yet

    thread = threading.Thread(target=read_forever)
    thread.start()
    try:
        for version in range(1, 6):
            publisher.publish(version, tensors_for(version))
        wait_for(lambda: 5 in relays[2].store.versions())
        wait_for(lambda: seen and seen[-1] == 5)
    finally:
        done.set()
        thread.join(10)
    assert not problems
    assert seen == sorted(seen), "a reader went back in time"
    assert seen[-1] == 5


def test_a_wildcard_bind_needs_an_advertised_address(etcd):
    """A library caller binding every interface must say what peers are told; the
    config path (make_relay_service) resolves it, so the record never names 0.0.0.0."""
    import pytest

    from laminar_common.membership import InMemoryCoordinator
    from laminar_relay.memory import make_allocator
    from laminar_relay.store import WeightStore

    with pytest.raises(ValueError, match="advertise_host"):
        RelayService(member_id="r0", coordinator=InMemoryCoordinator(etcd, "unit"),
                     store=WeightStore(make_allocator("heap"), max_bytes=1 << 20,
                                         max_version_bytes=1 << 19),
                     bind_host="0.0.0.0")


def test_a_publisher_goes_back_to_a_suspect_master_that_answers_again(make_relay, make_client):
    """A publish failed on a master that is alive and still the master (its link was cut
    and healed): the client asks it for its health, and publishes to it at once instead
    of waiting failover_wait_s for a successor that will not come."""
    master = make_relay("r0")
    wait_for(lambda: master.is_master)
    client = make_client(failover_wait_s=60.0)
    client.publish(1, tensors_for(1))
    ref = client.master()
    client._suspect = ((ref.member_id, ref.started_at, ref.address), time.monotonic())
    t0 = time.monotonic()
    result = client.publish(2, tensors_for(2))
    assert result.master_id == "r0" and time.monotonic() - t0 < 3.0
    assert client._suspect is None


def test_a_suspect_master_that_does_not_answer_stays_suspect(make_relay, make_client):
    """The same master SIGKILLed (its port refuses): the health call fails, the client
    keeps waiting for a successor (none comes here) until the publish's deadline."""
    master = make_relay("r0")
    wait_for(lambda: master.is_master)
    client = make_client(failover_wait_s=60.0, publish_timeout_s=2.0)
    client.publish(1, tensors_for(1))
    ref = client.master()
    client._suspect = ((ref.member_id, ref.started_at, ref.address), time.monotonic())
    _sigkill(master)  # its port goes away; its record and election stay (an hour's lease)
    with pytest.raises(TransportError, match="just failed and no other relay took over"):
        client.publish(2, tensors_for(2))
