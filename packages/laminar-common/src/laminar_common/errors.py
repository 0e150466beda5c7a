"""The one Laminar error family.

Every tier raises subclasses of :class:`LaminarError`. Third-party errors
(etcd, ZeroMQ, gRPC) are re-raised as one of these, ``from`` the original, in
the module that touches the library, so callers never catch a foreign type.
"""

from __future__ import annotations

__all__ = [
    "LaminarError",
    "ConfigError",
    "ProtocolError",
    "CoordinationError",
    "FencedError",
    "TransportError",
    "PublishSuperseded",
    "EtcdUnavailableError",
    "EngineError",
    "EngineWedgedError",
]


class LaminarError(Exception):
    """Base of every error Laminar raises on purpose."""


class ConfigError(LaminarError):
    """A configuration file, env var or ``--set`` override is invalid.

    The message names the field path (``relay.chunk_bytes``) and what to do.
    """


class ProtocolError(LaminarError):
    """A frame, message or peer violates the wire protocol.

    Raised for malformed or oversized frames, unknown message kinds and a
    peer whose ``PROTOCOL_VERSION`` differs from ours.
    """


class TransportError(LaminarError):
    """A socket could not be bound, connected or used."""


class CoordinationError(LaminarError):
    """etcd refused an operation (lost a compare-and-swap, lease expired...)."""


class FencedError(CoordinationError):
    """A write fenced by an election was refused: this member no longer holds it (its
    lease expired or was revoked, and another member may have won since)."""


class EtcdUnavailableError(CoordinationError):
    """etcd could not be reached (after the bounded retries, if any)."""


class EngineError(LaminarError):
    """A generation engine refused an operation (bad request, wrong version, busy engine).

    Under :class:`LaminarError` so that a refused weight load or request is
    handled where every other refusal is, instead of escaping a worker's loop.
    """


class EngineWedgedError(EngineError):
    """A call into a generation engine did not return in time (a hung weight update).

    The engine may still be inside that call, so this process cannot use it again:
    the worker leaves the job (its unfinished work is dispatched elsewhere) and exits
    non-zero, and its supervisor starts it again, which registers afresh.
    """


class PublishSuperseded(TransportError):
    """A weight publish was given up between attempts because a newer version waits to
    go: after a master relay failover only the newest weights are worth sending."""
