"""The relay tier's wire contract, shared by the relay and its clients.

Owns: the names both sides must agree on (member role, election name, the
member-record ``extra`` keys, the protocol metadata key), the conversion
between :class:`~laminar_common.codec.WeightManifest` and its protobuf form,
the relay error classes, and the one mapping between those errors and gRPC
status codes (both directions), the one way a unary relay call is made
(:func:`call_relay`) and the gRPC channel/server options both ends use
(:data:`GRPC_OPTIONS`). Only this module and the two ends of the relay API
(``relay.client`` and ``relay.publish``, ``laminar_relay.server``) touch
``grpc`` statuses.

Invariants:

- A relay error crosses the wire as a gRPC status whose message is the
  human-readable reason, plus trailing metadata ``laminar-error`` naming the
  class, so :func:`error_from_rpc` rebuilds the same class on the client.
- :func:`manifest_from_proto` returns a manifest or raises
  :class:`ProtocolError`; it never returns something unvalidated by type.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from laminar_common.auth import grpc_channel
from laminar_common.codec import PROTOCOL_VERSION, ChunkSpec, TensorSpec, WeightManifest
from laminar_common.errors import (
    ConfigError,
    CoordinationError,
    EtcdUnavailableError,
    LaminarError,
    ProtocolError,
    TransportError,
)
from laminar_common.relay.manifests import LEGACY_CHECKSUM
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.roles import Extra, Role

__all__ = [
    "RelayStubs",
    "RELAY_ROLE",
    "MASTER_ELECTION",
    "EXTRA_DATA_ENDPOINT",
    "EXTRA_STORE",
    "PROTOCOL_METADATA_KEY",
    "ERROR_METADATA_KEY",
    "GRPC_OPTIONS",
    "protocol_metadata",
    "call_relay",
    "VersionConflictError",
    "NotMasterError",
    "VersionNotFoundError",
    "StoreFullError",
    "ChecksumError",
    "OversizedError",
    "ProtocolMismatchError",
    "CommitTimeoutError",
    "PermissionDeniedError",
    "status_of",
    "error_from_rpc",
    "manifest_to_proto",
    "manifest_from_proto",
]

RELAY_ROLE = Role.RELAY
"""Member role under which relays register."""
MASTER_ELECTION = "relay-master"
"""Election whose owner (a relay member id) is the master relay."""
EXTRA_DATA_ENDPOINT = Extra.DATA
"""``MemberRecord.extra`` key: the relay's data-plane endpoint."""
EXTRA_STORE = Extra.STORE
"""``MemberRecord.extra`` key: ``memfd`` (same-host readers map it) or ``heap``."""
PROTOCOL_METADATA_KEY = "laminar-protocol"
ERROR_METADATA_KEY = "laminar-error"
GRPC_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
)
"""gRPC options of every relay channel and server (manifests and Read chunks are large)."""


def protocol_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata every relay call carries."""
    return ((PROTOCOL_METADATA_KEY, str(PROTOCOL_VERSION)),)


class VersionConflictError(CoordinationError):
    """A weight version is not newer than one already published (regression/duplicate)."""


class NotMasterError(CoordinationError):
    """A publish reached a relay that is not the master; re-resolve and retry."""


class VersionNotFoundError(LaminarError):
    """The relay does not hold the requested weight version (or reader lease)."""


class StoreFullError(LaminarError):
    """The relay's store cannot hold another version within its memory cap."""


class ChecksumError(ProtocolError):
    """A chunk's bytes do not match its checksum."""


class OversizedError(ProtocolError):
    """A manifest or version exceeds the relay's limits."""


class ProtocolMismatchError(ProtocolError):
    """The peer speaks another ``PROTOCOL_VERSION``."""


class PermissionDeniedError(LaminarError):
    """The caller's certificate does not allow this call (e.g. a reader trying to publish)."""


class CommitTimeoutError(TransportError):
    """Not every chunk of a publish arrived before the commit deadline."""


# Most specific first: the first isinstance match wins.
_STATUS: tuple[tuple[type[LaminarError], grpc.StatusCode], ...] = (
    (VersionConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (NotMasterError, grpc.StatusCode.FAILED_PRECONDITION),
    (ProtocolMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (ChecksumError, grpc.StatusCode.DATA_LOSS),
    (OversizedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoreFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (VersionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (CommitTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (EtcdUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (CoordinationError, grpc.StatusCode.ABORTED),
    (TransportError, grpc.StatusCode.UNAVAILABLE),
    (LaminarError, grpc.StatusCode.INTERNAL),
)

_BY_NAME: dict[str, type[LaminarError]] = {cls.__name__: cls for cls, _ in _STATUS}

_BY_CODE: dict[grpc.StatusCode, type[LaminarError]] = {
    grpc.StatusCode.ALREADY_EXISTS: VersionConflictError,
    grpc.StatusCode.FAILED_PRECONDITION: ProtocolError,
    grpc.StatusCode.DATA_LOSS: ChecksumError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OversizedError,
    grpc.StatusCode.NOT_FOUND: VersionNotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: ProtocolError,
    grpc.StatusCode.ABORTED: CoordinationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


def status_of(exc: LaminarError) -> grpc.StatusCode:
    """The gRPC status code a relay answers ``exc`` with."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_rpc(exc: grpc.RpcError, what: str) -> LaminarError:
    """Turn a failed relay call into the Laminar error the relay raised.

    Args:
        exc: the error grpc raised (a ``grpc.Call``).
        what: what the caller was doing, e.g. ``"publish of version 7 to relay r1"``.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = None
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_METADATA_KEY:
            name = value
    cls = _BY_NAME.get(name or "")
    if cls is None:
        if code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.UNKNOWN,
        ):
            cls = TransportError
        else:
            cls = _BY_CODE.get(code, LaminarError)
    return cls(f"{what}: {details} ({code.name if code else 'UNKNOWN'})")


def call_relay(method: Any, request: Any, what: str, timeout: float) -> Any:
    """One unary relay call with the protocol metadata; a failure is raised as ours.

    Args:
        method: a stub method, e.g. ``stub.BeginPublish``.
        what: what the caller is doing, for the error message.
        timeout: the call's deadline in seconds (at least 0.1 s is given).

    Raises:
        LaminarError: the class the relay raised (see :func:`error_from_rpc`).
    """
    try:
        return method(request, timeout=max(0.1, timeout), metadata=protocol_metadata())
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, what) from exc


def manifest_to_proto(manifest: WeightManifest) -> relay_pb2.Manifest:
    """Protobuf form of a manifest (chunk checksums may be empty)."""
    pb = _manifest_to_proto(manifest)
    if manifest.full is not None:
        pb.base_version = manifest.base_version
        pb.full.CopyFrom(_manifest_to_proto(manifest.full))
    return pb


def _manifest_to_proto(manifest: WeightManifest) -> relay_pb2.Manifest:
    return relay_pb2.Manifest(
        version=manifest.version,
        total_bytes=manifest.total_bytes,
        chunk_bytes=manifest.chunk_bytes,
        tensors=[
            relay_pb2.TensorSpec(
                name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset, nbytes=t.nbytes
            )
            for t in manifest.tensors
        ],
        chunks=[
            relay_pb2.ChunkSpec(
                index=c.index, offset=c.offset, nbytes=c.nbytes, checksum=c.checksum
            )
            for c in manifest.chunks
        ],
        created_at=manifest.created_at,
        trainer_step=manifest.trainer_step,
        checksum_algo=manifest.checksum_algo,
    )


def manifest_from_proto(pb: relay_pb2.Manifest, *, nested: bool = False) -> WeightManifest:
    """Manifest from its protobuf form (types only; see ``manifests.validate_manifest``).

    A delta's ``full`` manifest is read one level deep (a full manifest is never a delta).
    """
    full = None
    if pb.HasField("full") and not nested:
        full = manifest_from_proto(pb.full, nested=True)
    return WeightManifest(
        version=int(pb.version),
        total_bytes=int(pb.total_bytes),
        chunk_bytes=int(pb.chunk_bytes),
        tensors=tuple(
            TensorSpec(
                t.name, t.dtype, tuple(int(d) for d in t.shape), int(t.offset), int(t.nbytes)
            )
            for t in pb.tensors
        ),
        chunks=tuple(
            ChunkSpec(int(c.index), int(c.offset), int(c.nbytes), c.checksum) for c in pb.chunks
        ),
        created_at=float(pb.created_at),
        trainer_step=int(pb.trainer_step),
        # A peer from before the field sends none: its chunks are blake2b-128.
        checksum_algo=pb.checksum_algo or LEGACY_CHECKSUM,
        base_version=int(pb.base_version) if full is not None else -1,
        full=full,
    )


class RelayStubs:
    """One gRPC channel (and stub) per relay address, made on first use; thread-safe.
    ``tls``: the CA (and client certificate) to reach relays over TLS, None: plaintext."""

    def __init__(self, tls=None) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, relay_pb2_grpc.RelayStub]] = {}
        self._closed = False

    def get(self, address: str) -> relay_pb2_grpc.RelayStub:
        """The stub for ``address``.

        Raises:
            TransportError: after :meth:`close`.
        """
        with self._lock:
            if self._closed:
                raise TransportError("relay connections are closed")
            entry = self._channels.get(address)
            if entry is None:
                channel = grpc_channel(address, self.tls, GRPC_OPTIONS)
                entry = (channel, relay_pb2_grpc.RelayStub(channel))
                self._channels[address] = entry
            return entry[1]

    def close(self) -> None:
        """Close every channel (idempotent); :meth:`get` refuses from now on."""
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()
