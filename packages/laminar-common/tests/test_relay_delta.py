"""laminar_common.relay.delta: bit-exact delta versions over the published representation."""

from __future__ import annotations

import numpy as np
import pytest

from laminar_common.errors import ProtocolError
from laminar_common.relay.delta import (
    GAP_SUFFIX,
    GZ_SUFFIX,
    IDX_SUFFIX,
    VAL_SUFFIX,
    apply_delta,
    encode_delta,
    same_layout,
)
from laminar_common.relay.manifests import build_manifest, flatten, validate_manifest
from laminar_common.relay.wire import manifest_from_proto, manifest_to_proto


def _weights(rng, n=3000):
    b = rng.standard_normal((37,)).astype(np.float32)
    b[0] = 0.0
    return {"w": rng.standard_normal((n,)).astype(np.float32).view(np.uint16),  # "bf16"
            "b": b, "e": rng.integers(0, 255, (11,), dtype=np.uint8)}


def _manifest(version, weights, chunk=1024):
    return build_manifest(version, [
        ("w", "bfloat16", weights["w"].shape, weights["w"]),
        ("b", "float32", weights["b"].shape, weights["b"]),
        ("e", "uint8", weights["e"].shape, weights["e"])], chunk_bytes=chunk)


def _step(rng, weights, frac=0.02):
    """A small update: a few elements of each tensor change bits (one to -0.0 from 0.0)."""
    new = {k: v.copy() for k, v in weights.items()}
    for v in new.values():
        idx = rng.choice(v.size, max(1, int(frac * v.size)), replace=False)
        v.view(f"u{v.itemsize}")[idx] ^= 1
    new["b"][0] = -weights["b"][0]  # 0.0 <-> -0.0: equal values, other bits
    return new


def _delta(version, base_version, base_m, base_flat, new_weights):
    full, buffers = _manifest(version, new_weights)
    assert same_layout(base_m, full)
    new_flat = flatten(full, buffers)
    delta, dbuf = build_manifest(version, encode_delta(base_version, full, base_flat, new_flat),
                                 chunk_bytes=512)
    import msgspec
    delta = msgspec.structs.replace(delta, base_version=base_version, full=full)
    return full, new_flat, delta, flatten(delta, dbuf)


def _base(seed):
    """``(rng, weights, manifest, flat stream)`` of a version 1."""
    rng = np.random.default_rng(seed)
    w1 = _weights(rng)
    m1, b1 = _manifest(1, w1)
    return rng, w1, m1, flatten(m1, b1)


def test_a_delta_rebuilds_the_new_version_bit_for_bit_and_is_small():
    rng, w1, m1, flat1 = _base(0)
    w2 = _step(rng, w1)
    full2, flat2, delta, dflat = _delta(2, 1, m1, flat1, w2)
    validate_manifest(delta)
    assert delta.total_bytes < 0.2 * full2.total_bytes
    names = {t.name for t in delta.tensors}
    # 2% of "w" changed: gaps of ~50 elements, zlib-compressed; "b" and "e" are too short
    # for compression to pay.
    assert {"w" + GZ_SUFFIX, "w" + VAL_SUFFIX, "b" + GAP_SUFFIX, "e" + GAP_SUFFIX} <= names
    assert apply_delta(delta, dflat, flat1) == flat2  # -0.0 vs 0.0 counted as a change
    # Through the relay's protobuf form and back, unchanged.
    assert manifest_from_proto(manifest_to_proto(delta)) == delta


def test_an_unchanged_version_is_an_empty_delta():
    rng, w1, m1, flat1 = _base(1)
    _, flat2, delta, dflat = _delta(2, 1, m1, flat1, w1)
    assert [t.name for t in delta.tensors] == ["#delta"]
    assert apply_delta(delta, dflat, flat1) == flat2 == flat1


def test_the_wrong_base_or_a_corrupt_delta_is_refused_naming_the_version():
    rng, w1, m1, flat1 = _base(2)
    w2 = _step(rng, w1)
    _, flat2, delta, dflat = _delta(2, 1, m1, flat1, w2)
    w3 = _step(rng, w2)
    _, _, delta3, dflat3 = _delta(3, 2, m1, flat2, w3)
    with pytest.raises(ProtocolError, match=r"delta version 3 over base 2 does not rebuild"):
        apply_delta(delta3, dflat3, flat1)  # applied to version 1, not its base 2
    bad = bytearray(dflat)
    bad[-1] ^= 0xFF
    with pytest.raises(ProtocolError, match=r"failed its checksum"):
        apply_delta(delta, bad, flat1)


def test_a_malformed_delta_manifest_is_refused_with_the_field():
    import msgspec

    rng, w1, m1, flat1 = _base(3)
    _, _, delta, _ = _delta(2, 1, m1, flat1, _step(rng, w1))
    for change, message in [
        (dict(base_version=2), "names base 2, which is not an older version"),
        (dict(full=None), "names base 1 but carries no full manifest"),
        (dict(full=msgspec.structs.replace(delta.full, version=7)), "full manifest says version 7"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            validate_manifest(msgspec.structs.replace(delta, **change))
    # A value list without its indices, and a tensor naming no full tensor.
    extra = build_manifest(2, [("#delta", "uint64", (1,), np.zeros(1, np.uint64)),
                               ("w" + VAL_SUFFIX, "uint16", (2,), np.zeros(2, np.uint16)),
                               ])[0]
    with pytest.raises(ProtocolError, match=r"'w#delta.val' has no index lists"):
        validate_manifest(msgspec.structs.replace(extra, base_version=1, full=delta.full))
    ghost = build_manifest(2, [("#delta", "uint64", (1,), np.zeros(1, np.uint64)),
                               ("zz" + IDX_SUFFIX, "uint32", (1,), np.zeros(1, np.uint32)),
                               ("zz" + VAL_SUFFIX, "uint16", (1,), np.zeros(1, np.uint16))])[0]
    with pytest.raises(ProtocolError, match=r"'zz#delta.idx' names no tensor of the full"):
        validate_manifest(msgspec.structs.replace(ghost, base_version=1, full=delta.full))


def _crafted_case(seed):
    """A base version 1's flat stream and version 2's full manifest, for hand-made deltas."""
    rng, w1, _, flat1 = _base(seed)
    return flat1, _manifest(2, _step(rng, w1))[0]


def _apply_crafted(parts, full2, flat1):
    """Apply a hand-made delta (``#delta`` header added) of version 2 over version 1."""
    import msgspec

    header = ("#delta", "uint64", (1,), np.array([1], np.uint64))
    d, dbuf = build_manifest(2, [header, *parts])
    d = msgspec.structs.replace(d, base_version=1, full=full2)
    return apply_delta(d, flatten(d, dbuf), flat1)


def test_out_of_range_indices_are_refused_before_anything_is_written():
    flat1, full2 = _crafted_case(4)
    with pytest.raises(ProtocolError, match=r"indices of 'e' are out of range"):
        _apply_crafted([("e" + IDX_SUFFIX, "uint32", (2,), np.array([3, 11], np.uint32)),
                        ("e" + VAL_SUFFIX, "uint8", (2,), np.array([1, 2], np.uint8))],
                       full2, flat1)


def test_index_lists_that_do_not_decode_are_refused():
    import zlib

    flat1, full2 = _crafted_case(5)
    values = ("w" + VAL_SUFFIX, "uint16", (2,), np.array([1, 2], np.uint16))
    for packed, message in [(b"not zlib at all", "does not decompress"),
                            (zlib.compress(bytes(6)), r"holds other than the 2 gaps"),
                            (zlib.compress(bytes(4) + b"tail"), r"holds other than the 2 gaps")]:
        with pytest.raises(ProtocolError, match=message):
            _apply_crafted([("w" + GZ_SUFFIX, "uint8", (len(packed),), packed), values],
                           full2, flat1)
    # Gaps are counted from the previous index: a zero gap after the first repeats one.
    with pytest.raises(ProtocolError, match=r"indices of 'w' are out of range .* or not increasing"):
        _apply_crafted([("w" + GAP_SUFFIX, "uint16", (2,), np.array([5, 0], np.uint16)), values],
                       full2, flat1)
