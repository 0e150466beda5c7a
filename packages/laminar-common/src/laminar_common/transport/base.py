"""The transports' interfaces and what every implementation shares: the receive-side
stats and rejection log, the hello handshake of a server and a client."""

from __future__ import annotations

import abc
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from laminar_common import codec
from laminar_common.codec import Hello, Message, Refused, Welcome
from laminar_common.errors import ProtocolError

INPROC = "inproc://"
"""Addresses with this prefix resolve to the in-memory twin (unit tests, one process)."""

log = logging.getLogger("laminar_common.transport")
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
