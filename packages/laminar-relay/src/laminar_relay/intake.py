"""A relay's data-plane intake: chunks off the ZeroMQ receiver, checksummed and stored.

:class:`ChunkIntake` owns the data plane's receiving socket and the pool that
verifies and stores each chunk in the weight store. The hand-off is bounded
(twice the pool's threads): while the pool is busy the receive loop stops reading,
and ZeroMQ and TCP push back on the sender. A chunk the store refuses (an unknown
session, a wrong digest, a chunk past its version's size) is counted by reason and
logged (the first few of each), and never becomes visible: a version is sealed only
when every chunk of it is stored and verified. It never references the relay service.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from laminar_common.auth import CurveAuth
from laminar_common.errors import LaminarError
from laminar_common.relay.dataplane import ChunkFrame, ZmqChunkReceiver

from .config import DataPlaneConfig
from .store import UnknownSessionError, WeightStore

__all__ = ["ChunkIntake"]

log = logging.getLogger(__name__)

_LOG_FIRST = 20
"""Refused chunks logged per reason (all are counted)."""


class ChunkIntake:
    """The data plane's receiving end (see module docstring); listening once made."""

    def __init__(self, store: WeightStore, member_id: str, data: DataPlaneConfig, *,
                 bind_host: str, advertise_host: str, curve: CurveAuth | None,
                 stopping: threading.Event) -> None:
        self.store = store
        self.member_id = member_id
        self.stopping = stopping
        self.rejects: dict[str, int] = {}
        """Chunks the store refused, by reason."""
        self._pool = ThreadPoolExecutor(data.verify_threads, thread_name_prefix="relay-store")
        self._slots = threading.BoundedSemaphore(2 * data.verify_threads)
        self.receiver = ZmqChunkReceiver(
            self._on_chunk, bind_host=bind_host, advertise_host=advertise_host,
            port=data.port, max_chunk_bytes=data.max_chunk_bytes, hwm=data.send_hwm,
            name=f"data-plane-{member_id}", auth=curve)
        self.endpoint = self.receiver.endpoint

    def rejected(self) -> dict[str, int]:
        """Frames the receiver refused and chunks the store refused, by reason."""
        out = dict(self.receiver.stats.rejected)
        for key, value in self.rejects.items():
            out[key] = out.get(key, 0) + value
        return out

    def close(self) -> None:
        self.receiver.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _on_chunk(self, frame: ChunkFrame) -> None:
        # Bounded hand-off to the store pool: when it is busy the receive loop
        # stops reading, and ZeroMQ/TCP push back on the sender.
        while not self._slots.acquire(timeout=0.2):
            if self.stopping.is_set():
                return
        try:
            self._pool.submit(self._store_chunk, frame)
        except RuntimeError:
            self._slots.release()
            raise

    def _store_chunk(self, frame: ChunkFrame) -> None:
        try:
            self.store.write_chunk(frame.session, frame.index, frame.digest, frame.payload)
        except UnknownSessionError as exc:
            self._count_reject("unknown-session", exc)
        except LaminarError as exc:
            self._count_reject(type(exc).__name__, exc)
        finally:
            self._slots.release()

    def _count_reject(self, reason: str, exc: LaminarError) -> None:
        n = self.rejects.get(reason, 0) + 1
        self.rejects[reason] = n
        if n <= _LOG_FIRST:
            log.warning(
                "relay %s rejected a data-plane chunk (%s): %s", self.member_id, reason, exc
            )
