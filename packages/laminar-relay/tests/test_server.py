"""The relay control API under bad and hostile input.

Every refusal is a clear error to the sender, nothing partial becomes visible, and the
relay keeps serving.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import zmq
from relay_helpers import tensors_for, wait_for

from laminar_common.errors import ProtocolError
from laminar_common.relay.dataplane import ZmqChunkSender, encode_chunk_header
from laminar_common.relay.manifests import build_manifest, iter_chunks
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.wire import (
    ChecksumError,
    NotMasterError,
    OversizedError,
    ProtocolMismatchError,
    VersionConflictError,
    VersionNotFoundError,
    error_from_rpc,
    manifest_to_proto,
    protocol_metadata,
)


@pytest.fixture
def relay(make_relay):
    return make_relay("solo", store={"max_version_bytes": 8 * 1024 * 1024, "max_tensors": 50})


@pytest.fixture
def stub(relay):
    channel = grpc.insecure_channel(relay.address)
    yield relay_pb2_grpc.RelayStub(channel)
    channel.close()


def call(method, request, **kwargs):
    try:
        return method(request, timeout=10, metadata=protocol_metadata(), **kwargs)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, "test call") from exc


def prepared(version, chunk_bytes=1024 * 1024):
    manifest, buffers = build_manifest(version, tensors_for(version), chunk_bytes=chunk_bytes)
    payloads = [
        bytes(p.contiguous()) for p in iter_chunks(buffers, manifest.tensors, manifest.chunks)
    ]
    return manifest, payloads


def begin(stub, manifest, origin=relay_pb2.ORIGIN_PUBLISHER):
    return call(
        stub.BeginPublish,
        relay_pb2.BeginPublishRequest(
            manifest=manifest_to_proto(manifest), origin=origin, sender_id="tester"
        ),
    )


def still_serving(client, relay, version):
    """The relay takes the next good publish and serves it whole."""
    data = tensors_for(version)
    client.publish(version, data)
    with client.fetch(version, relay=relay.member_id) as fetched:
        assert bytes(fetched.tensors()["layer.weight"]) == data[0][3]


def test_regression_and_duplicate_are_refused_before_any_bytes(relay, make_client):
    client = make_client()
    client.publish(3, tensors_for(3))
    with pytest.raises(VersionConflictError, match="duplicate: weight version 3 is not newer"):
        client.publish(3, tensors_for(3))
    with pytest.raises(
        VersionConflictError, match="regression: weight version 2 is not newer .* 3"
    ):
        client.publish(2, tensors_for(2))
    assert client.latest().version == 3
    still_serving(client, relay, 4)


def test_truncated_publish_is_refused_and_nothing_becomes_visible(relay, stub, make_client):
    client = make_client()
    manifest, payloads = prepared(1)
    reply = begin(stub, manifest)
    sender = ZmqChunkSender(reply.data_endpoint)
    for i in range(2):
        sender.send(reply.session, i, bytes.fromhex(manifest.chunks[i].checksum), payloads[i])
    with pytest.raises(
        ProtocolError, match=r"truncated publish of version 1: the sender sent 2 .* 4 chunks"
    ):
        call(
            stub.CommitPublish,
            relay_pb2.CommitPublishRequest(
                session=reply.session,
                chunks_sent=2,
                checksums=[c.checksum for c in manifest.chunks[:2]],
            ),
        )
    sender.close()
    assert client.latest() is None
    with pytest.raises(VersionNotFoundError):
        client.fetch(1, relay=relay.member_id, wait_s=0.1)
    assert relay.store.stats()["used_bytes"] == 0
    still_serving(client, relay, 2)


def test_checksum_mismatch_is_reported_to_the_sender(relay, stub, make_client):
    client = make_client()
    manifest, payloads = prepared(1)
    reply = begin(stub, manifest)
    sender = ZmqChunkSender(reply.data_endpoint)
    for i, payload in enumerate(payloads):
        if i == 1:
            payload = bytes([payload[0] ^ 1]) + payload[1:]
        sender.send(reply.session, i, bytes.fromhex(manifest.chunks[i].checksum), payload)
    with pytest.raises(ChecksumError, match="chunk 1 of version 1 failed its checksum") as info:
        call(
            stub.CommitPublish,
            relay_pb2.CommitPublishRequest(
                session=reply.session,
                chunks_sent=len(payloads),
                checksums=[c.checksum for c in manifest.chunks],
            ),
        )
    sender.close()
    assert "DATA_LOSS" in str(info.value)
    assert client.latest() is None and relay.store.versions() == []
    still_serving(client, relay, 1)


def test_unknown_version_and_unknown_session_are_clear_errors(relay, stub, make_client):
    client = make_client()
    client.publish(1, tensors_for(1))
    with pytest.raises(VersionNotFoundError, match="version 7 not available"):
        client.fetch(7, relay=relay.member_id, wait_s=0.1)
    with pytest.raises(ProtocolError, match="unknown publish session"):
        call(stub.CommitPublish, relay_pb2.CommitPublishRequest(session=b"x" * 16, chunks_sent=1))
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.Read(relay_pb2.ReadRequest(lease="nope"), timeout=5, metadata=protocol_metadata())
        )
    err = error_from_rpc(info.value, "read")
    assert isinstance(err, VersionNotFoundError) and "reader lease 'nope' is unknown" in str(err)


def test_oversized_and_malformed_manifests_are_refused(relay, stub, make_client):
    client = make_client()
    too_big = [("w", "uint8", (9 * 1024 * 1024,), bytes(9 * 1024 * 1024))]
    with pytest.raises(
        OversizedError, match=r"accepts at most 8388608 \(store.max_version_bytes\)"
    ):
        client.publish(1, too_big)
    many = [(f"t{i}", "uint8", (1,), b"x") for i in range(51)]
    with pytest.raises(OversizedError, match="lists 51 tensors"):
        client.publish(1, many)
    manifest, _ = prepared(1)
    pb = manifest_to_proto(manifest)
    pb.tensors[0].nbytes += 1
    with pytest.raises(ProtocolError, match="tensor 'layer.weight' .* manifest says"):
        call(
            stub.BeginPublish,
            relay_pb2.BeginPublishRequest(
                manifest=pb, origin=relay_pb2.ORIGIN_PUBLISHER, sender_id="x"
            ),
        )
    with pytest.raises(ProtocolError, match="no manifest"):
        call(stub.BeginPublish, relay_pb2.BeginPublishRequest(origin=1, sender_id="x"))
    assert relay.health().rejected["OversizedError"] == 2
    still_serving(client, relay, 1)


def test_wrong_protocol_version_is_refused(relay, stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Health(relay_pb2.HealthRequest(), timeout=5, metadata=(("laminar-protocol", "999"),))
    err = error_from_rpc(info.value, "health")
    assert isinstance(err, ProtocolMismatchError)
    assert "caller speaks laminar protocol version 999" in str(err)


def test_publish_to_a_relay_that_is_not_master_is_refused(make_relay, make_client):
    make_relay("first")
    second = make_relay("second")
    client = make_client(address=second.address)
    with pytest.raises(NotMasterError, match=r"relay second is not the master \(master: first\)"):
        client.publish(1, tensors_for(1))


def test_data_plane_garbage_is_counted_and_the_relay_keeps_serving(relay, make_client):
    client = make_client()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(relay.data_endpoint)
    try:
        sock.send_multipart([b"garbage"])
        sock.send_multipart([b"LMDP-not-a-header", b"x"])
        sock.send_multipart([encode_chunk_header(b"s" * 16, 0, b"d" * 16), b"x" * 10])
        wait_for(lambda: sum(client.health(relay.member_id).rejected.values()) >= 3)
    finally:
        sock.close(0)
    rejected = client.health(relay.member_id).rejected
    assert rejected["malformed"] == 1 and rejected["bad-header"] == 1
    assert rejected["unknown-session"] == 1
    still_serving(client, relay, 1)


def test_waiting_fetches_are_capped_so_publishes_still_get_server_threads(make_relay, make_client):
    relay = make_relay("capped", grpc_workers=5)  # at most one fetch may wait
    client = make_client()
    client.publish(1, tensors_for(1))
    got: list[int] = []
    waiter = threading.Thread(
        target=lambda: got.append(client.fetch(2, relay="capped", wait_s=10.0).version)
    )
    waiter.start()
    wait_for(lambda: relay.servicer.waiting_fetches == 1)
    start = time.monotonic()
    with pytest.raises(VersionNotFoundError, match="version 2 not available after 0.0s"):
        client.fetch(2, relay="capped", wait_s=10.0)
    assert time.monotonic() - start < 5.0  # it did not wait its 10 s
    client.publish(2, tensors_for(2))
    waiter.join(10)
    assert got == [2]
