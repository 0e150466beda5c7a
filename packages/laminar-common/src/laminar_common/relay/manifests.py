"""Weight versions as named byte buffers: layout, chunking, checksums, reassembly.

Owns the one mapping between named tensors ``(name, dtype, shape, bytes)`` and
a version's flat byte stream, and how that stream is cut into checksummed
chunks (:class:`~laminar_common.codec.WeightManifest`). The trainer uses it to
publish, relays to validate and verify, rollouts to reassemble.

Pure Python: never imports torch, numpy or any array library. A tensor is any
C-contiguous object with the buffer protocol (``bytes``, ``bytearray``,
``memoryview``, a numpy array, ``torch_tensor.view(torch.uint8).numpy()``).

Invariants:

- Tensor ``i`` starts at an offset aligned to ``alignment`` bytes (zero
  padding in between), so per-tensor views of the flat stream are aligned.
- Chunk ``k`` covers ``[k * chunk_bytes, min((k + 1) * chunk_bytes, total))``;
  every byte of the stream is in exactly one chunk.
- A checksum is a 16-byte digest as lowercase hex, computed as the manifest's
  ``checksum_algo`` says: xxh3-128 (``xxhash``; what publishers use: tens of
  GB/s per core) or blake2b-128 (manifests from before the field). It guards
  against corruption in transit and in memory, not against a malicious peer:
  that is authentication's job (``auth.dir``).
- Functions either return fully valid results or raise
  :class:`~laminar_common.errors.ProtocolError` (bad manifest or bytes) or
  ``ValueError`` (bad arguments from the caller); nothing is half-checked.
"""

from __future__ import annotations

import hashlib
import math
import string
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from laminar_common.codec import ChunkSpec, TensorSpec, WeightManifest
from laminar_common.errors import ProtocolError

__all__ = [
    "DTYPE_ITEMSIZE",
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "DEFAULT_ALIGNMENT",
    "NamedBuffer",
    "ChunkPayload",
    "as_named_buffers",
    "tensor_nbytes",
    "plan_tensors",
    "plan_chunks",
    "CHECKSUM_ALGORITHMS",
    "DEFAULT_CHECKSUM",
    "LEGACY_CHECKSUM",
    "checksum",
    "digest_of",
    "iter_chunks",
    "build_manifest",
    "flatten",
    "validate_manifest",
    "validate_delta",
    "delta_word",
    "DELTA_HEADER",
    "IDX_SUFFIX",
    "GAP_SUFFIX",
    "GZ_SUFFIX",
    "VAL_SUFFIX",
    "verify_chunk",
    "verify_buffer",
    "tensor_views",
    "assemble",
]

DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}
"""Bytes per element of every dtype name a manifest may use (torch's names)."""

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_ALIGNMENT = 64
_DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class NamedBuffer:
    """One tensor to publish: its name, dtype name, shape and raw bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """The bytes of one chunk, as zero-copy segments of the source tensors."""

    index: int
    offset: int
    nbytes: int
    segments: tuple[memoryview | bytes, ...]

    def contiguous(self) -> memoryview | bytes:
        """The chunk as one buffer (a copy only when it spans several tensors)."""
        if len(self.segments) == 1:
            return self.segments[0]
        return b"".join(self.segments)


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``.

    Raises:
        ValueError: unknown dtype or a negative dimension.
    """
    if dtype not in DTYPE_ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; known dtypes: {', '.join(DTYPE_ITEMSIZE)}")
    if any(int(d) < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative dimension")
    return math.prod(int(d) for d in shape) * DTYPE_ITEMSIZE[dtype]


def _byte_view(name: str, data: Any) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise ValueError(f"tensor {name!r}: {type(data).__name__} has no buffer protocol") from exc
    if not view.c_contiguous:
        raise ValueError(f"tensor {name!r} is not C-contiguous; make a contiguous copy first")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def as_named_buffers(
    tensors: Iterable[NamedBuffer | tuple[str, str, Sequence[int], Any]],
) -> list[NamedBuffer]:
    """Normalise ``(name, dtype, shape, data)`` tuples into checked :class:`NamedBuffer` s.

    Raises:
        ValueError: a duplicate or empty name, unknown dtype, non-contiguous
            data, or data whose size does not match dtype and shape.
    """
    out: list[NamedBuffer] = []
    seen: set[str] = set()
    for item in tensors:
        if isinstance(item, NamedBuffer):
            name, dtype, shape, data = item.name, item.dtype, item.shape, item.data
        else:
            name, dtype, shape, data = item
        if not name:
            raise ValueError("a tensor has an empty name")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        shape = tuple(int(d) for d in shape)
        view = _byte_view(name, data)
        want = tensor_nbytes(dtype, shape)
        if view.nbytes != want:
            raise ValueError(
                f"tensor {name!r}: {dtype}{list(shape)} needs {want} bytes, data has {view.nbytes}"
            )
        out.append(NamedBuffer(name, dtype, shape, view))
    if not out:
        raise ValueError("no tensors to publish")
    return out


def plan_tensors(
    buffers: Sequence[NamedBuffer], alignment: int = DEFAULT_ALIGNMENT
) -> tuple[tuple[TensorSpec, ...], int]:
    """Place each tensor in the flat stream; returns ``(specs, total_bytes)``."""
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    specs = []
    offset = 0
    for buf in buffers:
        offset = -(-offset // alignment) * alignment
        specs.append(TensorSpec(buf.name, buf.dtype, buf.shape, offset, buf.data.nbytes))
        offset += buf.data.nbytes
    return tuple(specs), offset


def plan_chunks(total_bytes: int, chunk_bytes: int) -> tuple[ChunkSpec, ...]:
    """Chunk layout of a stream, with empty checksums (filled in as chunks are hashed)."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    return tuple(
        ChunkSpec(i, off, min(chunk_bytes, total_bytes - off), "")
        for i, off in enumerate(range(0, total_bytes, chunk_bytes))
    )


DEFAULT_CHECKSUM = "xxh3-128"
"""What publishers checksum chunks with."""
LEGACY_CHECKSUM = "blake2b-128"
"""What a manifest without ``checksum_algo`` (an older peer's) was checksummed with."""
CHECKSUM_ALGORITHMS = (DEFAULT_CHECKSUM, LEGACY_CHECKSUM)


def _hasher(algo: str):
    if algo == DEFAULT_CHECKSUM:
        return xxhash.xxh3_128()
    if algo == LEGACY_CHECKSUM:
        return hashlib.blake2b(digest_size=_DIGEST_BYTES)
    raise ValueError(f"unknown checksum algorithm {algo!r}; known: "
                     f"{', '.join(CHECKSUM_ALGORITHMS)}")


def digest_of(data: Any | Sequence[Any], algo: str = DEFAULT_CHECKSUM) -> bytes:
    """The 16-byte digest of a buffer, or of the concatenation of a list of buffers.

    Raises:
        ValueError: ``algo`` is not one of :data:`CHECKSUM_ALGORITHMS`.
    """
    if algo == DEFAULT_CHECKSUM and not isinstance(data, (list, tuple)):
        return xxhash.xxh3_128_digest(data)
    h = _hasher(algo)
    for part in data if isinstance(data, (list, tuple)) else (data,):
        h.update(part)
    return h.digest()


def checksum(data: Any | Sequence[Any], algo: str = DEFAULT_CHECKSUM) -> str:
    """:func:`digest_of` as lowercase hex (what manifests carry)."""
    return digest_of(data, algo).hex()


def iter_chunks(
    buffers: Sequence[NamedBuffer], tensors: Sequence[TensorSpec], chunks: Sequence[ChunkSpec]
) -> Iterator[ChunkPayload]:
    """Yield each chunk's bytes as zero-copy segments of ``buffers`` (padding as zeros)."""
    pieces: list[tuple[int, memoryview | None, int]] = []  # (offset, data or padding, nbytes)
    cursor = 0
    for buf, spec in zip(buffers, tensors, strict=True):
        if spec.offset > cursor:
            pieces.append((cursor, None, spec.offset - cursor))
        pieces.append((spec.offset, buf.data, spec.nbytes))
        cursor = spec.offset + spec.nbytes
    p = 0
    for chunk in chunks:
        start, end = chunk.offset, chunk.offset + chunk.nbytes
        segments: list[memoryview | bytes] = []
        while p < len(pieces) and pieces[p][0] + pieces[p][2] <= start:
            p += 1
        q = p
        while q < len(pieces) and pieces[q][0] < end:
            off, data, n = pieces[q]
            lo, hi = max(start, off) - off, min(end, off + n) - off
            if hi > lo:
                segments.append(bytes(hi - lo) if data is None else data[lo:hi])
            q += 1
        yield ChunkPayload(chunk.index, chunk.offset, chunk.nbytes, tuple(segments))


def build_manifest(
    version: int,
    tensors: Iterable[NamedBuffer | tuple[str, str, Sequence[int], Any]],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    trainer_step: int = -1,
    alignment: int = DEFAULT_ALIGNMENT,
    created_at: float | None = None,
    checksum_algo: str = DEFAULT_CHECKSUM,
) -> tuple[WeightManifest, list[NamedBuffer]]:
    """Lay out, chunk and checksum ``tensors`` (one pass over the bytes, no copy).

    Returns:
        The complete manifest and the normalised buffers (feed both to
        :func:`iter_chunks` or :func:`flatten`).
    """
    if version < 0:
        raise ValueError(f"weight version must be >= 0, got {version}")
    buffers = as_named_buffers(tensors)
    specs, total = plan_tensors(buffers, alignment)
    layout = plan_chunks(total, chunk_bytes)
    chunks = tuple(
        ChunkSpec(p.index, p.offset, p.nbytes, checksum(list(p.segments), checksum_algo))
        for p in iter_chunks(buffers, specs, layout)
    )
    manifest = WeightManifest(
        version=version,
        total_bytes=total,
        chunk_bytes=chunk_bytes,
        tensors=specs,
        chunks=chunks,
        created_at=time.time() if created_at is None else created_at,
        trainer_step=trainer_step,
        checksum_algo=checksum_algo,
    )
    return manifest, buffers


def flatten(manifest: WeightManifest, buffers: Sequence[NamedBuffer]) -> bytearray:
    """Copy ``buffers`` into one flat stream laid out as ``manifest`` says."""
    out = bytearray(manifest.total_bytes)
    for buf, spec in zip(buffers, manifest.tensors, strict=True):
        out[spec.offset : spec.offset + spec.nbytes] = buf.data
    return out


# -- delta versions (built and applied in laminar_common.relay.delta) ---------------

DELTA_HEADER = "#delta"
IDX_SUFFIX = "#delta.idx"
GAP_SUFFIX = "#delta.gap"
GZ_SUFFIX = "#delta.gz"
VAL_SUFFIX = "#delta.val"
_INDEX_SUFFIXES = (IDX_SUFFIX, GAP_SUFFIX, GZ_SUFFIX)
_WORDS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def delta_word(t: TensorSpec) -> tuple[str, int]:
    """``(word dtype, element count)`` the tensor's bits are compared in."""
    size = DTYPE_ITEMSIZE[t.dtype]
    if size in _WORDS:
        return _WORDS[size], t.nbytes // size
    return "uint8", t.nbytes


def _split(name: str) -> tuple[str, str] | None:
    for suffix in (*_INDEX_SUFFIXES, VAL_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return None


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
        split = _split(name)
        if split is None:
            raise ProtocolError(f"delta version {v}: tensor {name[:200]!r} is neither an "
                                "index nor a value list")
        target, suffix = split
        full_t = by_name.get(target)
        if full_t is None:
            raise ProtocolError(f"delta version {v}: {name[:200]!r} names no tensor of the "
                                "full version")
        if len(t.shape) != 1:
            raise ProtocolError(f"delta version {v}: {name[:200]!r} is not one-dimensional")
        word, count = delta_word(full_t)
        if suffix == VAL_SUFFIX:
            index = [target + s for s in _INDEX_SUFFIXES if target + s in parts]
            if len(index) != 1:
                raise ProtocolError(f"delta version {v}: {name[:200]!r} has "
                                    f"{len(index) or 'no'} index lists (one of "
                                    f"{', '.join(_INDEX_SUFFIXES)}) beside it")
            if t.dtype != word or t.shape[0] > count:
                raise ProtocolError(f"delta version {v}: {name[:200]!r} is {t.dtype}"
                                    f"{list(t.shape)}, {target!r} changes in at most {count} "
                                    f"{word} words")
            continue
        val = parts.get(target + VAL_SUFFIX)
        if val is None:
            raise ProtocolError(f"delta version {v}: {name[:200]!r} has no matching "
                                f"{(target + VAL_SUFFIX)[:200]!r}")
        want = {IDX_SUFFIX: ("uint32", "uint64"), GAP_SUFFIX: ("uint16",),
                GZ_SUFFIX: ("uint8",)}[suffix]
        if t.dtype not in want or (suffix != GZ_SUFFIX and t.shape != val.shape):
            raise ProtocolError(f"delta version {v}: {name[:200]!r} is {t.dtype}"
                                f"{list(t.shape)}; it must be {'/'.join(want)} and, but for "
                                f"{GZ_SUFFIX!r}, as long as {(target + VAL_SUFFIX)[:200]!r}")


def validate_manifest(
    manifest: WeightManifest,
    *,
    max_total_bytes: int | None = None,
    max_tensors: int | None = None,
    require_checksums: bool = True,
) -> None:
    """Check that a manifest is self-consistent (and within limits).

    Args:
        max_total_bytes: refuse versions larger than this.
        max_tensors: refuse manifests listing more tensors than this.
        require_checksums: every chunk must carry a checksum (False while a
            publish is open: checksums then travel with the chunks; one that
            is given must still be valid).

    Raises:
        ProtocolError: the first problem found, naming the field.
    """
    v = manifest.version
    if v < 0:
        raise ProtocolError(f"manifest version {v} is negative")
    if manifest.full is not None:
        validate_manifest(manifest.full, max_total_bytes=max_total_bytes,
                          max_tensors=max_tensors)
        validate_delta(manifest)
    elif manifest.base_version != -1:
        raise ProtocolError(f"version {v} names base {manifest.base_version} but carries no "
                            "full manifest")
    _check_sizes(manifest, max_total_bytes, max_tensors)
    _check_chunks(manifest, require_checksums)
    _check_tensors(manifest)


def _check_sizes(manifest: WeightManifest, max_total_bytes: int | None,
                 max_tensors: int | None) -> None:
    v = manifest.version
    if manifest.total_bytes <= 0:
        raise ProtocolError(f"manifest of version {v} has total_bytes={manifest.total_bytes}")
    if max_total_bytes is not None and manifest.total_bytes > max_total_bytes:
        raise ProtocolError(
            f"version {v} is {manifest.total_bytes} bytes, over the limit of {max_total_bytes}"
        )
    if max_tensors is not None and len(manifest.tensors) > max_tensors:
        raise ProtocolError(
            f"version {v} lists {len(manifest.tensors)} tensors, over the limit of {max_tensors}"
        )
    if manifest.checksum_algo not in CHECKSUM_ALGORITHMS:
        raise ProtocolError(
            f"version {v}: unknown checksum_algo {manifest.checksum_algo[:40]!r} "
            f"(known: {', '.join(CHECKSUM_ALGORITHMS)})"
        )
    if not 0 < manifest.chunk_bytes <= MAX_CHUNK_BYTES:
        raise ProtocolError(
            f"version {v}: chunk_bytes={manifest.chunk_bytes} is outside 1..{MAX_CHUNK_BYTES}"
        )


def _check_chunks(manifest: WeightManifest, require_checksums: bool) -> None:
    """Exactly the chunks ``total_bytes`` and ``chunk_bytes`` plan, with valid checksums
    (a checksum may be left out only where not required)."""
    v = manifest.version
    # Counted before planning: a claimed size must not make us build its chunk list.
    n_chunks = -(-manifest.total_bytes // manifest.chunk_bytes)
    if len(manifest.chunks) != n_chunks:
        raise ProtocolError(
            f"version {v}: {manifest.total_bytes} bytes in chunks of {manifest.chunk_bytes} "
            f"need {n_chunks} chunks, manifest lists {len(manifest.chunks)}"
        )
    expected = plan_chunks(manifest.total_bytes, manifest.chunk_bytes)
    for got, want in zip(manifest.chunks, expected):
        if (got.index, got.offset, got.nbytes) != (want.index, want.offset, want.nbytes):
            raise ProtocolError(
                f"version {v}: chunk {want.index} should be (offset={want.offset}, "
                f"nbytes={want.nbytes}), manifest says (index={got.index}, "
                f"offset={got.offset}, nbytes={got.nbytes})"
            )
        if (require_checksums or got.checksum) and (
            len(got.checksum) != 2 * _DIGEST_BYTES or not _is_hex(got.checksum)
        ):
            raise ProtocolError(
                f"version {v}: chunk {got.index} has no valid {manifest.checksum_algo} checksum")


def _check_tensors(manifest: WeightManifest) -> None:
    """Named once each, sized as their dtype and shape say, inside the stream, apart."""
    v = manifest.version
    if not manifest.tensors:
        raise ProtocolError(f"version {v}: manifest lists no tensors")
    names: set[str] = set()
    spans = []
    for t in manifest.tensors:
        if not t.name or t.name in names:
            raise ProtocolError(f"version {v}: tensor name {t.name!r} is empty or repeated")
        names.add(t.name)
        try:
            want_bytes = tensor_nbytes(t.dtype, t.shape)
        except ValueError as exc:
            raise ProtocolError(f"version {v}: tensor {t.name!r}: {exc}") from exc
        if t.nbytes != want_bytes:
            raise ProtocolError(
                f"version {v}: tensor {t.name!r} {t.dtype}{list(t.shape)} is {want_bytes} "
                f"bytes, manifest says {t.nbytes}"
            )
        if t.offset < 0 or t.offset + t.nbytes > manifest.total_bytes:
            raise ProtocolError(
                f"version {v}: tensor {t.name!r} at [{t.offset}, {t.offset + t.nbytes}) "
                f"lies outside the {manifest.total_bytes}-byte stream"
            )
        spans.append((t.offset, t.offset + t.nbytes, t.name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ProtocolError(f"version {v}: tensors {a!r} and {b!r} overlap")


def _is_hex(text: str) -> bool:
    return all(c in string.hexdigits for c in text)


def verify_chunk(spec: ChunkSpec, data: Any, algo: str = DEFAULT_CHECKSUM) -> None:
    """Raise :class:`ProtocolError` unless ``data`` is chunk ``spec`` exactly
    (``algo``: the manifest's ``checksum_algo``)."""
    n = memoryview(data).nbytes
    if n != spec.nbytes:
        raise ProtocolError(f"chunk {spec.index} is {n} bytes, expected {spec.nbytes}")
    got = checksum(data, algo)
    if got != spec.checksum:
        raise ProtocolError(
            f"chunk {spec.index} failed its checksum (expected {spec.checksum}, got {got})"
        )


def verify_buffer(manifest: WeightManifest, buffer: Any) -> None:
    """Verify every chunk of a flat stream against ``manifest``."""
    view = memoryview(buffer).cast("B")
    if view.nbytes != manifest.total_bytes:
        raise ProtocolError(
            f"version {manifest.version} is {manifest.total_bytes} bytes, buffer has {view.nbytes}"
        )
    for spec in manifest.chunks:
        verify_chunk(spec, view[spec.offset : spec.offset + spec.nbytes], manifest.checksum_algo)


def tensor_views(manifest: WeightManifest, buffer: Any) -> dict[str, memoryview]:
    """Zero-copy byte views of each tensor in a flat stream, by name."""
    view = memoryview(buffer).cast("B")
    if view.nbytes < manifest.total_bytes:
        raise ProtocolError(
            f"version {manifest.version} is {manifest.total_bytes} bytes, buffer has {view.nbytes}"
        )
    return {t.name: view[t.offset : t.offset + t.nbytes] for t in manifest.tensors}


def assemble(manifest: WeightManifest, chunks: Mapping[int, Any]) -> bytearray:
    """Reassemble and verify a flat stream from its chunks (by index).

    Raises:
        ProtocolError: a chunk is missing, has the wrong size or checksum.
    """
    missing = [c.index for c in manifest.chunks if c.index not in chunks]
    if missing:
        raise ProtocolError(f"version {manifest.version}: missing chunks {missing[:10]}")
    out = bytearray(manifest.total_bytes)
    for spec in manifest.chunks:
        data = chunks[spec.index]
        verify_chunk(spec, data, manifest.checksum_algo)
        out[spec.offset : spec.offset + spec.nbytes] = data
    return out
