"""Delta versions: a weight version as the elements whose bits changed since its base.

After a small optimizer update most values of a bf16 model keep their bits,
so a version can travel as, per tensor, the indices of the elements whose
bits changed and their new bits. A delta is an ordinary set of named buffers
(published, chunked, checksummed and forwarded like a full version); its
manifest names its ``base_version`` and carries the full version's manifest
(``full``), so whoever applies it verifies the result against the full
version's own chunk checksums: a reconstruction is bit-exact or refused.

Encoding, per tensor ``T`` of the full layout whose bits changed:

- the element indices, strictly increasing, as one of
  ``T#delta.gz`` (``uint8``): the gaps between them (the first index, then
  each index minus the one before) as ``uint16``, zlib-compressed, used when
  every gap fits 16 bits and compression saves at least a fifth;
  ``T#delta.gap`` (``uint16``): those gaps uncompressed;
  ``T#delta.idx`` (``uint32``, or ``uint64`` for tensors of 2**32 elements or
  more): the indices themselves, when a gap does not fit 16 bits;
- ``T#delta.val``: the new bits of those elements, as unsigned words of the
  tensor's item size (``uint8/16/32/64``; an item size with no word, such as
  complex128, is compared as bytes);

plus ``#delta`` (``uint64 [base_version]``), so an empty delta (no bit
changed) is still a version. Comparison is on bits, never values: -0.0 vs
0.0 and NaN payloads are changes like any other.

A bf16 element that changed costs 2 bytes of value and, at the densities of
small updates (gaps of tens of elements), about 1 byte of compressed gap.

Never imports torch; numpy is imported where a delta is built or applied.
"""

from __future__ import annotations

import zlib
from typing import Any

from laminar_common.codec import TensorSpec, WeightManifest
from laminar_common.errors import ProtocolError
from laminar_common.relay.manifests import (
    DELTA_HEADER,
    GAP_SUFFIX,
    GZ_SUFFIX,
    IDX_SUFFIX,
    VAL_SUFFIX,
    delta_word,
    validate_delta,
    verify_buffer,
)

__all__ = [
    "DELTA_HEADER",
    "IDX_SUFFIX",
    "GAP_SUFFIX",
    "GZ_SUFFIX",
    "VAL_SUFFIX",
    "encode_delta",
    "apply_delta",
    "same_layout",
    "validate_delta",
]


def same_layout(a: WeightManifest, b: WeightManifest) -> bool:
    """True when ``b`` can be a delta over ``a``: the same tensors at the same places."""
    return a.total_bytes == b.total_bytes and a.tensors == b.tensors


def encode_delta(
    base_version: int, full: WeightManifest, base: Any, new: Any
) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """The named buffers of the delta that turns ``base`` into ``new``.

    Args:
        base_version: the version ``base`` holds.
        full: the manifest of the version ``new`` holds (same layout as the base's).
        base, new: the two flat streams (any buffer of ``full.total_bytes``).

    Returns:
        ``(name, dtype, shape, data)`` tuples for :func:`~.manifests.build_manifest`.
    """
    import numpy as np

    b_view, n_view = memoryview(base).cast("B"), memoryview(new).cast("B")
    if b_view.nbytes != full.total_bytes or n_view.nbytes != full.total_bytes:
        raise ValueError(f"delta of version {full.version}: streams of {b_view.nbytes} and "
                         f"{n_view.nbytes} bytes, the layout has {full.total_bytes}")
    out: list[tuple[str, str, tuple[int, ...], Any]] = [
        (DELTA_HEADER, "uint64", (1,), np.array([base_version], dtype=np.uint64))]
    for t in full.tensors:
        word, count = delta_word(t)
        a = np.frombuffer(b_view, dtype=word, count=count, offset=t.offset)
        b = np.frombuffer(n_view, dtype=word, count=count, offset=t.offset)
        idx = np.flatnonzero(a != b)
        if idx.size == 0:
            continue
        out.append(_index_part(t.name, idx, count))
        out.append((t.name + VAL_SUFFIX, word, (idx.size,), np.ascontiguousarray(b[idx])))
    return out


def _index_part(name: str, idx, count: int) -> tuple[str, str, tuple[int, ...], Any]:
    import numpy as np

    gaps = np.diff(idx, prepend=0)
    if int(gaps.max()) < 2**16:
        gaps16 = gaps.astype(np.uint16)
        packed = zlib.compress(gaps16.tobytes(), 1)
        if len(packed) * 5 <= gaps16.nbytes * 4:
            return name + GZ_SUFFIX, "uint8", (len(packed),), packed
        return name + GAP_SUFFIX, "uint16", (gaps16.size,), gaps16
    idx = idx.astype(np.uint32 if count < 2**32 else np.uint64)
    return name + IDX_SUFFIX, idx.dtype.name, (idx.size,), idx


def apply_delta(delta: WeightManifest, delta_bytes: Any, base: Any) -> bytearray:
    """Rebuild the full version from its base and a delta, verified bit for bit.

    Args:
        delta: the delta's manifest (``base_version``, ``full``).
        delta_bytes: the delta's flat stream (verified against ``delta``).
        base: the base version's flat stream.

    Returns:
        The full version's flat stream, every chunk checked against
        ``delta.full``'s checksums.

    Raises:
        ProtocolError: a malformed delta, an index out of range or out of
            order, or a result that fails the full version's checksums (the
            wrong base, or corrupt bytes).
    """
    import numpy as np

    validate_delta(delta)
    full = delta.full
    assert full is not None
    verify_buffer(delta, delta_bytes)
    base_view = memoryview(base).cast("B")
    if base_view.nbytes != full.total_bytes:
        raise ProtocolError(f"delta version {delta.version}: base stream is "
                            f"{base_view.nbytes} bytes, the full version {full.total_bytes}")
    out = bytearray(base_view)
    src = memoryview(delta_bytes).cast("B")
    parts = {t.name: t for t in delta.tensors}
    for t in full.tensors:
        val_t = parts.get(t.name + VAL_SUFFIX)
        if val_t is None:
            continue
        word, count = delta_word(t)
        n = val_t.shape[0]
        idx = _indices(delta.version, t.name, parts, src, n)
        if idx.size and (int(idx[-1]) >= count or (idx.size > 1 and not
                                                     bool(np.all(idx[1:] > idx[:-1])))):
            raise ProtocolError(f"delta version {delta.version}: indices of {t.name!r} are "
                                f"out of range (< {count}) or not increasing")
        vals = np.frombuffer(src, dtype=val_t.dtype, count=n, offset=val_t.offset)
        target = np.frombuffer(out, dtype=word, count=count, offset=t.offset)
        target[idx] = vals
    try:
        verify_buffer(full, out)
    except ProtocolError as exc:
        raise ProtocolError(f"delta version {delta.version} over base {delta.base_version} "
                            f"does not rebuild the full version: {exc}") from exc
    return out


def _indices(version: int, name: str, parts: dict[str, TensorSpec], src: memoryview, n: int):
    """The element indices of tensor ``name``'s changes, decoded (``int64``)."""
    import numpy as np

    if name + IDX_SUFFIX in parts:
        t = parts[name + IDX_SUFFIX]
        return np.frombuffer(src, dtype=t.dtype, count=n, offset=t.offset).astype(np.int64)
    if name + GAP_SUFFIX in parts:
        t = parts[name + GAP_SUFFIX]
        gaps = np.frombuffer(src, dtype=np.uint16, count=n, offset=t.offset)
    else:
        t = parts[name + GZ_SUFFIX]
        unpack = zlib.decompressobj()
        try:
            raw = unpack.decompress(src[t.offset : t.offset + t.nbytes], 2 * n + 1)
        except zlib.error as exc:
            raise ProtocolError(f"delta version {version}: {name + GZ_SUFFIX!r} does not "
                                f"decompress: {exc}") from exc
        if len(raw) != 2 * n or not unpack.eof:
            raise ProtocolError(f"delta version {version}: {name + GZ_SUFFIX!r} holds other "
                                f"than the {n} gaps of {name + VAL_SUFFIX!r}")
        gaps = np.frombuffer(raw, dtype=np.uint16)
    return np.cumsum(gaps, dtype=np.int64)
