"""Delta versions: a weight version as the elements whose bits changed since its base.

After a small optimizer update most values of a bf16 model keep their bits,
so a version can travel as, per tensor, the indices of the elements whose
bits changed and their new bits. A delta is an ordinary set of named buffers
(published, chunked, checksummed and forwarded like a full version); its
manifest names its ``base_version`` and carries the full version's manifest
(``full``), so whoever applies it verifies the result against the full
version's own chunk checksums: a reconstruction is bit-exact or refused.

Encoding, per tensor ``T`` of the full layout whose bits changed:

- ``T#delta.idx``: element indices, strictly increasing (``uint32``, or
  ``uint64`` for tensors of 2**32 elements or more);
- ``T#delta.val``: the new bits of those elements, as unsigned words of the
  tensor's item size (``uint8/16/32/64``; an item size with no word, such as
  complex128, is compared as bytes).

plus ``#delta`` (``uint64 [base_version]``), so an empty delta (no bit
changed) is still a version. Comparison is on bits, never values: -0.0 vs
0.0 and NaN payloads are changes like any other.

Never imports torch; numpy is imported where a delta is built or applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from laminar_common.codec import TensorSpec, WeightManifest
from laminar_common.errors import ProtocolError
from laminar_common.relay.manifests import DTYPE_ITEMSIZE, verify_buffer

__all__ = [
    "DELTA_HEADER",
    "IDX_SUFFIX",
    "VAL_SUFFIX",
    "encode_delta",
    "apply_delta",
    "same_layout",
    "validate_delta",
]

DELTA_HEADER = "#delta"
IDX_SUFFIX = "#delta.idx"
VAL_SUFFIX = "#delta.val"
_WORDS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def _word(t: TensorSpec) -> tuple[str, int]:
    """``(word dtype, element count)`` the tensor's bits are compared in."""
    size = DTYPE_ITEMSIZE[t.dtype]
    if size in _WORDS:
        return _WORDS[size], t.nbytes // size
    return "uint8", t.nbytes


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
        word, count = _word(t)
        a = np.frombuffer(b_view, dtype=word, count=count, offset=t.offset)
        b = np.frombuffer(n_view, dtype=word, count=count, offset=t.offset)
        idx = np.flatnonzero(a != b)
        if idx.size == 0:
            continue
        idx = idx.astype(np.uint32 if count < 2**32 else np.uint64)
        out.append((t.name + IDX_SUFFIX, idx.dtype.name, (idx.size,), idx))
        out.append((t.name + VAL_SUFFIX, word, (idx.size,), np.ascontiguousarray(b[idx])))
    return out


def validate_delta(manifest: WeightManifest) -> None:
    """Check a delta manifest's own structure (not its bytes).

    Raises:
        ProtocolError: not a delta, a base that is not older, a full layout
            missing, a tensor that names no full tensor, an index without its
            values (or the other way), or mismatched dtypes and lengths.
    """
    v = manifest.version
    if manifest.full is None or manifest.base_version < 0:
        raise ProtocolError(f"version {v} is not a delta (no base_version or full manifest)")
    if not 0 <= manifest.base_version < v:
        raise ProtocolError(f"delta version {v} names base {manifest.base_version}, "
                            "which is not an older version")
    if manifest.full.version != v or manifest.full.full is not None:
        raise ProtocolError(f"delta version {v}: its full manifest says version "
                            f"{manifest.full.version} or is itself a delta")
    by_name = {t.name: t for t in manifest.full.tensors}
    parts = {t.name: t for t in manifest.tensors}
    header = parts.pop(DELTA_HEADER, None)
    if header is None or header.dtype != "uint64" or header.shape != (1,):
        raise ProtocolError(f"delta version {v}: no {DELTA_HEADER!r} header tensor")
    for name, t in parts.items():
        if name.endswith(IDX_SUFFIX):
            target, pair = name[: -len(IDX_SUFFIX)], name[: -len(IDX_SUFFIX)] + VAL_SUFFIX
        elif name.endswith(VAL_SUFFIX):
            target, pair = name[: -len(VAL_SUFFIX)], name[: -len(VAL_SUFFIX)] + IDX_SUFFIX
        else:
            raise ProtocolError(f"delta version {v}: tensor {name[:200]!r} is neither an "
                                "index nor a value list")
        full_t = by_name.get(target)
        if full_t is None:
            raise ProtocolError(f"delta version {v}: {name[:200]!r} names no tensor of the "
                                "full version")
        other = parts.get(pair)
        if other is None or len(t.shape) != 1 or other.shape != t.shape:
            raise ProtocolError(f"delta version {v}: {name[:200]!r} has no matching "
                                f"{pair[:200]!r} of the same length")
        word, count = _word(full_t)
        if name.endswith(IDX_SUFFIX):
            if t.dtype not in ("uint32", "uint64") or t.shape[0] > count:
                raise ProtocolError(f"delta version {v}: {name[:200]!r} is {t.dtype}"
                                    f"{list(t.shape)}, not a uint32/uint64 list of at most "
                                    f"{count} indices")
        elif t.dtype != word:
            raise ProtocolError(f"delta version {v}: {name[:200]!r} is {t.dtype}, "
                                f"{target!r} changes in {word} words")


def apply_delta(delta: WeightManifest, delta_bytes: Any, base: Any,
                out: bytearray | None = None) -> bytearray:
    """Rebuild the full version from its base and a delta, verified bit for bit.

    Args:
        delta: the delta's manifest (``base_version``, ``full``).
        delta_bytes: the delta's flat stream (verified against ``delta``).
        base: the base version's flat stream.
        out: where to build the result (``full.total_bytes``); default a new buffer.

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
    if out is None:
        out = bytearray(base_view)
    else:
        out[:] = base_view
    src = memoryview(delta_bytes).cast("B")
    parts = {t.name: t for t in delta.tensors}
    for t in full.tensors:
        idx_t = parts.get(t.name + IDX_SUFFIX)
        if idx_t is None:
            continue
        val_t = parts[t.name + VAL_SUFFIX]
        word, count = _word(t)
        idx = np.frombuffer(src, dtype=idx_t.dtype, count=idx_t.shape[0], offset=idx_t.offset)
        if idx.size and (int(idx[-1]) >= count or (idx.size > 1 and not
                                                     bool(np.all(idx[1:] > idx[:-1])))):
            raise ProtocolError(f"delta version {delta.version}: indices of {t.name!r} are "
                                f"out of range (< {count}) or not increasing")
        vals = np.frombuffer(src, dtype=val_t.dtype, count=val_t.shape[0], offset=val_t.offset)
        target = np.frombuffer(out, dtype=word, count=count, offset=t.offset)
        target[idx] = vals
    try:
        verify_buffer(full, out)
    except ProtocolError as exc:
        raise ProtocolError(f"delta version {delta.version} over base {delta.base_version} "
                            f"does not rebuild the full version: {exc}") from exc
    return out


def delta_fraction(delta: WeightManifest) -> float:
    """Bytes of the delta as a fraction of the full version's."""
    return delta.total_bytes / delta.full.total_bytes if delta.full else 1.0


def chain_bytes(manifests: Sequence[WeightManifest]) -> int:
    """Bytes a reader moves to take the given versions in order."""
    return sum(m.total_bytes for m in manifests)
