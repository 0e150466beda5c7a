"""laminar_common.relay.publish: one publish session against a real in-process relay."""

from __future__ import annotations

import logging

import grpc
import pytest
from relay_helpers import tensors_for, wait_for

from laminar_common.codec import ChunkSpec, WeightManifest
from laminar_common.errors import TransportError
from laminar_common.relay.manifests import build_manifest, iter_chunks
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.publish import (
    ChunkSenders,
    PublishRefused,
    PublishSession,
    PublishWithdrawn,
)
from laminar_common.relay.wire import GRPC_OPTIONS, VersionNotFoundError


class RecordingSenders(ChunkSenders):
    """ChunkSenders that remembers which endpoints were dropped."""

    def __init__(self) -> None:
        super().__init__(hwm=8, send_timeout_s=5.0)
        self.dropped: list[str] = []

    def drop(self, endpoint: str) -> None:
        self.dropped.append(endpoint)
        super().drop(endpoint)


@pytest.fixture
def master(make_relay):
    relay = make_relay("m")
    wait_for(lambda: relay.is_master)
    return relay


@pytest.fixture
def stub(master):
    channel = grpc.insecure_channel(master.address, options=list(GRPC_OPTIONS))
    yield relay_pb2_grpc.RelayStub(channel)
    channel.close()


@pytest.fixture
def senders():
    pool = RecordingSenders()
    yield pool
    pool.close()


def _version(v: int):
    """``(layout without checksums, full manifest, chunks as (index, digest, payload))``."""
    manifest, buffers = build_manifest(v, tensors_for(v), chunk_bytes=512 * 1024)
    chunks = [
        (c.index, bytes.fromhex(c.checksum), bytes(p.contiguous()))
        for c, p in zip(manifest.chunks, iter_chunks(buffers, manifest.tensors, manifest.chunks))
    ]
    layout = WeightManifest(
        manifest.version,
        manifest.total_bytes,
        manifest.chunk_bytes,
        manifest.tensors,
        tuple(ChunkSpec(c.index, c.offset, c.nbytes, "") for c in manifest.chunks),
        manifest.created_at,
        manifest.trainer_step,
    )
    return layout, manifest, chunks


def _session(stub, layout, senders, **kwargs) -> PublishSession:
    kwargs.setdefault("origin", relay_pb2.ORIGIN_PUBLISHER)
    return PublishSession(
        stub, layout, sender_id="t", senders=senders, what=f"test publish of {layout.version}",
        rpc_timeout_s=5.0, commit_timeout_s=5.0, **kwargs,
    )


def test_a_session_stores_the_version_and_makes_it_visible(master, stub, senders, make_client):
    layout, manifest, chunks = _version(1)
    session = _session(stub, layout, senders)
    reply = session.run(iter(chunks))
    assert (reply.version, reply.relay_id, reply.visible) == (1, "m", True)
    assert session.sent == len(chunks) and session.manifest == manifest
    assert master.store.versions() == [1] and master.store.receiving() == []
    assert master.coordinator.latest_version().version == 1
    with make_client().fetch(1) as fetched:
        assert bytes(fetched.buffer) == b"".join(payload for _, _, payload in chunks)
    assert senders.dropped == []


def test_a_failing_chunk_source_aborts_and_nothing_partial_is_visible(
    master, stub, senders, make_client, caplog
):
    layout, _, chunks = _version(1)
    half = len(chunks) // 2

    def source():
        yield from chunks[:half]
        raise TransportError("the trainer's buffers went away")

    session = _session(stub, layout, senders)
    caplog.set_level(logging.INFO, logger="laminar_relay.store")
    with pytest.raises(TransportError, match="buffers went away"):
        session.run(source())
    # The relay dropped the session on the abort, long before it would expire idle (30 s).
    assert master.store.receiving() == [] and master.store.versions() == []
    assert master.store.stats()["used_bytes"] == 0
    assert any(
        "dropped publish session of version 1 from t: t gave up: "
        "the trainer's buffers went away" in r.getMessage()
        for r in caplog.records
    )
    assert master.coordinator.latest_version() is None
    with pytest.raises(VersionNotFoundError):
        make_client().fetch(1, wait_s=0.0)
    assert senders.dropped == [session.endpoint]  # a transport failure: the socket is not reused


def test_a_failure_listed_in_no_abort_on_leaves_the_session_to_expire(master, stub, senders):
    layout, _, chunks = _version(1)

    class RelayPaused(TransportError):
        pass

    def source():
        yield chunks[0]
        raise RelayPaused("another relay won the election")

    with pytest.raises(RelayPaused):
        _session(stub, layout, senders, no_abort_on=(RelayPaused,)).run(source())
    assert master.store.receiving() == [1]
    master.store.maintain(session_idle_s=0.0)
    assert master.store.receiving() == [] and master.store.versions() == []


def test_a_withdrawn_source_aborts_with_its_reason_and_returns_none(master, stub, senders, caplog):
    layout, _, chunks = _version(1)

    def source():
        yield chunks[0]
        raise PublishWithdrawn("dropped upstream: superseded")

    caplog.set_level(logging.INFO, logger="laminar_relay.store")
    assert _session(stub, layout, senders, origin=relay_pb2.ORIGIN_RELAY).run(source()) is None
    assert master.store.receiving() == [] and master.store.versions() == []
    assert any(r.getMessage().endswith("from t: dropped upstream: superseded")
               for r in caplog.records)


def test_a_declined_begin_raises_publish_refused_before_reading_chunks(master, stub, senders):
    layout, _, chunks = _version(1)
    assert _session(stub, layout, senders).run(iter(chunks)).version == 1

    def source():
        pytest.fail("chunks were read although the relay declined")
        yield

    # Another relay forwarding a version this one already holds is declined, not refused.
    with pytest.raises(PublishRefused) as info:
        _session(stub, layout, senders, origin=relay_pb2.ORIGIN_RELAY).run(source())
    assert "version 1" in info.value.reason
    assert master.store.versions() == [1] and master.store.receiving() == []
