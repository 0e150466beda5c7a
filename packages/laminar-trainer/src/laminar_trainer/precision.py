"""Precision of training, publishing and saving: dtype names, autocast, FSDP2's policy.

The trainer keeps its master weights and optimizer state in float32 whatever
``dtype`` says. ``bfloat16`` is mixed precision: forward and backward run
under :func:`autocast` (one process) or with FSDP2's
:func:`mixed_precision_policy` (bf16 parameters in the forward, float32
gradient reduction); the logits are cast to float32 before any log-softmax
(``laminar_trainer.logprobs``), so log-probs, the loss and the NaN guards are
float32. Published and exported weights are cast copies (:func:`cast_floating`);
integer tensors are never cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

__all__ = ["DTYPES", "SHORT_NAMES", "autocast", "cast_floating", "mixed_precision_policy",
           "torch_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names of the configs (torch's names without ``torch.``)."""
SHORT_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Short names (``laminar-trainer export --dtype``) -> dtype names."""


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"bf16"``) -> ``torch.bfloat16``.

    Raises:
        ValueError: not one of :data:`DTYPES` or :data:`SHORT_NAMES`.
    """
    full = SHORT_NAMES.get(name, name)
    if full not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of "
                         f"{', '.join([*DTYPES, *SHORT_NAMES])}")
    return DTYPES[full]


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """The forward/backward context of a training ``dtype`` on ``device``: a no-op for
    float32, ``torch.autocast(device.type, dtype=...)`` for bfloat16 (CPU and CUDA)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch_dtype(dtype))


def mixed_precision_policy(dtype: str):
    """FSDP2's ``MixedPrecisionPolicy`` for a training ``dtype`` (None for float32):
    parameters all-gathered and used in ``dtype``, gradients reduced in float32, the
    sharded master parameters float32."""
    if dtype == "float32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch_dtype(dtype), reduce_dtype=torch.float32)


def cast_floating(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None
                  ) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point tensor cast to ``dtype`` (None: as it is);
    tensors already in ``dtype`` and non-floating ones are the same objects."""
    if dtype is None:
        return dict(state)
    return {name: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
            for name, t in state.items()}
