"""laminar_common.relay.manifests: layout, chunking, checksums, reassembly."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_common.errors import ProtocolError
from laminar_common.relay.manifests import (
    as_named_buffers,
    assemble,
    build_manifest,
    checksum,
    flatten,
    iter_chunks,
    tensor_views,
    validate_manifest,
    verify_buffer,
    verify_chunk,
)


def _tensors():
    return [
        ("a", "float32", (3, 5), os.urandom(60)),
        ("b", "bfloat16", (7,), bytearray(os.urandom(14))),
        ("c", "uint8", (1000,), memoryview(os.urandom(1000))),
    ]


def test_manifest_lays_out_aligned_tensors_and_chunks_cover_the_stream():
    manifest, buffers = build_manifest(4, _tensors(), chunk_bytes=100, alignment=64, trainer_step=9)
    offsets = [t.offset for t in manifest.tensors]
    assert offsets == [0, 64, 128]
    assert manifest.total_bytes == 128 + 1000
    assert [c.offset for c in manifest.chunks] == list(range(0, 1128, 100))
    assert sum(c.nbytes for c in manifest.chunks) == manifest.total_bytes
    assert manifest.trainer_step == 9
    flat = flatten(manifest, buffers)
    assert flat[60:64] == bytes(4)  # padding is zeros
    for spec in manifest.chunks:
        assert spec.checksum == checksum(flat[spec.offset : spec.offset + spec.nbytes])
    validate_manifest(manifest)
    verify_buffer(manifest, flat)


def test_reassembly_from_chunks_gives_every_tensor_back():
    tensors = _tensors()
    manifest, buffers = build_manifest(1, tensors, chunk_bytes=77)
    chunks = {
        p.index: p.contiguous() for p in iter_chunks(buffers, manifest.tensors, manifest.chunks)
    }
    flat = assemble(manifest, chunks)
    views = tensor_views(manifest, flat)
    assert {name: bytes(views[name]) for name in views} == {n: bytes(d) for n, _, _, d in tensors}


def test_assemble_refuses_missing_or_corrupt_chunks():
    manifest, buffers = build_manifest(1, _tensors(), chunk_bytes=256)
    chunks = {
        p.index: bytes(p.contiguous())
        for p in iter_chunks(buffers, manifest.tensors, manifest.chunks)
    }
    missing = dict(chunks)
    del missing[2]
    with pytest.raises(ProtocolError, match=r"missing chunks \[2\]"):
        assemble(manifest, missing)
    corrupt = dict(chunks)
    corrupt[1] = b"\x00" + corrupt[1][1:] if corrupt[1][0] else b"\x01" + corrupt[1][1:]
    with pytest.raises(ProtocolError, match="chunk 1 failed its checksum"):
        assemble(manifest, corrupt)
    with pytest.raises(ProtocolError, match="bytes, expected"):
        verify_chunk(manifest.chunks[0], chunks[0][:-1])


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([("a", "float32", (2,), bytes(7))], "needs 8 bytes, data has 7"),
        ([("a", "float33", (2,), bytes(8))], "unknown dtype 'float33'"),
        ([("a", "uint8", (1,), b"x"), ("a", "uint8", (1,), b"y")], "appears twice"),
        ([("", "uint8", (1,), b"x")], "empty name"),
        ([("a", "uint8", (2,), memoryview(b"abcd")[::2])], "not C-contiguous"),
        ([], "no tensors"),
    ],
)
def test_bad_tensors_are_refused_with_the_reason(tensors, message):
    with pytest.raises(ValueError, match=message):
        as_named_buffers(tensors)


def _edit(manifest, **changes):
    fields = {f: getattr(manifest, f) for f in manifest.__struct_fields__}
    fields.update(changes)
    return type(manifest)(**fields)


def test_validate_manifest_names_each_inconsistency():
    manifest, _ = build_manifest(2, _tensors(), chunk_bytes=100)
    t = manifest.tensors
    cases = [
        (_edit(manifest, chunks=manifest.chunks[:-1]), "need 12 chunks, manifest lists 11"),
        (
            _edit(manifest, tensors=(t[0], type(t[1])("b", "bfloat16", (7,), 10, 14), t[2])),
            "overlap",
        ),
        (
            _edit(manifest, tensors=(type(t[0])("a", "float32", (3, 5), 0, 61),) + t[1:]),
            "is 60 bytes",
        ),
        (
            _edit(manifest, tensors=t[:2] + (type(t[2])("c", "uint8", (1000,), 200, 1000),)),
            "outside the 1128-byte stream",
        ),
        (_edit(manifest, chunk_bytes=0), "chunk_bytes=0"),
        (_edit(manifest, total_bytes=0), "total_bytes=0"),
        (_edit(manifest, tensors=()), "no tensors"),
    ]
    for bad, message in cases:
        with pytest.raises(ProtocolError, match=message):
            validate_manifest(bad)
    no_sums = _edit(manifest, chunks=tuple(_edit(c, checksum="") for c in manifest.chunks))
    with pytest.raises(ProtocolError, match="no valid xxh3-128 checksum"):
        validate_manifest(no_sums)
    validate_manifest(no_sums, require_checksums=False)
    with pytest.raises(ProtocolError, match="over the limit of 1000"):
        validate_manifest(manifest, max_total_bytes=1000)
    with pytest.raises(ProtocolError, match="3 tensors, over the limit of 2"):
        validate_manifest(manifest, max_tensors=2)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=6),
    chunk_bytes=st.integers(min_value=1, max_value=700),
    alignment=st.sampled_from([1, 8, 64]),
)
def test_chunks_concatenate_to_the_flat_stream(sizes, chunk_bytes, alignment):
    tensors = [(f"t{i}", "uint8", (n,), os.urandom(n)) for i, n in enumerate(sizes)]
    if sum(sizes) == 0:
        tensors.append(("pad", "uint8", (1,), b"z"))
    manifest, buffers = build_manifest(0, tensors, chunk_bytes=chunk_bytes, alignment=alignment)
    joined = b"".join(
        bytes(p.contiguous()) for p in iter_chunks(buffers, manifest.tensors, manifest.chunks)
    )
    assert joined == bytes(flatten(manifest, buffers))
    validate_manifest(manifest)


def test_chunks_are_checksummed_with_xxh3_128_and_a_legacy_manifest_still_verifies():
    import hashlib

    import msgspec
    import xxhash

    manifest, buffers = build_manifest(1, _tensors(), chunk_bytes=100)
    assert manifest.checksum_algo == "xxh3-128"
    flat = flatten(manifest, buffers)
    first = manifest.chunks[0]
    assert first.checksum == xxhash.xxh3_128_hexdigest(bytes(flat[:100]))
    verify_buffer(manifest, flat)
    # A manifest an older publisher made (blake2b-128, no field): still verified as such.
    old, old_buffers = build_manifest(1, _tensors(), chunk_bytes=100,
                                      checksum_algo="blake2b-128")
    assert old.chunks[0].checksum == hashlib.blake2b(
        bytes(flatten(old, old_buffers)[:100]), digest_size=16).hexdigest()
    verify_buffer(old, flatten(old, old_buffers))
    # ... and the same bytes under the other algorithm's checksums fail.
    swapped = msgspec.structs.replace(manifest, checksum_algo="blake2b-128")
    with pytest.raises(ProtocolError, match="chunk 0 failed its checksum"):
        verify_buffer(swapped, flat)
    with pytest.raises(ProtocolError, match=r"unknown checksum_algo 'md5'"):
        validate_manifest(msgspec.structs.replace(manifest, checksum_algo="md5"))


def test_a_proto_manifest_without_the_algorithm_is_read_as_blake2b():
    from laminar_common.relay.wire import manifest_from_proto, manifest_to_proto

    manifest, _ = build_manifest(3, _tensors(), chunk_bytes=256)
    pb = manifest_to_proto(manifest)
    assert manifest_from_proto(pb) == manifest
    pb.ClearField("checksum_algo")  # what a relay or trainer from before the field sends
    assert manifest_from_proto(pb).checksum_algo == "blake2b-128"
