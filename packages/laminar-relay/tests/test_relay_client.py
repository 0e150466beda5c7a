"""laminar_common.relay.client against in-process relays."""

from __future__ import annotations

import time

import pytest
from relay_helpers import tensors_for, wait_for

from laminar_common.errors import TransportError
from laminar_common.relay.wire import VersionNotFoundError


def test_fixed_address_client_publishes_fetches_and_reports_latest(make_relay, make_client):
    relay = make_relay("solo")
    client = make_client(address=relay.address)
    assert client.latest() is None
    with pytest.raises(VersionNotFoundError, match="any version not available"):
        client.fetch(wait_s=0.0)
    result = client.publish(7, tensors_for(7), trainer_step=3)
    assert (result.version, result.master_id, result.attempts) == (7, relay.address, 1)
    assert result.manifest.chunks[0].checksum
    latest = client.latest()
    assert (latest.version, latest.trainer_step) == (7, 3)
    with client.fetch() as fetched:
        assert fetched.version == 7 and fetched.relay_id == "solo"
        assert set(fetched.tensors()) == {"layer.weight", "layer.bias"}
    health = client.health()
    assert health.relay_id == "solo" and health.master and health.versions == (7,)
    assert health.readers == 0, "the fetch did not release its lease"


def test_publish_async_hands_off_in_order(make_relay, make_client):
    make_relay("solo")
    client = make_client()
    futures = [client.publish_async(v, tensors_for(v)) for v in (1, 2, 3)]
    assert [f.result(timeout=20).version for f in futures] == [1, 2, 3]
    assert client.latest().version == 3


def test_fetch_falls_back_to_the_master_when_the_local_relay_lacks_the_version(
    make_relay, make_client
):
    # The master forwards at 1 MiB/s (its forwarder paces the link to the follower): the
    # 3 MiB version reaches the follower seconds after the publish returns. (The pace was
    # set on the follower, whose own forwarder has no downstream: the version could
    # arrive before the check below.)
    master = make_relay("m", chain={"max_forward_bytes_per_s": 1024 * 1024})
    local = make_relay("l")
    # The follower is far behind: make sure the client asks it first ("same host").
    client = make_client()
    wait_for(lambda: master.forwarder.downstream is not None)
    client.publish(1, tensors_for(1))
    assert local.store.versions() == []
    reader = make_client(host=local.host, client_id="reader")
    with reader.fetch(1, wait_s=0.0) as fetched:
        assert fetched.relay_id in ("m", "l")
        assert bytes(fetched.tensors()["layer.weight"]) == tensors_for(1)[0][3]


def test_publish_without_any_relay_fails_in_bounded_time(make_client):
    client = make_client(publish_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(TransportError, match="no relay has won the master election"):
        client.publish(1, tensors_for(1))
    assert time.monotonic() - start < 5


def test_bad_arguments_are_refused(make_client):
    with pytest.raises(ValueError, match="exactly one of coordinator or address"):
        make_client(address="127.0.0.1:1", coordinator=object())
    client = make_client()
    with pytest.raises(ValueError, match="needs 8 bytes"):
        client.publish(1, [("w", "float32", (2,), b"1234567")])
    with pytest.raises(ValueError, match="version must be >= 0"):
        client.publish(-1, tensors_for(1))


def test_a_first_relay_that_does_not_answer_is_left_out_of_the_read(etcd, make_relay, make_client,
                                                              caplog):
    import socket

    from laminar_common.membership import InMemoryCoordinator, MemberRecord
    from laminar_common.relay.wire import RELAY_ROLE

    master = make_relay("m", host_id="other-host")
    client = make_client()
    client.publish(1, tensors_for(1))
    # A relay "on the reader's host" whose port accepts connections and never answers:
    # what a paused (SIGSTOP) relay looks like from outside.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    paused = InMemoryCoordinator(etcd, "unit")
    paused.register(MemberRecord(member_id="paused", role=RELAY_ROLE, host_id="reader-host",
                                 address=f"127.0.0.1:{silent.getsockname()[1]}"))
    reader = make_client(host="reader-host", client_id="reader", rpc_timeout_s=30.0)
    assert [r.member_id for r in reader._read_candidates()][0] == "paused"
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="laminar_common.relay.client"), \
            reader.fetch(1, wait_s=30.0) as fetched:
        took = time.monotonic() - t0
        assert fetched.relay_id == master.member_id
        assert bytes(fetched.tensors()["layer.weight"]) == tensors_for(1)[0][3]
    assert took < 5.0, took  # not the 30 s a read waiting at the paused relay would take
    assert "relay paused does not answer" in caplog.text
    # A version the live relay lacks: the read fails at once, not after a call to the
    # paused relay (tried last, it held the worker for its whole call deadline).
    t0 = time.monotonic()
    with pytest.raises(VersionNotFoundError):
        reader.fetch(0, wait_s=30.0)  # older than anything held: no wait for it
    assert time.monotonic() - t0 < 5.0
    paused.crash()
    silent.close()
