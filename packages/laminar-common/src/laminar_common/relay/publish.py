"""The one publish session of the relay protocol: begin, stream chunks, commit or abort.

Owns the sender side of a publish to one relay, for both senders there are:
a :class:`~laminar_common.relay.client.RelayClient` handing a version to the
master, and a relay's chain forwarder passing it downstream. The steps are

1. ``BeginPublish`` with the version's layout: the relay answers with a
   session token and its data-plane endpoint, or declines;
2. every chunk, with its digest (the manifest's ``checksum_algo``), over the data plane
   (:mod:`laminar_common.relay.dataplane`);
3. ``CommitPublish`` with the count and the checksums in chunk order: the
   relay answers once every chunk is stored and verified (and, on the master,
   the version is visible in etcd);
4. on any failure after the session was opened, ``AbortPublish``, so the
   relay frees the session at once and nothing partial becomes readable.

What differs between the two senders comes in as arguments: where chunks
come from (hashed from the caller's buffers, or read from a relay's store as
they arrive), how long calls may take, how a long call is made (the client
gives up on a paused master as soon as another relay wins the election) and
which failures must not be followed by an abort.

Does not retry, resolve the master or choose the relay: callers do. Never
imports torch or numpy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from laminar_common.auth import CurveAuth
from laminar_common.codec import ChunkSpec, WeightManifest
from laminar_common.errors import LaminarError, ProtocolError, TransportError
from laminar_common.relay.dataplane import ChunkSender, make_chunk_sender
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.wire import call_relay, manifest_to_proto

__all__ = ["PublishSession", "PublishRefused", "PublishWithdrawn", "ChunkSenders", "Chunk"]

log = logging.getLogger(__name__)

Chunk = tuple[int, bytes, Any]
"""``(index, digest, payload)``: one chunk as a chunk source yields it."""
RelayCall = Callable[[Any, Any, str, float], Any]
"""``(stub method, request, what, timeout) -> reply``, raising a :class:`LaminarError`."""


class PublishRefused(ProtocolError):
    """The relay declined the publish at ``BeginPublish`` (no session was opened)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class PublishWithdrawn(LaminarError):
    """Raised by a chunk source to stop a publish on purpose: the session is aborted
    with this message as the reason, and :meth:`PublishSession.run` returns ``None``."""


class ChunkSenders:
    """Data-plane senders kept by endpoint across publishes (one socket per relay).

    Not thread-safe: one publishing thread at a time uses it (the client's
    publish lock, the forwarder's thread).
    """

    def __init__(self, hwm: int = 8, send_timeout_s: float = 10.0,
                 auth: CurveAuth | None = None) -> None:
        self.hwm = hwm
        self.send_timeout_s = send_timeout_s
        self.auth = auth
        self._senders: dict[str, ChunkSender] = {}

    def get(self, endpoint: str) -> ChunkSender:
        sender = self._senders.get(endpoint)
        if sender is None:
            sender = make_chunk_sender(endpoint, hwm=self.hwm, send_timeout_s=self.send_timeout_s,
                                       auth=self.auth)
            self._senders[endpoint] = sender
        return sender

    def drop(self, endpoint: str) -> None:
        """Close the sender of ``endpoint`` (after a transport failure it is not trusted)."""
        sender = self._senders.pop(endpoint, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        for endpoint in list(self._senders):
            self.drop(endpoint)


class PublishSession:
    """One publish of one version to one relay.

    Args:
        stub: the relay's gRPC stub.
        layout: the version's manifest; chunk checksums may be empty (they are
            taken from the digests the chunk source yields).
        origin: ``relay_pb2.ORIGIN_PUBLISHER`` or ``relay_pb2.ORIGIN_RELAY``.
        sender_id: names the sender in the relay's logs and sessions.
        senders: the data-plane senders to reuse.
        what: what this publish is, for error messages and logs.
        rpc_timeout_s: deadline of ``BeginPublish`` and (up to 2 s) of ``AbortPublish``.
        commit_timeout_s: deadline of ``CommitPublish``.
        deadline: ``time.monotonic()`` bound on begin and commit (None: none).
        call: how ``BeginPublish`` and ``CommitPublish`` are called (default:
            :func:`~laminar_common.relay.wire.call_relay`); ``AbortPublish``
            is always a plain call.
        no_abort_on: failures after which no abort is sent (a relay that
            stopped answering would hold the abort call too; its session
            expires on its own).
    """

    def __init__(
        self,
        stub: relay_pb2_grpc.RelayStub,
        layout: WeightManifest,
        *,
        origin: int,
        sender_id: str,
        senders: ChunkSenders,
        what: str,
        rpc_timeout_s: float = 10.0,
        commit_timeout_s: float = 60.0,
        deadline: float | None = None,
        call: RelayCall = call_relay,
        no_abort_on: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.stub = stub
        self.layout = layout
        self.origin = origin
        self.sender_id = sender_id
        self.senders = senders
        self.what = what
        self.rpc_timeout_s = rpc_timeout_s
        self.commit_timeout_s = commit_timeout_s
        self.deadline = deadline
        self._call = call
        self.no_abort_on = no_abort_on
        self.token = b""
        self.endpoint = ""
        self.sent = 0
        self._digests: list[bytes | None] = [None] * len(layout.chunks)

    def _timeout(self, limit: float) -> float:
        if self.deadline is None:
            return limit
        return min(limit, self.deadline - time.monotonic())

    @property
    def checksums(self) -> list[str]:
        """Hex checksums of the chunks sent so far, in chunk order (``""`` for unsent)."""
        return [d.hex() if d is not None else "" for d in self._digests]

    @property
    def manifest(self) -> WeightManifest:
        """``layout`` with the checksums of the chunks sent."""
        m = self.layout
        chunks = tuple(
            ChunkSpec(c.index, c.offset, c.nbytes, s) for c, s in zip(m.chunks, self.checksums)
        )
        return msgspec.structs.replace(m, chunks=chunks)

    def run(self, chunks: Iterable[Chunk]) -> relay_pb2.CommitPublishReply | None:
        """Begin, send every chunk ``chunks`` yields, and commit.

        ``chunks`` is read only after the relay accepted the session. It may
        raise :class:`PublishWithdrawn` to stop without committing.

        Returns:
            The relay's commit reply, or ``None`` when the chunk source withdrew.

        Raises:
            PublishRefused: the relay declined at ``BeginPublish``.
            LaminarError: the call, send or commit failed (the relay's error
                class); the session was aborted unless the error is one of
                ``no_abort_on``.
        """
        begin = self._call(
            self.stub.BeginPublish,
            relay_pb2.BeginPublishRequest(
                manifest=manifest_to_proto(self.layout),
                origin=self.origin,
                sender_id=self.sender_id,
            ),
            self.what,
            self._timeout(self.rpc_timeout_s),
        )
        if not begin.accepted:
            raise PublishRefused(f"{self.what}: refused: {begin.reason}", begin.reason)
        self.token, self.endpoint = begin.session, begin.data_endpoint
        source = iter(chunks)
        try:
            sender = self.senders.get(self.endpoint)
            for index, digest, payload in source:
                sender.send(self.token, index, digest, payload)
                self._digests[index] = digest
                self.sent += 1
            return self._call(
                self.stub.CommitPublish,
                relay_pb2.CommitPublishRequest(
                    session=self.token, chunks_sent=self.sent, checksums=self.checksums
                ),
                self.what,
                self._timeout(self.commit_timeout_s),
            )
        except PublishWithdrawn as exc:
            self.abort(str(exc))
            return None
        except BaseException as exc:
            if isinstance(exc, TransportError):
                self.senders.drop(self.endpoint)
            if not isinstance(exc, self.no_abort_on):
                self.abort(f"{self.sender_id} gave up: {exc}")
            raise
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def abort(self, reason: str) -> None:
        """Ask the relay to drop the session now (best effort: it also expires on its own)."""
        try:
            call_relay(
                self.stub.AbortPublish,
                relay_pb2.AbortPublishRequest(session=self.token, reason=reason),
                f"abort of {self.what}",
                min(2.0, self.rpc_timeout_s),
            )
        except LaminarError as exc:
            log.info("%s: could not abort the session (the relay expires it): %s", self.what, exc)
