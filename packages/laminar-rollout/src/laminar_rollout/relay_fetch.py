"""Turning relay versions into engine tensors (the rollout side of the weight path).

Owns what a worker loads (:class:`FetchedVersion`) and how it gets one
(:data:`WeightFetcher`, :func:`make_relay_fetcher`). Tensor dtypes travel as torch
dtype names without the ``torch.`` prefix (``float32``, ``bfloat16``); shapes and
byte offsets come from the manifest.
Views are zero-copy over the fetched buffer (shared memory on the same host); the
worker releases the relay's reader lease once the engine copied them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from laminar_common.errors import ProtocolError, TransportError
from laminar_common.relay.client import FetchedWeights, RelayClient
from laminar_common.relay.tensors import tensors_from
from laminar_common.relay.wire import VersionNotFoundError

__all__ = ["make_relay_fetcher", "FetchedVersion", "WeightFetcher"]


class FetchedVersion:
    """One weight version ready to load: named tensors (None for the simulated
    engine) and a ``release`` to call once the engine has copied them.
    ``wire_bytes``: version bytes moved to get it; ``delta``: rebuilt from deltas."""

    def __init__(self, version: int, tensors: Iterable[tuple[str, Any]] | None,
                 release: Callable[[], None] | None = None, *, wire_bytes: int = 0,
                 delta: bool = False) -> None:
        self.version = version
        self.tensors = tensors
        self._release = release
        self.wire_bytes = wire_bytes
        self.delta = delta

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


WeightFetcher = Callable[[int], FetchedVersion]
"""``fetch(version) -> FetchedVersion``."""


def make_relay_fetcher(client: RelayClient, *, with_tensors: bool = True,
                       wait_s: float = 60.0) -> WeightFetcher:
    """A :data:`WeightFetcher` reading from the relay tier.

    A pull asks for "version ``v`` or newer": when ``v`` itself can no longer be
    had, the latest version is taken if it is at least ``v``.

    Delta versions (a trainer with ``delta_full_every``): once a version came as
    a delta, the fetcher keeps the version it loaded (its own copy, never a
    shared-memory mapping) as the base the next delta applies to, so each later
    pull moves only the delta's bytes. Until the first delta, nothing is kept.

    Args:
        with_tensors: False for the simulated engine (bytes are fetched, so the
            weight-wait is real, but nothing is loaded).
    """

    held: list[FetchedWeights] = []  # the base for the next delta (at most one)

    def fetch(version: int) -> FetchedVersion:
        base = held[0] if held else None
        try:
            fetched = client.fetch(version, wait_s=wait_s, base=base)
        except (VersionNotFoundError, TransportError) as exc:
            # The version may be gone (superseded, or its relay died): any newer one will do.
            fetched = client.fetch(None, wait_s=wait_s, base=base)
            if fetched.version < version:
                fetched.release()
                raise VersionNotFoundError(
                    f"weight version {version} is unavailable and the latest is "
                    f"{fetched.version}") from exc
        if fetched.source == "delta" or (held and fetched.source == "stream"):
            held[:] = [fetched]  # its own memory: the base of the next delta
        else:
            held.clear()
        extra = {"wire_bytes": fetched.wire_bytes, "delta": fetched.source == "delta"}
        if not with_tensors:
            return FetchedVersion(fetched.version, None, fetched.release, **extra)
        import torch

        try:
            # Read-only views of the relay's buffer: engines copy them into their own
            # parameters before release() and never write through them.
            tensors = tensors_from(fetched, torch)
        except ProtocolError:
            fetched.release()
            raise
        return FetchedVersion(fetched.version, tensors, fetched.release, **extra)

    return fetch
