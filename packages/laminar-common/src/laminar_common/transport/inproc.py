"""The in-memory twin of the ZeroMQ transports (unit tests, one process): the same
interface and codec, queues instead of sockets."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from laminar_common import codec
from laminar_common.codec import Hello, Message, Welcome
from laminar_common.errors import ProtocolError, TransportError

from .base import (
    INPROC,
    Client,
    PullReceiver,
    PushSender,
    Server,
    TransportStats,
    _client_handle_welcome,
    _reason_of,
    _Rejector,
    _ServerCore,
    default_accept,
)

log = logging.getLogger("laminar_common.transport")

# --------------------------------------------------------------------------
# Inproc twin (unit tests): same interface, same codec, queues instead of sockets
# --------------------------------------------------------------------------


class InprocHub:
    """Name -> queue registry standing in for the network in unit tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue[tuple[str, bytes]]] = {}
        self._servers: dict[str, InprocServer] = {}
        self._count = 0

    def bind(self, name: str | None = None) -> tuple[str, queue.Queue[tuple[str, bytes]]]:
        with self._lock:
            if name is None:
                self._count += 1
                name = f"{INPROC}twin-{self._count}"
            if name in self._queues:
                raise TransportError(f"cannot bind {name}: address in use")
            q: queue.Queue[tuple[str, bytes]] = queue.Queue()
            self._queues[name] = q
            return name, q

    def lookup(self, name: str) -> queue.Queue[tuple[str, bytes]]:
        with self._lock:
            if name not in self._queues:
                raise TransportError(f"cannot connect to {name}: nothing bound there")
            return self._queues[name]

    def unbind(self, name: str) -> None:
        with self._lock:
            self._queues.pop(name, None)
            self._servers.pop(name, None)

    def add_server(self, server: InprocServer) -> None:
        with self._lock:
            self._servers[server.endpoint] = server

    def server_at(self, name: str) -> InprocServer:
        with self._lock:
            server = self._servers.get(name)
        if server is None:
            raise TransportError(f"cannot connect to {name}: no server bound there")
        return server


_DEFAULT_HUB = InprocHub()


def default_hub() -> InprocHub:
    """The process-wide hub that ``inproc://`` addresses resolve in."""
    return _DEFAULT_HUB


def _queue_get(q: queue.Queue, timeout_s: float | None):
    try:
        return q.get(timeout=timeout_s) if timeout_s is None or timeout_s > 0 else q.get_nowait()
    except queue.Empty:
        return None


class InprocPushSender(PushSender):
    """The twin of :class:`ZmqPushSender`: up from the start; :meth:`cut` and :meth:`heal`
    stand in for a link going down and coming back (what is sent while cut is lost, as
    on a cut link)."""

    def __init__(self, hub: InprocHub, endpoint: str, peer: str = "inproc-peer") -> None:
        self._q = hub.lookup(endpoint)
        self._peer = peer
        self.stats = TransportStats()
        self._down_since: float | None = None
        self._reconnects = 0

    def cut(self) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()

    def heal(self) -> None:
        if self._down_since is not None:
            self._down_since = None
            self._reconnects += 1

    def down_s(self) -> float:
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def reconnects(self) -> int:
        return self._reconnects

    def send(self, msg: Message) -> None:
        self.send_frame(codec.encode(msg))

    def send_frame(self, frame: bytes) -> None:
        if self._down_since is None:
            self._q.put((self._peer, bytes(frame)))
        self.stats.sent += 1

    def close(self, linger_s: float = 1.0) -> None:
        """Nothing to flush: a sent frame is already in the receiver's queue."""


class InprocPullReceiver(PullReceiver):
    def __init__(self, hub: InprocHub, endpoint: str | None = None,
                 max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
                 expect: type | tuple[type, ...] | None = None) -> None:
        self._hub = hub
        self.endpoint, self._q = hub.bind(endpoint)
        self.stats = TransportStats()
        self.max_frame_bytes = max_frame_bytes
        self._expect = expect
        self._rejector = _Rejector(self.stats, f"pull {self.endpoint}")

    def recv(self, timeout_s: float | None = None) -> Message | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = _queue_get(self._q, remaining)
            if item is None:
                return None
            peer, frame = item
            try:
                msg = codec.decode(frame, max_bytes=self.max_frame_bytes, expect=self._expect)
            except ProtocolError as exc:
                self._rejector.reject(_reason_of(exc), peer, str(exc))
                continue
            self.stats.received += 1
            return msg

    def close(self) -> None:
        self._hub.unbind(self.endpoint)


class InprocServer(Server):
    def __init__(self, hub: InprocHub, endpoint: str | None = None, member_id: str = "server",
                 max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
                 accept: Callable[[Hello], str | None] = default_accept) -> None:
        self._hub = hub
        self.endpoint, self._q = hub.bind(endpoint)
        self._core = _ServerCore(f"server {self.endpoint}", member_id, max_frame_bytes, accept)
        self.stats = self._core.stats
        self.peers = self._core.peers
        self._replies: dict[str, queue.Queue[bytes]] = {}
        hub.add_server(self)

    def _attach(self, peer: str) -> queue.Queue[bytes]:
        return self._replies.setdefault(peer, queue.Queue())

    def recv(self, timeout_s: float | None = None) -> tuple[str, Message] | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = _queue_get(self._q, remaining)
            if item is None:
                return None
            peer, frame = item
            out = self._attach(peer)
            msg = self._core.handle(peer, frame, lambda m, o=out: o.put(codec.encode(m)))
            if msg is not None:
                return peer, msg

    def send(self, peer_id: str, msg: Message) -> None:
        if peer_id not in self.peers:
            raise TransportError(f"peer {peer_id!r} has not said hello to {self.endpoint}")
        self._attach(peer_id).put(codec.encode(msg))
        self.stats.sent += 1

    def forget(self, peer_id: str) -> None:
        """Drop a peer (it must say hello again)."""
        self.peers.pop(peer_id, None)

    def close(self) -> None:
        self._hub.unbind(self.endpoint)


class InprocClient(Client):
    def __init__(self, hub: InprocHub, endpoint: str, hello: Hello,
                 server: InprocServer | None = None) -> None:
        self._q = hub.lookup(endpoint)
        self.endpoint = endpoint
        self.hello = hello
        server = server if server is not None else hub.server_at(endpoint)
        self._replies = server._attach(hello.member_id)
        self.stats = TransportStats()
        self._rejector = _Rejector(self.stats, f"client {hello.member_id}")

    def connect(self, timeout_s: float = 10.0) -> Welcome:
        self._q.put((self.hello.member_id, codec.encode(self.hello)))
        frame = _queue_get(self._replies, timeout_s)
        where = f"handshake with {self.endpoint}"
        if frame is None:
            raise TransportError(f"{where}: no answer in {timeout_s}s")
        return _client_handle_welcome(frame, where)

    def send(self, msg: Message) -> None:
        self.send_frame(codec.encode(msg))

    def send_frame(self, frame: bytes) -> None:
        self._q.put((self.hello.member_id, bytes(frame)))
        self.stats.sent += 1

    def recv(self, timeout_s: float | None = None) -> Message | None:
        frame = _queue_get(self._replies, timeout_s)
        if frame is None:
            return None
        try:
            msg = codec.decode(frame)
        except ProtocolError as exc:
            self._rejector.reject(_reason_of(exc), self.endpoint, str(exc))
            return None
        self.stats.received += 1
        return msg

    def close(self) -> None:
        pass
