"""laminar_relay.chain: chain order from membership, and pipelined forwarding."""

from __future__ import annotations

import grpc
from relay_helpers import tensors_for, wait_for

from laminar_common.membership import MemberRecord
from laminar_common.relay.dataplane import ZmqChunkSender
from laminar_common.relay.manifests import build_manifest, iter_chunks
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.wire import manifest_to_proto, protocol_metadata
from laminar_relay.chain import neighbours, order_chain
from laminar_relay.store import IncomingVersion


def _member(mid: str, started: float) -> MemberRecord:
    return MemberRecord(member_id=mid, role="relay", address=f"{mid}:1", started_at=started)


def test_chain_puts_the_master_first_then_registration_order():
    members = {
        m.member_id: m
        for m in [_member("c", 3.0), _member("a", 2.0), _member("b", 2.0), _member("master", 9.0)]
    }
    chain = order_chain(members, "master")
    assert [m.member_id for m in chain] == ["master", "a", "b", "c"]
    up, down = neighbours(chain, "a")
    assert (up.member_id, down.member_id) == ("master", "b")
    assert neighbours(chain, "c")[1] is None and neighbours(chain, "master")[0] is None
    assert neighbours(chain, "gone") == (None, None)
    assert [m.member_id for m in order_chain(members, None)] == ["a", "b", "c", "master"]
    assert [m.member_id for m in order_chain(members, "dead")] == ["a", "b", "c", "master"]


def test_chunks_are_forwarded_before_the_master_has_the_whole_version(make_relay, make_client):
    master = make_relay("m")
    follower = make_relay("f")
    wait_for(lambda: master.forwarder.downstream is not None)
    manifest, buffers = build_manifest(1, tensors_for(1), chunk_bytes=512 * 1024)
    payloads = [
        bytes(p.contiguous()) for p in iter_chunks(buffers, manifest.tensors, manifest.chunks)
    ]
    channel = grpc.insecure_channel(master.address)
    stub = relay_pb2_grpc.RelayStub(channel)
    begin = stub.BeginPublish(
        relay_pb2.BeginPublishRequest(
            manifest=manifest_to_proto(manifest), origin=relay_pb2.ORIGIN_PUBLISHER, sender_id="t"
        ),
        timeout=5,
        metadata=protocol_metadata(),
    )
    sender = ZmqChunkSender(begin.data_endpoint)
    half = len(payloads) // 2
    for i in range(half):
        sender.send(begin.session, i, bytes.fromhex(manifest.chunks[i].checksum), payloads[i])

    def downstream_has_chunks():
        handle = follower.store.follow(1)
        return isinstance(handle, IncomingVersion) and len(handle.arrived) >= half

    # Half the chunks reached the follower while the master still waits for the rest.
    wait_for(downstream_has_chunks)
    assert master.store.versions() == [] and follower.store.versions() == []
    for i in range(half, len(payloads)):
        sender.send(begin.session, i, bytes.fromhex(manifest.chunks[i].checksum), payloads[i])
    stub.CommitPublish(
        relay_pb2.CommitPublishRequest(
            session=begin.session,
            chunks_sent=len(payloads),
            checksums=[c.checksum for c in manifest.chunks],
        ),
        timeout=10,
        metadata=protocol_metadata(),
    )
    sender.close()
    channel.close()
    wait_for(lambda: follower.store.versions() == [1])
    client = make_client()
    with client.fetch(1, relay="f") as fetched:
        assert bytes(fetched.buffer) == b"".join(payloads)
