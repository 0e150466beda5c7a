"""Publishing a PyTorch state dict through the relay tier, and loading one back.

For a plain PyTorch loop (a custom stack): :func:`publish_state_dict` hands a
``state_dict()`` to the master relay as one weight version, using the same
host snapshot as Laminar's own trainer (:func:`~laminar_trainer.publisher.snapshot_state`);
:func:`load_into` and :func:`state_dict_from` turn a fetched version back into
tensors. The bytes travel unchanged: a tensor fetched is bit-identical to the
one published (after the optional ``dtype`` cast).

Versions are the caller's to number: each must be greater than the published
one (``RelayClient.latest()``), and a published version is immutable.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future

import torch

from laminar_common.errors import LaminarError
from laminar_common.relay.client import FetchedWeights, PublishResult, RelayClient
from laminar_common.relay.tensors import tensors_from

from .publisher import snapshot_state

__all__ = ["publish_state_dict", "state_dict_from", "load_into"]


def publish_state_dict(client: RelayClient, state_dict: Mapping[str, torch.Tensor], version: int,
                       *, step: int = -1, dtype: torch.dtype | None = None,
                       wait: bool = True) -> PublishResult | Future[PublishResult]:
    """Publish ``state_dict`` as weight ``version``.

    Args:
        client: a :class:`~laminar_common.relay.client.RelayClient` of the job.
        state_dict: name -> tensor (``module.state_dict()``), on any device.
        version: the new version; greater than the one published before.
        step: your training step, recorded with the version.
        dtype: cast floating-point tensors to this first (the rollout's dtype,
            e.g. ``torch.bfloat16``); None publishes them as they are.
        wait: True returns once the master relay holds the whole version,
            verified, and etcd shows it as latest (the chain spreads it after
            that). False takes a host copy and publishes it in the background:
            the returned future completes with the result, and training may
            change the tensors meanwhile.

    Raises:
        VersionConflictError: ``version`` is not newer than the published one.
        TransportError: no master relay took the version in time.
        ValueError: an empty state dict, or a tensor the relay cannot carry.
    """
    # A blocking publish reads CPU tensors in place (nothing changes them meanwhile); a
    # background one needs its own copy (a cast tensor is one already).
    snap = snapshot_state(dict(state_dict), version, step, copy=not wait, dtype=dtype)
    if wait:
        return client.publish(version, snap.tensors, trainer_step=step)
    return client.publish_async(version, snap.tensors, trainer_step=step)


def state_dict_from(fetched: FetchedWeights, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a fetched version, by name, as published (dtype and shape).

    Args:
        copy: True gives tensors of their own; False gives read-only views of
            the fetched buffer (no copy; do not write to them, and keep
            ``fetched`` alive while they are used).

    Raises:
        ProtocolError: a tensor's dtype is not a torch dtype.
    """
    return dict(tensors_from(fetched, torch, copy=copy))


def load_into(module: torch.nn.Module, fetched: FetchedWeights, *, strict: bool = True) -> int:
    """Copy a fetched version into ``module``'s parameters and buffers; returns its version.

    Tensors are copied straight from the fetched buffer (cast to each
    parameter's dtype and device). ``strict`` as for ``load_state_dict``.

    Raises:
        LaminarError: the version does not fit the module (missing or unexpected
            names, other shapes).
    """
    tensors = state_dict_from(fetched, copy=False)
    try:
        module.load_state_dict(tensors, strict=strict)
    except RuntimeError as exc:
        raise LaminarError(f"weight v{fetched.version} does not fit "
                           f"{type(module).__name__}: {exc}") from exc
    return fetched.version
