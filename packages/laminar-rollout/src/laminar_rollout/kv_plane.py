"""The worker-to-worker KV plane: a migrated trajectory's attention cache goes straight
from the source worker to the destination, not through the manager.

Repack hands a trajectory back to the manager with a :class:`~laminar_common.codec.KvRef`
(a few hundred bytes) instead of the cache. The source's :class:`KvPlane` holds the
cache and serves it once to whoever presents the ref's token; the destination worker
fetches it (:func:`fetch_kv`, off its decode loop) and checks that what arrived is what
the ref describes (shape, size, digest) before its engine takes it. Anything that goes
wrong (the source died, paused, expired or evicted the cache, or sent other bytes) ends
in a re-prefill on the destination, counted: the cache is an optimisation, never needed
for correctness. The manager's frame cap (64 MiB) no longer bounds the cache size.

One thread per plane owns its ROUTER socket (the transport's hello handshake, its frame
checks and CURVE when auth is on); the worker's loop only calls :meth:`KvPlane.offer`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass

from laminar_common import codec
from laminar_common.auth import CurveAuth
from laminar_common.codec import Hello, KvCache, KvFetch, KvMissing, KvRef
from laminar_common.errors import LaminarError, ProtocolError, TransportError
from laminar_common.roles import Role
from laminar_common.transport import make_client, make_server

from .version import __version__

__all__ = ["KvPlane", "KvFetchError", "fetch_kv", "FRAME_SLACK_BYTES"]

log = logging.getLogger(__name__)

FRAME_SLACK_BYTES = 1 << 16
"""What a cache's frame holds besides its data (header, field names, shape)."""


class KvFetchError(LaminarError):
    """A cache could not be fetched from its source (the destination re-prefills)."""


@dataclass(slots=True)
class _Held:
    blob: KvCache
    token: str
    expires: float


class KvPlane:
    """Holds exported caches and serves each once (see module docstring).

    ``max_bytes``: all held caches together; an offer beyond it evicts the oldest.
    ``hold_s``: a cache nobody fetched in this long is dropped.
    """

    def __init__(self, endpoint: str, member_id: str, *, max_bytes: int, hold_s: float,
                 advertise=None, auth: CurveAuth | None = None) -> None:
        self.member_id = member_id
        self.max_bytes = max_bytes
        self.hold_s = hold_s
        self._bind = endpoint
        self._advertise = advertise or (lambda e: e)
        self._auth = auth
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = ""
        self.counters: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._serve, name=f"kv-plane-{member_id}",
                                        daemon=True)

    def start(self, timeout_s: float = 10.0) -> KvPlane:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise TransportError(f"KV plane of {self.member_id} did not bind {self._bind}: "
                                 f"{self._error}")
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with self._lock:
            self._held.clear()
            self._bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def offer(self, trajectory_id: str, blob: KvCache) -> KvRef:
        """Hold ``blob`` for the destination; the ref to hand the manager instead of it."""
        token = secrets.token_hex(16)
        ref = KvRef(endpoint=self.endpoint, trajectory_id=trajectory_id, token=token,
                    engine=blob.engine, dtype=blob.dtype, layers=blob.layers,
                    kv_heads=blob.kv_heads, head_dim=blob.head_dim,
                    num_tokens=blob.num_tokens, nbytes=len(blob.data),
                    digest=codec.kv_digest(blob.data))
        with self._lock:
            self._drop(trajectory_id, None)  # an earlier export of the same id: superseded
            self._held[trajectory_id] = _Held(blob, token, time.monotonic() + self.hold_s)
            self._bytes += len(blob.data)
            while self._bytes > self.max_bytes and len(self._held) > 1:
                oldest = next(iter(self._held))
                self._drop(oldest, "evicted")
            self.counters["offered"] += 1
        return ref

    def _drop(self, tid: str, counter: str | None) -> None:
        held = self._held.pop(tid, None)
        if held is not None:
            self._bytes -= len(held.blob.data)
            if counter is not None:
                self.counters[counter] += 1
                log.info("KV cache of %s %s (not fetched)", tid, counter)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for tid in [t for t, h in self._held.items() if h.expires <= now]:
                self._drop(tid, "expired")

    def _take(self, msg: KvFetch) -> KvCache | KvMissing:
        with self._lock:
            held = self._held.get(msg.trajectory_id)
            if held is None:
                return KvMissing(trajectory_id=msg.trajectory_id,
                                 reason="not held here (served already, expired or evicted)")
            if not secrets.compare_digest(held.token, msg.token):
                self.counters["wrong_token"] += 1
                return KvMissing(trajectory_id=msg.trajectory_id, reason="wrong token")
            self._drop(msg.trajectory_id, None)
            self.counters["served"] += 1
            self.counters["served_bytes"] += len(held.blob.data)
            return held.blob

    def _serve(self) -> None:
        try:
            server = make_server(self._bind, member_id=f"{self.member_id}/kv",
                                 max_frame_bytes=FRAME_SLACK_BYTES, auth=self._auth)
            self.endpoint = self._advertise(server.endpoint)
        except (TransportError, ValueError) as exc:  # reported by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                got = server.recv(timeout_s=0.2)
                self._expire()
                if got is None:
                    continue
                peer, msg = got
                if isinstance(msg, Hello):
                    continue  # (welcomed by the transport)
                if not isinstance(msg, KvFetch):
                    self.counters["rejected"] += 1
                    log.warning("KV plane: %s sent a %s, not a fetch: ignored", peer,
                                type(msg).__name__)
                    continue
                reply = self._take(msg)
                try:
                    server.send(peer, reply)
                except TransportError as exc:  # the fetcher went away: it re-prefills
                    self.counters["send_failed"] += 1
                    log.warning("KV plane: cache of %s not delivered to %s: %s",
                                msg.trajectory_id, peer, exc)
                finally:
                    server.forget(peer)  # one fetch per connection
        finally:
            server.close()
            self.counters["rejected_frames"] += server.stats.rejected_total


_fetch_seq = itertools.count()


def fetch_kv(ref: KvRef, member_id: str, *, timeout_s: float, max_cache_bytes: int,
             auth: CurveAuth | None = None) -> KvCache:
    """The cache ``ref`` names, from its source, checked against the ref.

    Raises:
        KvFetchError: no answer in ``timeout_s``, the source no longer holds it, or what
            came is not what the ref describes (each naming the source and trajectory).
    """
    where = f"KV cache of {ref.trajectory_id} from {ref.endpoint}"
    if ref.nbytes > max_cache_bytes:
        raise KvFetchError(f"{where}: {ref.nbytes} bytes, over kv_transfer_max_mb")
    hello = Hello(member_id=f"{member_id}/kv-fetch-{next(_fetch_seq)}", role=Role.WORKER,
                  protocol_version=codec.PROTOCOL_VERSION, package_version=__version__)
    deadline = time.monotonic() + timeout_s
    client = make_client(ref.endpoint, hello, max_frame_bytes=ref.nbytes + FRAME_SLACK_BYTES,
                         send_timeout_s=timeout_s, auth=auth)
    try:
        try:
            client.connect(timeout_s=timeout_s)
            client.send(KvFetch(trajectory_id=ref.trajectory_id, token=ref.token))
            reply = client.recv(timeout_s=max(0.0, deadline - time.monotonic()))
        except (TransportError, ProtocolError) as exc:
            raise KvFetchError(f"{where}: {exc}") from exc
        if reply is None:
            raise KvFetchError(f"{where}: no answer in {timeout_s}s")
        if isinstance(reply, KvMissing):
            raise KvFetchError(f"{where}: {reply.reason}")
        if not isinstance(reply, KvCache):
            raise KvFetchError(f"{where}: answered with a {type(reply).__name__}")
        wrong = ref.describes(reply)
        if wrong is not None:
            raise KvFetchError(f"{where}: the cache that came is not the one named: {wrong}")
        return reply
    finally:
        client.close()
