"""Message transports: ZeroMQ over TCP, and an inproc twin with the same interface.

Two channel shapes:

- one-way fan-in, ``PushSender`` -> ``PullReceiver`` (trajectories to the
  trainer, acks to the manager): PUSH/PULL sockets;
- request/response with identities, ``Client`` <-> ``Server`` (manager <->
  workers): DEALER/ROUTER sockets with a version handshake: a client's first
  message is :class:`~laminar_common.codec.Hello`; the server answers
  :class:`Welcome` or :class:`Refused` and drops anything else a peer sends
  before its hello was accepted, answering it (at most once a second) with a
  :class:`Refused` so that a peer the server forgot says hello again.

Every receiver decodes through :func:`laminar_common.codec.decode`: malformed,
oversized or other-version frames are rejected, counted in ``stats`` by
reason, logged with the peer, and never crash the receiver. Every socket has
explicit high-water marks; a send that cannot be queued within its timeout
raises :class:`TransportError` (backpressure is visible, never silent).

Authentication: pass ``auth`` (a :class:`~laminar_common.auth.CurveAuth`) and
a binding socket becomes a CURVE server that admits only authorized client
keys; a connecting socket becomes a CURVE client. Off when ``auth`` is None.

Choosing a transport: services never name a class. They call
:func:`make_push_sender`, :func:`make_pull_receiver`, :func:`make_server` or
:func:`make_client` with an address; ``inproc://name`` resolves to the
in-memory twin (one process, a shared :class:`InprocHub`), anything else
(``tcp://``, ``ipc://``) to ZeroMQ. So a service's unit test runs over inproc
by configuring inproc addresses.

Sockets are not thread-safe: each object belongs to the thread that uses it.
"""

from __future__ import annotations

import abc
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.utils.monitor

from laminar_common import codec
from laminar_common.auth import CurveAuth
from laminar_common.codec import Hello, Message, Refused, Welcome
from laminar_common.errors import ProtocolError, TransportError

INPROC = "inproc://"
"""Addresses with this prefix resolve to the in-memory twin (unit tests, one process)."""

__all__ = [
    "TransportStats",
    "PushSender",
    "PullReceiver",
    "Server",
    "Client",
    "ZmqPushSender",
    "ZmqPullReceiver",
    "ZmqServer",
    "ZmqClient",
    "InprocHub",
    "InprocPushSender",
    "InprocPullReceiver",
    "InprocServer",
    "InprocClient",
    "INPROC",
    "default_hub",
    "make_push_sender",
    "make_pull_receiver",
    "make_server",
    "make_client",
    "flush_and_terminate",
]

log = logging.getLogger(__name__)
_LOG_FIRST_REJECTS = 20


@dataclass
class TransportStats:
    """Counters of one receiving endpoint."""

    received: int = 0
    sent: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


class _Rejector:
    """Counts and logs rejected frames (the first few of each reason in full)."""

    def __init__(self, stats: TransportStats, where: str) -> None:
        self.stats = stats
        self.where = where

    def reject(self, reason: str, peer: str, detail: str) -> None:
        self.stats.rejected[reason] += 1
        n = self.stats.rejected[reason]
        if n <= _LOG_FIRST_REJECTS:
            log.warning("%s rejected a frame from %s (%s): %s", self.where, peer, reason, detail)
        elif n % 1000 == 0:
            log.warning("%s has rejected %d frames for %s", self.where, n, reason)


def _reason_of(exc: ProtocolError) -> str:
    text = str(exc)
    for key, reason in (("exceeds the limit", "oversized"), ("protocol version", "version"),
                        ("unexpected message kind", "unexpected")):
        if key in text:
            return reason
    return "malformed"


# --------------------------------------------------------------------------
# Interfaces
# --------------------------------------------------------------------------


class PushSender(abc.ABC):
    """Sends messages one way to a :class:`PullReceiver`."""

    @abc.abstractmethod
    def send(self, msg: Message) -> None:
        """Queue ``msg``; raises :class:`TransportError` past the high-water mark."""

    @abc.abstractmethod
    def down_s(self) -> float:
        """Seconds the link to the receiver has been down: 0.0 while it is up; before
        the first connection, since this sender was made. A link is down when its
        connection closed or stopped answering heartbeats (a cut link, a dead peer)."""

    @abc.abstractmethod
    def reconnects(self) -> int:
        """How often the link came back up after it was down: what was sent meanwhile, or
        in flight when it went down, may be lost (the caller sends it again)."""

    @abc.abstractmethod
    def close(self, linger_s: float = 1.0) -> None:
        """Close; queued messages get up to ``linger_s`` to be delivered."""


class PullReceiver(abc.ABC):
    """Receives messages from any number of :class:`PushSender`."""

    stats: TransportStats
    endpoint: str

    @abc.abstractmethod
    def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next valid message, or ``None`` after ``timeout_s`` (None = block)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Server(abc.ABC):
    """Bound endpoint talking to many identified :class:`Client` peers."""

    stats: TransportStats
    endpoint: str
    peers: dict[str, Hello]

    @abc.abstractmethod
    def recv(self, timeout_s: float | None = None) -> tuple[str, Message] | None:
        """Next ``(peer_id, message)`` from an accepted peer, or ``None``."""

    @abc.abstractmethod
    def send(self, peer_id: str, msg: Message) -> None: ...

    @abc.abstractmethod
    def forget(self, peer_id: str) -> None:
        """Drop a peer: its next frames are refused until it says hello again."""

    @abc.abstractmethod
    def close(self) -> None: ...


class Client(abc.ABC):
    """Connects to a :class:`Server` and says hello before anything else."""

    stats: TransportStats

    @abc.abstractmethod
    def connect(self, timeout_s: float = 10.0) -> Welcome:
        """Handshake. Raises :class:`ProtocolError` if refused."""

    @abc.abstractmethod
    def send(self, msg: Message) -> None: ...

    @abc.abstractmethod
    def recv(self, timeout_s: float | None = None) -> Message | None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


def default_accept(hello: Hello) -> str | None:
    """Accept a peer that speaks our protocol version (else the refusal reason)."""
    if hello.protocol_version != codec.PROTOCOL_VERSION:
        return (f"{hello.role} {hello.member_id!r} speaks protocol version "
                f"{hello.protocol_version}, this server speaks {codec.PROTOCOL_VERSION}")
    return None


class _ServerCore:
    """Handshake and validation shared by the ZeroMQ and inproc servers."""

    def __init__(self, where: str, member_id: str, max_frame_bytes: int,
                 accept: Callable[[Hello], str | None]) -> None:
        self.stats = TransportStats()
        self.rejector = _Rejector(self.stats, where)
        self.member_id = member_id
        self.max_frame_bytes = max_frame_bytes
        self.accept = accept
        self.peers: dict[str, Hello] = {}
        self._told_to_rejoin: dict[str, float] = {}

    def handle(self, peer: str, frame: bytes,
               reply: Callable[[Message | bytes], None]) -> Message | None:
        """Validate one frame; returns the message to deliver, if any."""
        try:
            msg = codec.decode(frame, max_bytes=self.max_frame_bytes)
        except ProtocolError as exc:
            reason = _reason_of(exc)
            self.rejector.reject(reason, peer, str(exc))
            if reason == "version" and peer not in self.peers:
                reply(Refused(reason=str(exc)))
            return None
        if isinstance(msg, Hello):
            refusal = self.accept(msg)
            if refusal is not None:
                self.rejector.reject("refused", peer, refusal)
                reply(Refused(reason=refusal))
                return None
            self.peers[peer] = msg
            reply(Welcome(member_id=self.member_id, protocol_version=codec.PROTOCOL_VERSION))
            return msg
        if peer not in self.peers:
            self.rejector.reject("no-hello", peer, f"{type(msg).__name__} before hello")
            # A peer this server forgot (its lease expired while it was paused, or the
            # server restarted) is told so, at most once a second, and says hello again.
            now = time.monotonic()
            if now - self._told_to_rejoin.get(peer, -1e9) >= 1.0:
                self._told_to_rejoin[peer] = now
                reply(Refused(reason=f"{type(msg).__name__} from {peer!r} before hello: "
                                     "this server does not know you (say hello again)"))
            return None
        self.stats.received += 1
        return msg


def _client_handle_welcome(frame: bytes, where: str) -> Welcome:
    try:
        version = codec.peek_version(frame)
    except ProtocolError as exc:
        raise ProtocolError(f"{where}: bad handshake reply: {exc}") from exc
    if version != codec.PROTOCOL_VERSION:
        raise ProtocolError(
            f"{where}: server speaks protocol version {version}, this client speaks "
            f"{codec.PROTOCOL_VERSION}: run the same major Laminar release on both"
        )
    reply = codec.decode(frame)
    if isinstance(reply, Refused):
        raise ProtocolError(f"{where}: refused: {reply.reason}")
    if not isinstance(reply, Welcome):
        raise ProtocolError(f"{where}: expected welcome, got {type(reply).__name__}")
    return reply


# --------------------------------------------------------------------------
# ZeroMQ
# --------------------------------------------------------------------------


def _socket(kind: int, hwm: int, max_frame_bytes: int | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 1000)
    if max_frame_bytes is not None:
        # Hard memory guard: libzmq drops a peer that sends a message far above
        # the limit; frames between the limit and this guard are counted by us.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_frame_bytes + 1024)
    return sock


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise TransportError(f"cannot bind {endpoint}: {exc}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _connect(sock: zmq.Socket, endpoint: str) -> None:
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise TransportError(f"cannot connect to {endpoint}: {exc}") from exc


def _peer_of(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return "unknown-peer"


def _send(sock: zmq.Socket, parts: list[bytes], timeout_ms: int, where: str) -> None:
    if not sock.poll(timeout_ms, zmq.POLLOUT):
        raise TransportError(f"{where}: send timed out after {timeout_ms} ms "
                             "(high-water mark reached: the peer is not draining)")
    try:
        sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=len(parts[-1]) < 65536)
    except zmq.ZMQError as exc:
        raise TransportError(f"{where}: send failed: {exc}") from exc


HEARTBEAT_IVL_S = 1.0
"""A pushing socket pings its peer this often (ZMTP heartbeats) ..."""
HEARTBEAT_TIMEOUT_S = 3.0
"""... and drops the connection when nothing came back for this long: a cut link or a
paused peer is seen as down within this time (TCP alone would wait minutes)."""
CONNECT_TIMEOUT_S = 1.0
"""One connection attempt waits this long: a link that comes back is used within about
this, not after TCP's SYN back-off (1, 2, 4 ... s)."""

_UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class ZmqPushSender(PushSender):
    """PUSH socket connected to a :class:`ZmqPullReceiver`; heartbeats tell whether the
    link is up (:meth:`down_s`)."""

    def __init__(self, endpoint: str, hwm: int = 1000, send_timeout_s: float = 30.0,
                 auth: CurveAuth | None = None) -> None:
        self.endpoint = endpoint
        self.stats = TransportStats()
        self._timeout_ms = int(send_timeout_s * 1000)
        self._sock = _socket(zmq.PUSH, hwm)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        self._sock.setsockopt(zmq.CONNECT_TIMEOUT, int(CONNECT_TIMEOUT_S * 1000))
        if auth is not None:
            auth.apply_client(self._sock)
        self._monitor = self._sock.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS)
        self._down_since: float | None = time.monotonic()
        self._was_up = False
        self._reconnects = 0
        try:
            _connect(self._sock, endpoint)
        except TransportError:
            self._monitor.close(0)
            raise

    def _read_monitor(self) -> None:
        """Apply the socket's connection events so far (never blocks)."""
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            if event["event"] & _UP_EVENTS:
                if self._down_since is not None and self._was_up:
                    self._reconnects += 1
                self._down_since, self._was_up = None, True
            elif event["event"] & _DOWN_EVENTS and self._down_since is None:
                self._down_since = time.monotonic()

    def down_s(self) -> float:
        self._read_monitor()
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def reconnects(self) -> int:
        self._read_monitor()
        return self._reconnects

    def send(self, msg: Message) -> None:
        self.send_frame(codec.encode(msg))

    def send_frame(self, frame: bytes) -> None:
        """Send an already-encoded (or, in tests, deliberately broken) frame."""
        _send(self._sock, [frame], self._timeout_ms, f"push to {self.endpoint}")
        self.stats.sent += 1

    def close(self, linger_s: float = 1.0) -> None:
        """Close; queued messages get up to ``linger_s`` to be delivered."""
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(linger=int(linger_s * 1000))


class ZmqPullReceiver(PullReceiver):
    """PULL socket bound to ``endpoint`` (``tcp://127.0.0.1:0`` picks a port)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:0", hwm: int = 1000,
                 max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
                 expect: type | tuple[type, ...] | None = None,
                 auth: CurveAuth | None = None) -> None:
        self.stats = TransportStats()
        self.max_frame_bytes = max_frame_bytes
        self._expect = expect
        self._sock = _socket(zmq.PULL, hwm, max_frame_bytes)
        if auth is not None:
            auth.apply_server(self._sock)
        self.endpoint = _bind(self._sock, endpoint)
        self._rejector = _Rejector(self.stats, f"pull {self.endpoint}")

    def recv(self, timeout_s: float | None = None) -> Message | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sock.poll(None if remaining is None else int(remaining * 1000)):
                return None
            parts = self._sock.recv_multipart(copy=False)
            peer = _peer_of(parts[0])
            if len(parts) != 1:
                self._rejector.reject("malformed", peer, f"{len(parts)}-part message")
                continue
            try:
                msg = codec.decode(parts[0].buffer, max_bytes=self.max_frame_bytes,
                                   expect=self._expect)
            except ProtocolError as exc:
                self._rejector.reject(_reason_of(exc), peer, str(exc))
                continue
            self.stats.received += 1
            return msg

    def close(self) -> None:
        self._sock.close()


class ZmqServer(Server):
    """ROUTER socket: identified peers, hello handshake, per-peer replies."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:0", member_id: str = "server",
                 hwm: int = 1000, max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
                 accept: Callable[[Hello], str | None] = default_accept,
                 send_timeout_s: float = 10.0, auth: CurveAuth | None = None) -> None:
        self._sock = _socket(zmq.ROUTER, hwm, max_frame_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer that reconnects with the same identity (a new socket after a pause or
        # a restart) takes the identity over instead of being refused by ZeroMQ.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if auth is not None:
            auth.apply_server(self._sock)
        self.endpoint = _bind(self._sock, endpoint)
        self._core = _ServerCore(f"server {self.endpoint}", member_id, max_frame_bytes, accept)
        self.stats = self._core.stats
        self.peers = self._core.peers
        self._timeout_ms = int(send_timeout_s * 1000)

    def recv(self, timeout_s: float | None = None) -> tuple[str, Message] | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sock.poll(None if remaining is None else int(remaining * 1000)):
                return None
            parts = self._sock.recv_multipart(copy=False)
            ident = parts[0].bytes
            peer = ident.decode("utf-8", "replace")
            if len(parts) != 2:
                self._core.rejector.reject("malformed", peer, f"{len(parts) - 1}-part message")
                continue
            msg = self._core.handle(peer, parts[1].buffer, lambda m, i=ident: self._reply(i, m))
            if msg is not None:
                return peer, msg

    def _reply(self, ident: bytes, msg: Message) -> None:
        try:
            _send(self._sock, [ident, codec.encode(msg)], self._timeout_ms, "server reply")
        except TransportError as exc:
            log.warning("could not answer %r: %s", ident, exc)

    def send(self, peer_id: str, msg: Message) -> None:
        if peer_id not in self.peers:
            raise TransportError(f"peer {peer_id!r} has not said hello to {self.endpoint}")
        _send(self._sock, [peer_id.encode(), codec.encode(msg)], self._timeout_ms,
              f"send to {peer_id}")
        self.stats.sent += 1

    def forget(self, peer_id: str) -> None:
        """Drop a peer (it must say hello again)."""
        self.peers.pop(peer_id, None)

    def close(self) -> None:
        self._sock.close()


class ZmqClient(Client):
    """DEALER socket with identity ``hello.member_id``."""

    def __init__(self, endpoint: str, hello: Hello, hwm: int = 1000,
                 max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
                 send_timeout_s: float = 10.0, auth: CurveAuth | None = None) -> None:
        self.endpoint = endpoint
        self.hello = hello
        self.stats = TransportStats()
        self.max_frame_bytes = max_frame_bytes
        self._rejector = _Rejector(self.stats, f"client {hello.member_id}")
        self._timeout_ms = int(send_timeout_s * 1000)
        self._sock = _socket(zmq.DEALER, hwm, max_frame_bytes)
        self._sock.setsockopt(zmq.IDENTITY, hello.member_id.encode())
        if auth is not None:
            auth.apply_client(self._sock)
        _connect(self._sock, endpoint)

    def connect(self, timeout_s: float = 10.0) -> Welcome:
        where = f"handshake with {self.endpoint}"
        _send(self._sock, [codec.encode(self.hello)], self._timeout_ms, where)
        if not self._sock.poll(int(timeout_s * 1000)):
            raise TransportError(f"{where}: no answer in {timeout_s}s")
        return _client_handle_welcome(self._sock.recv(), where)

    def send(self, msg: Message) -> None:
        self.send_frame(codec.encode(msg))

    def send_frame(self, frame: bytes) -> None:
        _send(self._sock, [frame], self._timeout_ms, f"send to {self.endpoint}")
        self.stats.sent += 1

    def recv(self, timeout_s: float | None = None) -> Message | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sock.poll(None if remaining is None else int(remaining * 1000)):
                return None
            frame = self._sock.recv(copy=False)
            try:
                msg = codec.decode(frame.buffer, max_bytes=self.max_frame_bytes)
            except ProtocolError as exc:
                self._rejector.reject(_reason_of(exc), self.endpoint, str(exc))
                continue
            self.stats.received += 1
            return msg

    def close(self) -> None:
        self._sock.close()


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


def _inproc(endpoint: str, auth: CurveAuth | None, hub: InprocHub | None) -> InprocHub | None:
    """The hub for an ``inproc://`` endpoint, None for a ZeroMQ one."""
    if not endpoint.startswith(INPROC):
        return None
    if auth is not None:
        raise TransportError(f"{endpoint}: CURVE auth needs a ZeroMQ endpoint (tcp:// or ipc://)")
    return hub if hub is not None else _DEFAULT_HUB


def make_push_sender(endpoint: str, *, hwm: int = 1000, send_timeout_s: float = 30.0,
                     auth: CurveAuth | None = None, hub: InprocHub | None = None) -> PushSender:
    """A sender connected to ``endpoint``: the inproc twin for ``inproc://``, else ZeroMQ."""
    twin = _inproc(endpoint, auth, hub)
    if twin is not None:
        return InprocPushSender(twin, endpoint)
    return ZmqPushSender(endpoint, hwm=hwm, send_timeout_s=send_timeout_s, auth=auth)


def make_pull_receiver(endpoint: str = "tcp://127.0.0.1:0", *, hwm: int = 1000,
                       max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
                       expect: type | tuple[type, ...] | None = None,
                       auth: CurveAuth | None = None,
                       hub: InprocHub | None = None) -> PullReceiver:
    """A receiver bound at ``endpoint`` (``inproc://name`` or a ZeroMQ address)."""
    twin = _inproc(endpoint, auth, hub)
    if twin is not None:
        return InprocPullReceiver(twin, endpoint, max_frame_bytes, expect)
    return ZmqPullReceiver(endpoint, hwm=hwm, max_frame_bytes=max_frame_bytes, expect=expect,
                           auth=auth)


def make_server(endpoint: str = "tcp://127.0.0.1:0", *, member_id: str = "server",
                hwm: int = 1000, max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
                accept: Callable[[Hello], str | None] = default_accept,
                send_timeout_s: float = 10.0, auth: CurveAuth | None = None,
                hub: InprocHub | None = None) -> Server:
    """A request/response server bound at ``endpoint`` (inproc twin or ZeroMQ ROUTER)."""
    twin = _inproc(endpoint, auth, hub)
    if twin is not None:
        return InprocServer(twin, endpoint, member_id, max_frame_bytes, accept)
    return ZmqServer(endpoint, member_id=member_id, hwm=hwm, max_frame_bytes=max_frame_bytes,
                     accept=accept, send_timeout_s=send_timeout_s, auth=auth)


def make_client(endpoint: str, hello: Hello, *, hwm: int = 1000,
                max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
                send_timeout_s: float = 10.0, auth: CurveAuth | None = None,
                hub: InprocHub | None = None) -> Client:
    """A client of the server at ``endpoint`` (inproc twin or ZeroMQ DEALER)."""
    twin = _inproc(endpoint, auth, hub)
    if twin is not None:
        return InprocClient(twin, endpoint, hello)
    return ZmqClient(endpoint, hello, hwm=hwm, max_frame_bytes=max_frame_bytes,
                     send_timeout_s=send_timeout_s, auth=auth)


def flush_and_terminate() -> None:
    """Terminate the process-wide ZeroMQ context, waiting for each closed
    socket's linger period so queued messages are delivered before exit."""
    zmq.Context.instance().term()
