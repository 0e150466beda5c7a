"""Hostile manifests on the relay's control API: protobuf -> manifest -> store.

Whatever a ``BeginPublish`` carries, the relay either opens a session for a
self-consistent manifest or refuses with one of its documented errors (a
:class:`ProtocolError` family member or :class:`StoreFullError`), counts the
refusal, and never answers INTERNAL. Nothing becomes readable before a commit
whose every chunk arrived and checked out. A reader validating a relay's
answer (``manifest_from_proto`` + ``validate_manifest``) gets a manifest or a
:class:`ProtocolError`, quickly, whatever sizes the answer claims.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_common.codec import WeightManifest
from laminar_common.errors import ProtocolError
from laminar_common.relay.manifests import build_manifest, validate_manifest
from laminar_common.relay.proto import relay_pb2
from laminar_common.relay.wire import (
    ERROR_METADATA_KEY,
    manifest_from_proto,
    manifest_to_proto,
    protocol_metadata,
)
from laminar_relay.memory import make_allocator
from laminar_relay.server import RelayServicer
from laminar_relay.store import WeightStore

SETTINGS = settings(max_examples=200, deadline=None)
MAX_VERSION_BYTES = 64 * 1024
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DEADLINE_EXCEEDED}

u64 = st.integers(0, 2**64 - 1) | st.integers(0, 4096)
checksums = st.text("0123456789abcdefABCDEF xyz", max_size=34) | st.just("0" * 32)
dtypes = (st.sampled_from(["uint8", "float32", "bfloat16", "int64", "bogus", ""])
          | st.text(max_size=6))


@st.composite
def plausible_manifests(draw) -> relay_pb2.Manifest:
    """A correct manifest's protobuf with a few of its fields changed."""
    sizes = draw(st.lists(st.integers(1, 600), min_size=1, max_size=3))
    tensors = [(f"t{i}", "uint8", (n,), bytes(n)) for i, n in enumerate(sizes)]
    manifest, _ = build_manifest(draw(st.integers(0, 5)), tensors,
                                 chunk_bytes=draw(st.integers(1, 512)))
    pb = manifest_to_proto(manifest)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["manifest", "tensor", "chunk", "drop", "repeat"]))
        if kind == "manifest":
            setattr(pb, draw(st.sampled_from(["version", "total_bytes", "chunk_bytes"])), draw(u64))
        elif kind == "tensor" and pb.tensors:
            spec = pb.tensors[draw(st.integers(0, len(pb.tensors) - 1))]
            field = draw(st.sampled_from(["name", "dtype", "shape", "offset", "nbytes"]))
            if field == "name":
                spec.name = draw(st.text(max_size=4))
            elif field == "dtype":
                spec.dtype = draw(dtypes)
            elif field == "shape":
                del spec.shape[:]
                spec.shape.extend(draw(st.lists(u64, max_size=3)))
            else:
                setattr(spec, field, draw(u64))
        elif kind == "chunk" and pb.chunks:
            spec = pb.chunks[draw(st.integers(0, len(pb.chunks) - 1))]
            field = draw(st.sampled_from(["index", "offset", "nbytes", "checksum"]))
            if field == "checksum":
                spec.checksum = draw(checksums)
            else:
                setattr(spec, field, draw(st.integers(0, 2**32 - 1) if field == "index" else u64))
        elif kind == "drop":
            repeated = pb.tensors if draw(st.booleans()) else pb.chunks
            if repeated:
                del repeated[draw(st.integers(0, len(repeated) - 1))]
        elif kind == "repeat" and pb.tensors:
            pb.tensors.add().CopyFrom(pb.tensors[0])
    return pb


arbitrary_manifests = st.builds(
    relay_pb2.Manifest,
    version=u64, total_bytes=u64, chunk_bytes=u64,
    tensors=st.lists(st.builds(relay_pb2.TensorSpec, name=st.text(max_size=6), dtype=dtypes,
                               shape=st.lists(u64, max_size=3), offset=u64, nbytes=u64),
                     max_size=3),
    chunks=st.lists(st.builds(relay_pb2.ChunkSpec, index=st.integers(0, 2**32 - 1), offset=u64,
                              nbytes=u64, checksum=checksums), max_size=3),
    created_at=st.floats(), trainer_step=st.integers(-(2**63), 2**63 - 1),
)
manifests = plausible_manifests() | arbitrary_manifests


def assert_self_consistent(manifest: WeightManifest) -> None:
    """What a manifest ``validate_manifest`` accepted must be (checked independently)."""
    assert manifest.version >= 0 and manifest.total_bytes > 0
    offset = 0
    for i, chunk in enumerate(manifest.chunks):
        assert (chunk.index, chunk.offset) == (i, offset)
        assert 0 < chunk.nbytes <= manifest.chunk_bytes
        offset += chunk.nbytes
    assert offset == manifest.total_bytes
    assert manifest.tensors and len({t.name for t in manifest.tensors}) == len(manifest.tensors)
    spans = sorted((t.offset, t.offset + t.nbytes) for t in manifest.tensors)
    assert all(0 <= start <= end <= manifest.total_bytes for start, end in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


@SETTINGS
@given(manifests)
def test_a_reader_validating_any_answer_gets_a_manifest_or_a_protocol_error(pb):
    manifest = manifest_from_proto(pb)
    try:
        validate_manifest(manifest)
    except ProtocolError as exc:
        assert f"version {manifest.version}" in str(exc) or "manifest" in str(exc)
        return
    assert_self_consistent(manifest)
    assert all(len(c.checksum) == 32 for c in manifest.chunks)


@SETTINGS
@given(st.binary(max_size=200))
def test_any_bytes_parsed_as_a_manifest(raw):
    try:
        pb = relay_pb2.Manifest.FromString(raw)
    except DecodeError:
        return  # refused by the protobuf layer before any relay code runs
    try:
        validate_manifest(manifest_from_proto(pb), max_total_bytes=MAX_VERSION_BYTES)
    except ProtocolError:
        return
    assert_self_consistent(manifest_from_proto(pb))


class Aborted(Exception):
    """Raised by the fake context's abort, as grpc's own does."""


class FakeContext:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.trailing: tuple = ()

    def invocation_metadata(self):
        return protocol_metadata()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def call(method, request):
    """Returns (reply, None) or (None, context) when the relay refused the call."""
    context = FakeContext()
    try:
        return method(request, context), None
    except Aborted:
        return None, context


@pytest.fixture(scope="module")
def servicer():
    store = WeightStore(make_allocator("heap"), max_bytes=4 * MAX_VERSION_BYTES,
                        max_version_bytes=MAX_VERSION_BYTES, max_tensors=4)
    relay = RelayServicer(
        store, relay_id="r0", host="h", data_endpoint="tcp://127.0.0.1:1",
        master_id=lambda: "r0", latest_published=lambda: -1, make_visible=lambda m: None,
        on_begin=lambda v: None, health=lambda: relay_pb2.HealthReply(), commit_timeout_s=0.0)
    yield relay
    store.close()


def assert_refused_and_counted(servicer, context, before: int) -> None:
    assert context.code in REFUSALS, (context.code, context.details)
    names = [value for key, value in context.trailing if key == ERROR_METADATA_KEY]
    assert names and (names[0].endswith("Error")), context.trailing
    assert sum(servicer.rejected.values()) == before + 1 and servicer.rejected[names[0]] >= 1


@SETTINGS
@given(manifests, st.sampled_from([relay_pb2.ORIGIN_PUBLISHER, relay_pb2.ORIGIN_RELAY]))
def test_begin_publish_of_any_manifest(servicer, pb, origin):
    store = servicer.store
    before = sum(servicer.rejected.values())
    request = relay_pb2.BeginPublishRequest(manifest=pb, origin=origin, sender_id="fuzzer")
    reply, refused = call(servicer.BeginPublish, request)
    assert store.versions() == []  # nothing is readable without a commit
    if refused is not None:
        assert_refused_and_counted(servicer, refused, before)
        assert store.receiving() == [] and store.stats()["used_bytes"] == 0
        return
    assert reply.accepted and reply.session
    layout = store.session(reply.session).layout
    validate_manifest(layout, require_checksums=False, max_total_bytes=MAX_VERSION_BYTES)
    assert_self_consistent(layout)
    assert store.receiving() == [layout.version]
    # No chunk was sent: the commit is refused, counted, and the version never shows.
    commit = relay_pb2.CommitPublishRequest(session=reply.session, chunks_sent=len(layout.chunks),
                                            checksums=["0" * 32] * len(layout.chunks))
    _, refused = call(servicer.CommitPublish, commit)
    assert refused is not None and refused.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert store.versions() == [] and store.receiving() == []
    assert store.stats()["used_bytes"] == 0


def test_a_non_hex_checksum_in_begin_publish_is_a_protocol_error(servicer):
    manifest, _ = build_manifest(1, [("w", "uint8", (100,), bytes(100))], chunk_bytes=64)
    pb = manifest_to_proto(manifest)
    pb.chunks[1].checksum = "not hex"
    before = sum(servicer.rejected.values())
    _, refused = call(servicer.BeginPublish, relay_pb2.BeginPublishRequest(
        manifest=pb, origin=relay_pb2.ORIGIN_PUBLISHER, sender_id="fuzzer"))
    assert refused is not None and refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "chunk 1" in refused.details
    assert_refused_and_counted(servicer, refused, before)


def test_a_huge_claimed_size_is_refused_without_planning_its_chunks(monkeypatch):
    from laminar_common.relay import manifests as weights

    plan = weights.plan_chunks

    def bounded_plan(total_bytes: int, chunk_bytes: int):
        assert total_bytes <= 1024 * chunk_bytes, "planned the chunks of a claimed size"
        return plan(total_bytes, chunk_bytes)

    monkeypatch.setattr(weights, "plan_chunks", bounded_plan)
    manifest, _ = build_manifest(1, [("w", "uint8", (100,), bytes(100))], chunk_bytes=64)
    pb = manifest_to_proto(manifest)
    pb.total_bytes, pb.chunk_bytes = 2**63, 1
    with pytest.raises(ProtocolError, match="need 9223372036854775808 chunks, manifest lists 2"):
        validate_manifest(manifest_from_proto(pb))
