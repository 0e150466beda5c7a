"""The relay's gRPC control API (``laminar.relay.v1.Relay``).

Owns the translation between RPCs and the store: opening, committing and
aborting publish sessions, reader leases (Fetch/Read/Release), Latest and
Health. It does not own the data plane, the chain or etcd: those come in as
plain callables from :mod:`laminar_relay.service`.

Invariants:

- Every refusal is a gRPC status whose message says what was wrong, with the
  Laminar error class in the ``laminar-error`` trailing metadata; each is
  counted in ``rejected`` by class name. A refusal never stops the server or
  leaves anything partial readable.
- Only the master accepts publishes from a publisher, and only for a version
  newer than the one published in etcd.
- A caller that does not send our ``PROTOCOL_VERSION`` is refused.
- Under mutual TLS only the trainer's publisher certificate opens a publish
  (``ORIGIN_PUBLISHER``) and only a relay's certificate forwards one
  (``ORIGIN_RELAY``); a reader's certificate is refused (PERMISSION_DENIED).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable

import grpc

from laminar_common.auth import PUBLISHER_CN, RELAY_CN, peer_role
from laminar_common.codec import PROTOCOL_VERSION, WeightManifest
from laminar_common.errors import LaminarError, ProtocolError
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.wire import (
    ERROR_METADATA_KEY,
    PROTOCOL_METADATA_KEY,
    NotMasterError,
    PermissionDeniedError,
    ProtocolMismatchError,
    VersionConflictError,
    manifest_from_proto,
    manifest_to_proto,
    status_of,
)

from .store import WeightStore

__all__ = ["RelayServicer"]

log = logging.getLogger(__name__)
_LOG_FIRST = 50
MAX_READER_LABELS = 1024
"""Distinct reader ids counted by name in ``fetches`` (bounds the metric's label set)."""


def _check_protocol(context: grpc.ServicerContext) -> None:
    sent = dict(context.invocation_metadata()).get(PROTOCOL_METADATA_KEY)
    if sent != str(PROTOCOL_VERSION):
        raise ProtocolMismatchError(
            f"caller speaks laminar protocol version {sent or '<none>'}, this relay speaks "
            f"{PROTOCOL_VERSION}: run the same major Laminar release on every tier"
        )


def _rpc(fn):
    """Run a unary handler: protocol check, and LaminarError -> gRPC status."""

    @functools.wraps(fn)
    def handler(self: RelayServicer, request, context: grpc.ServicerContext):
        try:
            _check_protocol(context)
            return fn(self, request, context)
        except LaminarError as exc:
            self._refuse(context, fn.__name__, exc)
        except Exception as exc:  # top of a request handler: log with traceback, answer INTERNAL
            log.exception("relay %s: %s failed unexpectedly", self.relay_id, fn.__name__)
            context.abort(
                grpc.StatusCode.INTERNAL, f"relay {self.relay_id} internal error: {exc!r}"
            )

    return handler


class RelayServicer(relay_pb2_grpc.RelayServicer):
    """Serves the control API of one relay.

    Args:
        store: this relay's weight store.
        relay_id: this relay's member id.
        host: host name same-host readers compare with theirs.
        data_endpoint: where publishers and upstream relays push chunks.
        master_id: returns the current master's member id (or None).
        latest_published: returns the version in etcd ``weights/latest`` (-1: none).
        make_visible: publishes a sealed version in etcd (called by the master
            before the version becomes readable).
        on_begin: told each version that starts arriving (the forwarder).
        health: builds the Health reply.
        commit_timeout_s: how long a commit waits for chunks in flight.
        reader_lease_s: reader lease TTL.
        max_fetch_wait_s: cap on a fetch's wait for a version still arriving.
        check_publisher: require a client certificate of the publisher (trainer)
            or a relay on every publish call (the server runs mutual TLS).
        max_waiting_fetches: fetches allowed to wait at once; more answer at
            once (NOT_FOUND if the version is not here), so waiting readers can
            never occupy every server thread and starve the publish calls that
            would bring the version they wait for.
    """

    def __init__(
        self,
        store: WeightStore,
        *,
        relay_id: str,
        host: str,
        data_endpoint: str,
        master_id: Callable[[], str | None],
        latest_published: Callable[[], int],
        make_visible: Callable[[WeightManifest], None],
        on_begin: Callable[[int], None],
        health: Callable[[], relay_pb2.HealthReply],
        commit_timeout_s: float = 60.0,
        reader_lease_s: float = 300.0,
        max_fetch_wait_s: float = 120.0,
        max_waiting_fetches: int = 8,
        check_publisher: bool = False,
    ) -> None:
        self.check_publisher = check_publisher
        self.store = store
        self.relay_id = relay_id
        self.host = host
        self.data_endpoint = data_endpoint
        self._master_id = master_id
        self._latest_published = latest_published
        self._make_visible = make_visible
        self._on_begin = on_begin
        self._health = health
        self.commit_timeout_s = commit_timeout_s
        self.reader_lease_s = reader_lease_s
        self.max_fetch_wait_s = max_fetch_wait_s
        self.rejected: collections.Counter[str] = collections.Counter()
        self.fetches: collections.Counter[str] = collections.Counter()
        """Versions leased to readers, by reader id (at most :data:`MAX_READER_LABELS`
        ids; later ones count under ``other``): which rollouts read from this relay."""
        self._waiters = threading.BoundedSemaphore(max(1, max_waiting_fetches))
        self.waiting_fetches = 0

    def _refuse(self, context: grpc.ServicerContext, call: str, exc: LaminarError) -> None:
        name = type(exc).__name__
        self.rejected[name] += 1
        if self.rejected[name] <= _LOG_FIRST:
            log.warning("relay %s refused %s from %s: %s", self.relay_id, call, context.peer(), exc)
        context.set_trailing_metadata(((ERROR_METADATA_KEY, name),))
        context.abort(status_of(exc), str(exc))

    # -- publish ------------------------------------------------------------

    def _may_publish(self, context: grpc.ServicerContext, call: str, origin: int | None) -> None:
        if not self.check_publisher:
            return
        role = peer_role(context)
        allowed = {relay_pb2.ORIGIN_PUBLISHER: (PUBLISHER_CN,), relay_pb2.ORIGIN_RELAY: (RELAY_CN,),
                   None: (PUBLISHER_CN, RELAY_CN)}.get(origin, ())
        if role not in allowed:
            raise PermissionDeniedError(
                f"{call} from {context.peer()}: its certificate ({role or 'none'}) may not "
                f"publish; only the trainer's publisher certificate ({PUBLISHER_CN}) and "
                f"relays ({RELAY_CN}) may")

    @_rpc
    def BeginPublish(self, request, context):
        if not request.HasField("manifest"):
            raise ProtocolError("BeginPublish carries no manifest")
        if request.origin not in (relay_pb2.ORIGIN_PUBLISHER, relay_pb2.ORIGIN_RELAY):
            raise ProtocolError(
                f"BeginPublish origin {request.origin} is neither PUBLISHER nor RELAY"
            )
        self._may_publish(context, "BeginPublish", request.origin)
        if not request.sender_id:
            raise ProtocolError("BeginPublish carries no sender_id")
        layout = manifest_from_proto(request.manifest)
        from_relay = request.origin == relay_pb2.ORIGIN_RELAY
        if not from_relay:
            master = self._master_id()
            if master != self.relay_id:
                raise NotMasterError(
                    f"relay {self.relay_id} is not the master (master: "
                    f"{master or 'none elected yet'}); re-resolve the master and retry"
                )
            published = self._latest_published()
            if layout.version <= published:
                kind = "duplicate" if layout.version == published else "regression"
                raise VersionConflictError(
                    f"{kind}: weight version {layout.version} is not newer than the published "
                    f"version {published}; versions only move forward"
                )
        try:
            session = self.store.begin(layout, sender_id=request.sender_id, from_relay=from_relay)
        except VersionConflictError as exc:
            if not from_relay:
                raise
            return relay_pb2.BeginPublishReply(
                accepted=False, reason=str(exc), relay_id=self.relay_id
            )
        self._on_begin(layout.version)
        return relay_pb2.BeginPublishReply(
            accepted=True,
            session=session.token,
            data_endpoint=self.data_endpoint,
            relay_id=self.relay_id,
        )

    @_rpc
    def CommitPublish(self, request, context):
        self._may_publish(context, "CommitPublish", None)
        session = self.store.session(request.session)
        before_seal = None if session.from_relay else self._make_visible
        stored = self.store.commit(
            request.session,
            request.chunks_sent,
            list(request.checksums),
            self.commit_timeout_s,
            before_seal=before_seal,
        )
        log.info(
            "relay %s stored version %d (%d bytes) from %s%s",
            self.relay_id,
            stored.version,
            stored.manifest.total_bytes,
            session.sender_id,
            "; visible in etcd" if before_seal else "",
        )
        return relay_pb2.CommitPublishReply(
            version=stored.version, relay_id=self.relay_id, visible=before_seal is not None
        )

    @_rpc
    def AbortPublish(self, request, context):
        self._may_publish(context, "AbortPublish", None)
        reason = request.reason or "aborted by the sender"
        self.store.abort(request.session, reason[:500])
        return relay_pb2.AbortPublishReply()

    # -- read ---------------------------------------------------------------

    @_rpc
    def Fetch(self, request, context):
        wait = min(max(0.0, request.wait_s), self.max_fetch_wait_s)
        version = request.version if request.version >= 0 else None
        holder = request.reader_id or context.peer()
        if wait > 0 and self._waiters.acquire(blocking=False):
            self.waiting_fetches += 1
            try:
                lease, stored = self.store.lease(version, holder, self.reader_lease_s, wait)
            finally:
                self.waiting_fetches -= 1
                self._waiters.release()
        else:
            lease, stored = self.store.lease(version, holder, self.reader_lease_s, 0.0)
        reader = request.reader_id or "anonymous"
        if reader not in self.fetches and len(self.fetches) >= MAX_READER_LABELS:
            reader = "other"
        self.fetches[reader] += 1
        return relay_pb2.FetchReply(
            manifest=manifest_to_proto(stored.manifest),
            lease=lease,
            lease_s=self.reader_lease_s,
            shm_path=stored.buffer.share_path,
            host=self.host,
            relay_id=self.relay_id,
        )

    def Read(self, request, context):
        try:
            _check_protocol(context)
            stored = self.store.leased(request.lease, self.reader_lease_s)
            chunks = stored.manifest.chunks
            end = request.end_chunk or len(chunks)
            if not request.first_chunk <= end <= len(chunks):
                raise ProtocolError(
                    f"Read range [{request.first_chunk}, {end}) is outside version "
                    f"{stored.version}'s {len(chunks)} chunks"
                )
        except LaminarError as exc:
            self._refuse(context, "Read", exc)
            return
        view = stored.buffer.view
        for spec in chunks[request.first_chunk : end]:
            if not context.is_active():
                return
            yield relay_pb2.ReadChunk(
                index=spec.index,
                checksum=spec.checksum,
                data=bytes(view[spec.offset : spec.offset + spec.nbytes]),
            )

    @_rpc
    def Release(self, request, context):
        return relay_pb2.ReleaseReply(released=self.store.release(request.lease))

    @_rpc
    def Latest(self, request, context):
        newest = self.store.newest()
        if newest is None:
            return relay_pb2.LatestReply(version=-1, relay_id=self.relay_id)
        m = newest.manifest
        return relay_pb2.LatestReply(
            version=m.version,
            total_bytes=m.total_bytes,
            trainer_step=m.trainer_step,
            relay_id=self.relay_id,
        )

    @_rpc
    def Health(self, request, context):
        return self._health()
