"""The bulk data plane of the weight path: pushing checksummed chunks to a relay.

Owns one interface, :class:`ChunkSender` -> :class:`ChunkReceiver`, and its
ZeroMQ implementation (DEALER -> ROUTER over TCP, one multipart message per
chunk: ``[header, payload]``, payloads sent and received without copies).
The control side (opening and committing a publish session) is the relay's
gRPC API; this module only moves bytes. Another transport (NCCL, UCX) plugs
in by implementing both classes and a scheme in :func:`make_chunk_sender`.

Chunk header (fixed, big endian, 42 bytes)::

    magic b"LMDP" | protocol version (uint16) | session token (16 bytes)
    | chunk index (uint32) | blake2b-128 digest of the payload (16 bytes)

Invariants:

- A receiver hands its handler only well-formed frames (right size, magic
  and protocol version, payload within ``max_chunk_bytes``); anything else is
  counted in ``stats.rejected`` by reason, logged, and dropped. Hostile input
  never stops the receive loop.
- A sender never queues without bound: past ``hwm`` queued chunks a send
  blocks up to ``send_timeout_s`` and then raises :class:`TransportError`.
- Payloads are sent zero-copy: the caller must not modify a payload buffer
  until the receiver has confirmed the session (the relay's commit does).
- Sockets belong to one thread each; a receiver runs its own thread.
- With CURVE keys (``auth.dir``), a receiver is a CURVE server admitting only
  authorized client keys and a sender a CURVE client: an unauthenticated peer
  never completes the handshake, so none of its bytes reach the handler.
"""

from __future__ import annotations

import abc
import collections
import logging
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from laminar_common.auth import CurveAuth
from laminar_common.codec import PROTOCOL_VERSION
from laminar_common.errors import ProtocolError, TransportError
from laminar_common.net import bracket_host

__all__ = [
    "CHUNK_HEADER",
    "DATA_MAGIC",
    "SESSION_BYTES",
    "DIGEST_BYTES",
    "ChunkFrame",
    "DataPlaneStats",
    "ChunkSender",
    "ChunkReceiver",
    "ZmqChunkSender",
    "ZmqChunkReceiver",
    "encode_chunk_header",
    "decode_chunk_header",
    "make_chunk_sender",
]

log = logging.getLogger(__name__)

DATA_MAGIC = b"LMDP"
SESSION_BYTES = 16
DIGEST_BYTES = 16
CHUNK_HEADER = struct.Struct(f">4sH{SESSION_BYTES}sI{DIGEST_BYTES}s")
_ZERO_COPY_MIN = 64 * 1024
_LOG_FIRST_REJECTS = 20


@dataclass(frozen=True, slots=True)
class ChunkFrame:
    """One received chunk: which session and chunk it claims to be, and its bytes."""

    session: bytes
    index: int
    digest: bytes
    payload: memoryview


@dataclass
class DataPlaneStats:
    """Counters of one receiver."""

    received: int = 0
    received_bytes: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)


def encode_chunk_header(session: bytes, index: int, digest: bytes) -> bytes:
    """Pack a chunk header (see the module docstring)."""
    if len(session) != SESSION_BYTES or len(digest) != DIGEST_BYTES:
        raise ValueError(f"session and digest must be {SESSION_BYTES} bytes each")
    return CHUNK_HEADER.pack(DATA_MAGIC, PROTOCOL_VERSION, session, index, digest)


def decode_chunk_header(raw: bytes | memoryview) -> tuple[bytes, int, bytes]:
    """Unpack a chunk header into ``(session, index, digest)``.

    Raises:
        ProtocolError: wrong size, magic or protocol version.
    """
    if len(raw) != CHUNK_HEADER.size:
        raise ProtocolError(f"chunk header is {len(raw)} bytes, expected {CHUNK_HEADER.size}")
    magic, version, session, index, digest = CHUNK_HEADER.unpack(raw)
    if magic != DATA_MAGIC:
        raise ProtocolError(f"chunk header does not start with {DATA_MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"chunk speaks protocol version {version}, this process speaks {PROTOCOL_VERSION}"
        )
    return session, index, digest


class ChunkSender(abc.ABC):
    """Pushes chunks to one :class:`ChunkReceiver` endpoint (one thread uses it)."""

    endpoint: str

    @abc.abstractmethod
    def send(self, session: bytes, index: int, digest: bytes, payload: Any) -> None:
        """Queue one chunk. Raises :class:`TransportError` if it cannot be queued in time."""

    @abc.abstractmethod
    def close(self) -> None: ...


class ChunkReceiver(abc.ABC):
    """Receives chunks from any number of senders and hands them to a handler."""

    endpoint: str
    stats: DataPlaneStats

    @abc.abstractmethod
    def close(self) -> None: ...


class ZmqChunkSender(ChunkSender):
    """:class:`ChunkSender` over a ZeroMQ DEALER socket."""

    def __init__(
        self,
        endpoint: str,
        hwm: int = 8,
        send_timeout_s: float = 30.0,
        context: zmq.Context | None = None,
        auth: CurveAuth | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.send_timeout_s = send_timeout_s
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        if auth is not None:
            auth.apply_client(self._sock)
        self._sock.setsockopt(zmq.SNDHWM, max(1, hwm))
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        # Chunks still queued at close() are delivered for up to 2 s in the background.
        self._sock.setsockopt(zmq.LINGER, 2000)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise TransportError(f"cannot connect the data plane to {endpoint!r}: {exc}") from exc

    def send(self, session: bytes, index: int, digest: bytes, payload: Any) -> None:
        header = encode_chunk_header(session, index, digest)
        view = memoryview(payload)
        try:
            self._sock.send_multipart([header, view], copy=view.nbytes < _ZERO_COPY_MIN)
        except zmq.Again as exc:
            raise TransportError(
                f"data plane send of chunk {index} to {self.endpoint} did not get through in "
                f"{self.send_timeout_s:.0f}s: the receiver is gone or not reading"
            ) from exc
        except zmq.ZMQError as exc:
            raise TransportError(f"data plane send to {self.endpoint} failed: {exc}") from exc

    def close(self) -> None:
        self._sock.close()


class ZmqChunkReceiver(ChunkReceiver):
    """:class:`ChunkReceiver` on a ZeroMQ ROUTER socket, with its own receive thread.

    Args:
        handler: called with each well-formed :class:`ChunkFrame`, from the
            receive thread; it may block (that is the backpressure).
        bind_host: interface to bind (``0.0.0.0`` for all).
        advertise_host: host name senders use to reach this receiver.
        port: TCP port, 0 for any free one.
        max_chunk_bytes: larger payloads are rejected (and the socket refuses
            messages much larger than this outright).
    """

    def __init__(
        self,
        handler: Callable[[ChunkFrame], None],
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        port: int = 0,
        max_chunk_bytes: int = 64 * 1024 * 1024,
        hwm: int = 8,
        context: zmq.Context | None = None,
        name: str = "data-plane",
        auth: CurveAuth | None = None,
    ) -> None:
        self.stats = DataPlaneStats()
        self._handler = handler
        self._max_chunk_bytes = max_chunk_bytes
        self._name = name
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        if auth is not None:
            auth.apply_server(self._sock)  # only authorized CURVE clients get through
        self._sock.setsockopt(zmq.RCVHWM, max(1, hwm))
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_chunk_bytes + CHUNK_HEADER.size)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ":" in bind_host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(f"tcp://{bracket_host(bind_host)}:{port if port else '*'}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise TransportError(
                f"cannot bind the data plane on {bind_host}:{port}: {exc}"
            ) from exc
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(bound.rsplit(":", 1)[1])
        self.endpoint = f"tcp://{bracket_host(advertise_host or bind_host)}:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _reject(self, reason: str, detail: str) -> None:
        self.stats.rejected[reason] += 1
        n = self.stats.rejected[reason]
        if n <= _LOG_FIRST_REJECTS or n % 1000 == 0:
            log.warning("%s rejected a chunk (%s, %d so far): %s", self._name, reason, n, detail)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.error("%s receive failed: %s", self._name, exc)
                continue
            try:
                self._deliver(frames)
            except Exception:  # top of a long-lived loop: keep receiving
                log.exception("%s handler failed on a chunk", self._name)
                self.stats.rejected["handler-error"] += 1

    def _deliver(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 3:
            self._reject("malformed", f"{len(frames) - 1} frames in a message, expected 2")
            return
        try:
            session, index, digest = decode_chunk_header(frames[1].buffer)
        except ProtocolError as exc:
            self._reject("bad-header", str(exc))
            return
        payload = frames[2].buffer
        if payload.nbytes > self._max_chunk_bytes:
            self._reject("oversized", f"chunk of {payload.nbytes} bytes")
            return
        self.stats.received += 1
        self.stats.received_bytes += payload.nbytes
        self._handler(ChunkFrame(session, index, digest, payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sock.close(0)


def make_chunk_sender(endpoint: str, hwm: int = 8, send_timeout_s: float = 30.0,
                      auth: CurveAuth | None = None) -> ChunkSender:
    """A sender for ``endpoint``, chosen by its scheme (``tcp://`` -> ZeroMQ).

    Raises:
        TransportError: an endpoint scheme no data plane here speaks.
    """
    if endpoint.startswith("tcp://"):
        return ZmqChunkSender(endpoint, hwm=hwm, send_timeout_s=send_timeout_s, auth=auth)
    raise TransportError(f"no data plane for endpoint {endpoint!r} (this build speaks tcp://)")
