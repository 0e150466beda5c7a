"""A fetched weight version as tensors: the one conversion both tiers use.

The trainer (:func:`laminar_trainer.publishing.state_dict_from`, ``load_into``) and
the rollout (``laminar_rollout.relay_fetch``) read a version with
:func:`tensors_from`, passing their ``torch`` module: laminar-common never imports an
array library (it installs and runs without torch). Dtypes travel as torch dtype names
without the ``torch.`` prefix (``float32``, ``bfloat16``); shapes come from the
manifest.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from laminar_common.errors import ProtocolError

if TYPE_CHECKING:
    from laminar_common.relay.client import FetchedWeights

__all__ = ["tensors_from"]


def tensors_from(fetched: FetchedWeights, torch: Any, *, copy: bool = False) -> list[tuple[str, Any]]:
    """``(name, tensor)`` for each tensor of ``fetched``, in manifest order, with its
    published dtype and shape.

    Args:
        torch: the caller's ``torch`` module (what builds the tensors).
        copy: True gives tensors of their own; False (default) read-only views of the
            fetched buffer (zero-copy, shared memory on the same host): never write
            through them, and keep ``fetched`` (unreleased) while they are used.

    Raises:
        ProtocolError: a tensor's dtype is not a torch dtype (names the version and
            the tensor).
    """
    views = fetched.tensors()
    out = []
    for spec in fetched.manifest.tensors:
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"weight v{fetched.version}: tensor {spec.name!r} has unknown "
                                f"dtype {spec.dtype!r}")
        if spec.nbytes:
            with warnings.catch_warnings():
                # A shared-memory version is mapped read-only; these views are only read.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(views[spec.name], dtype=dtype)
        else:
            flat = torch.empty(0, dtype=dtype)
        tensor = flat.reshape(spec.shape)
        out.append((spec.name, tensor.clone() if copy else tensor))
    return out
