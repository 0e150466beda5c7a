"""Weight buckets in shared-memory files, for engines whose workers live in other processes.

vLLM's multiprocess mode carries ``collective_rpc`` arguments with msgpack, which
turns a tensor into a plain list (vLLM 0.32: ``'list' object has no attribute
'dtype'`` in the worker). So a bucket crosses the process boundary as one file
in ``/dev/shm`` (a RAM-backed tmpfs: no disk I/O) plus a small manifest of plain
values; the worker maps the file and views each tensor out of it, so the bytes are
copied once (into the file) on the sending side and read in place on the other.

Invariants: a manifest's entries lie inside the file, in order, 64-byte aligned;
the sender owns the file and unlinks it once every worker answered (or failed);
the receiver checks the file's size against the manifest before viewing it.

This module imports torch only (no vLLM).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from laminar_common.errors import EngineError

_ALIGN = 64
_SHM = "/dev/shm"


@dataclass(frozen=True)
class BucketFile:
    """One bucket written to a file: what a worker needs to read it back.

    ``entries`` are ``(name, dtype name, shape, byte offset)``; all plain values, so
    the manifest survives any RPC serialiser (msgpack, pickle).
    """

    path: str
    size: int
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size,
                "entries": [[n, d, list(s), o] for n, d, s, o in self.entries]}


def _directory() -> str:
    return _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else tempfile.gettempdir()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@contextmanager
def bucket_file(bucket: Sequence[tuple[str, torch.Tensor]]) -> Iterator[BucketFile]:
    """Write ``bucket`` into a new shared-memory file; unlink it when the block ends."""
    entries = []
    offset = 0
    for name, tensor in bucket:
        offset = -(-offset // _ALIGN) * _ALIGN
        entries.append((name, str(tensor.dtype).removeprefix("torch."),
                        tuple(int(d) for d in tensor.shape), offset))
        offset += _nbytes(tensor)
    size = max(offset, 1)
    path = os.path.join(_directory(), f"laminar-weights-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with open(path, "wb") as fh:
            fh.truncate(size)
        buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        for (_, tensor), (_, _, _, off) in zip(bucket, entries):
            n = _nbytes(tensor)
            if n:
                flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                buf[off:off + n].copy_(flat)
        del buf
        yield BucketFile(path, size, tuple(entries))
    except OSError as exc:
        raise EngineError(f"could not write a weight bucket to {path}: {exc}") from exc
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def read_bucket(wire: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a :meth:`BucketFile.to_wire` manifest, viewed out of its file.

    Raises:
        EngineError: a missing or short file, an unknown dtype, or an entry outside it.
    """
    path, size = str(wire["path"]), int(wire["size"])
    try:
        actual = os.path.getsize(path)
    except OSError as exc:
        raise EngineError(f"weight bucket file {path} cannot be read: {exc}") from exc
    if actual != size:
        raise EngineError(f"weight bucket file {path} holds {actual} bytes, its manifest "
                          f"says {size}")
    buf = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    out = []
    for i, (name, dtype_name, shape, offset) in enumerate(wire["entries"]):
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise EngineError(f"weight bucket {path} entry {i} ({name}): unknown dtype "
                              f"{dtype_name!r}")
        shape = tuple(int(d) for d in shape)
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + n > size:
            raise EngineError(f"weight bucket {path} entry {i} ({name}): bytes "
                              f"{offset}..{offset + n} lie outside the file ({size} bytes)")
        out.append((str(name), buf[offset:offset + n].view(dtype).reshape(shape)))
    return out
