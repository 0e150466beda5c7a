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

Layout: :mod:`.base` (the interfaces and the handshake), :mod:`.zeromq` (ZeroMQ),
:mod:`.inproc` (the twin); this module chooses one by address.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from laminar_common import codec
from laminar_common.auth import CurveAuth
from laminar_common.codec import Hello
from laminar_common.errors import TransportError

from .base import INPROC, Client, PullReceiver, PushSender, Server, TransportStats, default_accept
from .inproc import (
    _DEFAULT_HUB,
    InprocClient,
    InprocHub,
    InprocPullReceiver,
    InprocPushSender,
    InprocServer,
    default_hub,
)
from .zeromq import (
    CONNECT_TIMEOUT_S,
    HEARTBEAT_IVL_S,
    HEARTBEAT_TIMEOUT_S,
    ZmqClient,
    ZmqPullReceiver,
    ZmqPushSender,
    ZmqServer,
)

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
    "HEARTBEAT_IVL_S",
    "HEARTBEAT_TIMEOUT_S",
    "CONNECT_TIMEOUT_S",
]



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
