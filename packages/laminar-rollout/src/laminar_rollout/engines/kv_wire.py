"""An exported attention cache (:class:`~.base.KVState`) to and from the wire
(:class:`laminar_common.codec.KvCache`), for repack's KV transfer between workers.

Only engines with ``supports_kv_transfer`` produce or take one, and they have torch;
torch is imported here on first use so a worker without it never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from laminar_common.codec import KV_DTYPES, KvCache
from laminar_common.errors import EngineError

from .base import KVState

if TYPE_CHECKING:
    import torch

__all__ = ["kv_to_wire", "kv_from_wire"]


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise EngineError(f"a {name} KV cache cannot travel (dtypes: {sorted(KV_DTYPES)})")
    return name


def kv_to_wire(kv: KVState) -> KvCache:
    """Pack ``kv`` (CPU copies of every layer's keys then values) into one message field."""
    import torch

    if not kv.keys or len(kv.keys) != len(kv.values):
        raise EngineError(f"a KV cache of {len(kv.keys)}/{len(kv.values)} layers cannot travel")
    heads, n, head_dim = kv.keys[0].shape
    dtype = kv.keys[0].dtype
    tensors = [t for pair in zip(kv.keys, kv.values) for t in pair]
    for t in tensors:
        if tuple(t.shape) != (heads, n, head_dim) or t.dtype != dtype:
            raise EngineError(f"KV layers differ in shape or dtype ({tuple(t.shape)} {t.dtype} "
                              f"vs {(heads, n, head_dim)} {dtype}): cannot travel")
    flat = torch.cat([t.detach().to("cpu").contiguous().reshape(-1) for t in tensors])
    return KvCache(engine=kv.engine, dtype=_dtype_name(dtype), layers=len(kv.keys),
                   kv_heads=int(heads), head_dim=int(head_dim), num_tokens=int(n),
                   data=flat.view(torch.uint8).numpy().tobytes())


def kv_from_wire(blob: KvCache) -> KVState:
    """Unpack a received cache (its sizes were checked when its frame was decoded)."""
    import torch

    dtype = getattr(torch, blob.dtype)
    flat = torch.frombuffer(bytearray(blob.data), dtype=torch.uint8).view(dtype)
    per = blob.kv_heads * blob.num_tokens * blob.head_dim
    shape = (blob.kv_heads, blob.num_tokens, blob.head_dim)
    tensors = [flat[i * per:(i + 1) * per].reshape(shape) for i in range(2 * blob.layers)]
    return KVState(blob.engine, blob.num_tokens, tuple(tensors[0::2]), tuple(tensors[1::2]))
