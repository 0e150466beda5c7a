"""A fetched weight version as torch tensors: the one place it happens.

The trainer's ``state_dict_from`` (a version read back) and the rollout's relay fetcher
(a version loaded into an engine) both call :func:`tensors_from`. torch is imported
when it is called, never when this module is: laminar-common itself needs no torch.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from laminar_common.errors import ProtocolError

if TYPE_CHECKING:
    from laminar_common.relay.client import FetchedWeights

__all__ = ["tensors_from"]


def tensors_from(fetched: FetchedWeights, *, copy: bool = False) -> dict[str, Any]:
    """The tensors of ``fetched``, by name in manifest order, as published (dtype, shape).

    Args:
        copy: False (default) gives zero-copy views of the fetched buffer, read-only
            when it is the relay's shared memory: do not write to them, and keep
            ``fetched`` (unreleased) while they are used. True gives tensors of their own.

    Raises:
        ProtocolError: a tensor's dtype is not a torch dtype.
    """
    import torch

    views = fetched.tensors()
    out: dict[str, Any] = {}
    for spec in fetched.manifest.tensors:
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"weight v{fetched.version}: tensor {spec.name!r} has unknown "
                                f"dtype {spec.dtype!r}")
        if spec.nbytes:
            with warnings.catch_warnings():
                # A shared-memory version is mapped read-only; views are only read.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(views[spec.name], dtype=dtype)
        else:
            flat = torch.empty(0, dtype=dtype)
        tensor = flat.reshape(spec.shape)
        out[spec.name] = tensor.clone() if copy else tensor
    return out
