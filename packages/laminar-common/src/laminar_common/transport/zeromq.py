"""ZeroMQ transports: PUSH/PULL and ROUTER/DEALER over TCP (or IPC), CURVE when asked;
a pushing socket's heartbeats tell whether its link is up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
import zmq.utils.monitor

from laminar_common import codec
from laminar_common.auth import CurveAuth
from laminar_common.codec import Hello, Message, Welcome
from laminar_common.errors import ProtocolError, TransportError

from .base import (
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
