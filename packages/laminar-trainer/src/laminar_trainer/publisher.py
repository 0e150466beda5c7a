"""Asynchronous weight publishing: snapshot on the training thread, send in the background.

The training loop's only stall per publish is :meth:`WeightPublisher.snapshot`
(device-to-host copy of every parameter) plus handing the snapshot to the
sender thread. The sender hands it to the master relay (``RelayClient.publish``
returns once the master holds the whole version, verified, and etcd shows it
as ``weights/latest``); the relays spread it along the chain on their own.

If a new snapshot arrives while one is still being sent, the queued one (not
the in-flight one) is replaced: only the newest weights matter, and versions
stay increasing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

__all__ = ["WeightPublisher", "Snapshot", "snapshot_model", "snapshot_state", "torch_dtype_name"]

log = logging.getLogger(__name__)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the wire name of a dtype)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class Snapshot:
    version: int
    step: int
    tensors: list[tuple[str, str, tuple[int, ...], memoryview]]
    nbytes: int
    taken_s: float


def snapshot_model(model: torch.nn.Module, version: int, step: int) -> Snapshot:
    """Copy every parameter to host memory (the stall the trainer pays)."""
    return snapshot_state(model.state_dict(), version, step)


def snapshot_state(state: dict[str, torch.Tensor], version: int, step: int,
                   gathered_s: float = 0.0, copy: bool = True) -> Snapshot:
    """A snapshot of a state dict (host copies); ``gathered_s`` counts into its time
    (an FSDP trainer gathers the full state first). ``copy=False`` takes CPU tensors
    as they are: only for a state nothing else holds or changes (a fresh gather)."""
    t0 = time.perf_counter()
    tensors = []
    nbytes = 0
    for name, param in state.items():
        host = param.detach().to("cpu", copy=copy).contiguous().reshape(-1)
        view = memoryview(host.view(torch.uint8).numpy()) if host.numel() else memoryview(b"")
        tensors.append((name, torch_dtype_name(param.dtype), tuple(param.shape), view))
        nbytes += view.nbytes
    return Snapshot(version, step, tensors, nbytes, gathered_s + time.perf_counter() - t0)


@dataclass
class PublishStats:
    published: int = 0
    coalesced: int = 0
    failed: int = 0
    last_version: int = -1
    stall_s: list[float] = field(default_factory=list)
    send_s: list[float] = field(default_factory=list)


class WeightPublisher:
    """Owns one sender thread; ``publish_fn(version, tensors, step)`` does the send."""

    def __init__(self, publish_fn) -> None:
        self._publish_fn = publish_fn
        self._cond = threading.Condition()
        self._pending: Snapshot | None = None
        self._busy = False
        self._closed = False
        self.stats = PublishStats()
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> float:
        """Queue a snapshot for sending; returns the stall (snapshot + hand-off) in seconds."""
        t0 = time.perf_counter()
        with self._cond:
            if self._pending is not None:
                self.stats.coalesced += 1
            self._pending = snap
            self._cond.notify_all()
        stall = snap.taken_s + (time.perf_counter() - t0)
        self.stats.stall_s.append(stall)
        return stall

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                snap, self._pending = self._pending, None
                self._busy = True
            t0 = time.perf_counter()
            try:
                self._publish_fn(snap.version, snap.tensors, snap.step)
                self.stats.published += 1
                self.stats.last_version = snap.version
                self.stats.send_s.append(time.perf_counter() - t0)
                log.info("published weights v%d (%.1f MB) in %.3fs", snap.version,
                         snap.nbytes / 1e6, time.perf_counter() - t0)
            except Exception:  # top of a long-lived loop: keep training, log the failure
                self.stats.failed += 1
                log.exception("publishing weights v%d failed", snap.version)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy,
                                       timeout=timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        self.wait_idle(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
