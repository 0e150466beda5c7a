"""The publish half of the relay client: hand a weight version to the master relay.

:class:`RelayPublisher` lays a version out (tensors into checksummed chunks, or a delta
against the version it published before, ``delta_full_every``), streams it to the
master through one :class:`~laminar_common.relay.publish.PublishSession` while a
thread pool checksums ahead, and retries on the newly elected master when the old one
dies, loses the election or stalls, until ``publish_timeout_s``. Refusals (version not
newer, malformed manifest, store full) are raised at once, never retried.

Never imports torch or numpy.
"""


from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from laminar_common.codec import WeightManifest
from laminar_common.errors import (
    EtcdUnavailableError,
    LaminarError,
    PublishSuperseded,
    TransportError,
)
from laminar_common.relay._connection import (
    PublishResult,
    RelayConnection,
    RelayRef,
    TensorLike,
    _Backoff,
    _DeltaBase,
    _MasterChanged,
)
from laminar_common.relay.manifests import (
    DEFAULT_CHECKSUM,
    ChunkPayload,
    NamedBuffer,
    as_named_buffers,
    build_manifest,
    digest_of,
    flatten,
    iter_chunks,
    plan_chunks,
    plan_tensors,
)
from laminar_common.relay.proto import relay_pb2
from laminar_common.relay.publish import PublishSession
from laminar_common.relay.wire import (
    NotMasterError,
    call_relay,
)

__all__ = ["RelayPublisher"]

# The client's halves log as the client (one logger to configure, as before the split).
log = logging.getLogger("laminar_common.relay.client")


class RelayPublisher(RelayConnection):
    """The publish half (see module docstring); arguments as :class:`RelayConnection`."""

    def publish(
        self, version: int, tensors: Iterable[TensorLike], *, trainer_step: int = -1,
        full: bool = False, superseded: Callable[[], bool] | None = None,
    ) -> PublishResult:
        """Hand one weight version to the master relay.

        Returns once the master holds every chunk, verified, and the version
        is visible in etcd; the chain broadcast goes on in the background.

        Args:
            version: the new version; must be greater than the published one.
            tensors: ``(name, dtype, shape, buffer)`` tuples or
                :class:`~laminar_common.relay.manifests.NamedBuffer` s; buffers must
                stay unchanged until this returns.
            trainer_step: recorded with the version.
            full: publish in full even where a delta could go (``delta_full_every``).
            superseded: asked before each retry; True gives this version up (raises
                :class:`PublishSuperseded`) because a newer one waits to be published.

        Raises:
            VersionConflictError: ``version`` is not newer than the published one.
            ProtocolError: the relay refused the manifest or a chunk (see message).
            StoreFullError: the master has no room within its memory cap.
            NotMasterError: the fixed ``address`` is not the master.
            TransportError: no master took the version within ``publish_timeout_s``.
            PublishSuperseded: ``superseded`` said so before a retry.
            ValueError: bad tensors (names, dtypes, sizes).
        """
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        buffers = as_named_buffers(tensors)
        layout = self._layout(version, buffers, trainer_step)
        start = time.monotonic()
        deadline = start + self.publish_timeout_s
        backoff = _Backoff(initial=0.2)
        last: LaminarError | None = None
        with self._publish_lock:
            delta = None
            if self.delta_full_every > 0:
                layout, buffers, delta = self._delta_candidate(layout, buffers, full)
            for attempt in range(1, self.max_attempts + 1):
                relay = self._master(deadline)
                if attempt > 1 and superseded is not None and superseded():
                    # Newer weights queued while a new master was elected: send those.
                    raise PublishSuperseded(
                        f"publish of weight version {version} given up before attempt "
                        f"{attempt}: a newer version waits to be published") from last
                sent_layout, sent_buffers = self._what_to_send(relay, layout, buffers, delta)
                try:
                    manifest = self._publish_once(relay, sent_layout, sent_buffers, deadline)
                except (NotMasterError, TransportError, EtcdUnavailableError) as exc:
                    if isinstance(exc, NotMasterError) and self._coord is None:
                        raise  # a fixed address cannot be re-resolved
                    last = exc
                    if not self._retry_after(exc, version, relay, attempt, deadline, backoff,
                                             superseded):
                        break
                    continue
                self._suspect = None
                if delta is not None:  # the next delta is taken against this version
                    since = self._delta_base.since_full + 1 \
                        if sent_layout is not layout and self._delta_base is not None else 0
                    self._delta_base = _DeltaBase(version, delta[2], delta[3], relay.member_id,
                                                  since)
                return PublishResult(version, relay.member_id, sent_layout.total_bytes,
                                     len(sent_layout.chunks), time.monotonic() - start,
                                     attempt, manifest)
        raise TransportError(
            f"publish of weight version {version} did not reach a master relay "
            f"({self.max_attempts} attempts, {self.publish_timeout_s:.0f}s): {last}"
        ) from last

    def _layout(self, version: int, buffers: list[NamedBuffer],
                trainer_step: int) -> WeightManifest:
        """The full version's manifest (tensor offsets and chunks; checksums come later)."""
        specs, total = plan_tensors(buffers, self.alignment)
        return WeightManifest(
            version=version, total_bytes=total, chunk_bytes=self.chunk_bytes, tensors=specs,
            chunks=plan_chunks(total, self.chunk_bytes), created_at=time.time(),
            trainer_step=trainer_step, checksum_algo=DEFAULT_CHECKSUM)

    def _what_to_send(self, relay: RelayRef, layout: WeightManifest,
                      buffers: list[NamedBuffer], delta):
        """The delta, when there is one and ``relay`` is the master it was taken against
        and still holds its base; else the full version."""
        if delta is not None and delta[0].base_version >= 0 \
                and self._delta_base is not None \
                and relay.member_id == self._delta_base.master_id \
                and self._holds(relay, delta[0].base_version):
            return delta[0], delta[1]
        return layout, buffers

    def _retry_after(self, exc: LaminarError, version: int, relay: RelayRef, attempt: int,
                     deadline: float, backoff: _Backoff,
                     superseded: Callable[[], bool] | None) -> bool:
        """A failed attempt: the master is suspect; True after the backoff when another
        attempt may go, False past the deadline.

        Raises:
            PublishSuperseded: ``superseded`` says a newer version waits.
        """
        self._suspect = ((relay.member_id, relay.started_at, relay.address), time.monotonic())
        log.warning("publish of version %d to master %s failed (attempt %d): %s", version,
                    relay.member_id, attempt, exc)
        if time.monotonic() >= deadline:
            return False
        if superseded is not None and superseded():
            raise PublishSuperseded(
                f"publish of weight version {version} given up after {attempt} "
                f"attempt(s): a newer version waits to be published") from exc
        self._closed.wait(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
        return True

    def _holds(self, relay: RelayRef, version: int) -> bool:
        """Whether ``relay`` holds ``version`` (a restarted master holds nothing: a delta
        against a base it lacks would leave its readers without a base)."""
        try:
            reply = call_relay(self._stub(relay.address).Health, relay_pb2.HealthRequest(),
                               f"health of relay {relay.member_id}", self.rpc_timeout_s)
        except LaminarError as exc:
            log.info("publishing in full: cannot ask %s for its versions (%s)",
                     relay.member_id, exc)
            return False
        return version in reply.versions

    def _delta_candidate(self, layout: WeightManifest, buffers: list[NamedBuffer], full: bool):
        """``(layout, buffers, (delta layout, delta buffers, full manifest, flat))``.

        The full version is laid out as one flat copy (the next delta's base); the
        delta is against the previous version this client published, or has
        ``base_version`` -1 when this version must go in full.
        """
        from laminar_common.relay.delta import encode_delta, same_layout

        full_manifest, _ = build_manifest(
            layout.version, buffers, chunk_bytes=self.chunk_bytes, alignment=self.alignment,
            trainer_step=layout.trainer_step, created_at=layout.created_at)
        flat = flatten(full_manifest, buffers)
        flat_buffers = [NamedBuffer(t.name, t.dtype, t.shape,
                                    memoryview(flat)[t.offset : t.offset + t.nbytes])
                        for t in full_manifest.tensors]
        prev = self._delta_base
        none = msgspec.structs.replace(layout, base_version=-1)
        if full or prev is None or not same_layout(prev.manifest, full_manifest) \
                or prev.since_full + 1 >= self.delta_full_every or prev.version >= layout.version:
            return layout, flat_buffers, (none, [], full_manifest, flat)
        parts = as_named_buffers(encode_delta(prev.version, full_manifest, prev.flat, flat))
        specs, total = plan_tensors(parts, self.alignment)
        if total * 2 >= full_manifest.total_bytes:
            return layout, flat_buffers, (none, [], full_manifest, flat)
        delta_layout = msgspec.structs.replace(
            layout, total_bytes=total, tensors=specs,
            chunks=plan_chunks(total, self.chunk_bytes), base_version=prev.version,
            full=full_manifest)
        return layout, flat_buffers, (delta_layout, parts, full_manifest, flat)

    def publish_async(
        self, version: int, tensors: Iterable[TensorLike], *, trainer_step: int = -1
    ) -> Future[PublishResult]:
        """:meth:`publish` on a background thread (one publish at a time, in call order).

        The buffers must stay unchanged until the future completes.
        """
        with self._lock:
            if self._async_pool is None:
                self._async_pool = ThreadPoolExecutor(1, thread_name_prefix="relay-publish")
            pool = self._async_pool
        return pool.submit(self.publish, version, list(tensors), trainer_step=trainer_step)

    def _hashed(self, buffers: Sequence[NamedBuffer], layout: WeightManifest):
        """Yield ``(index, digest, payload)`` in order, checksumming ahead on a pool."""
        with self._lock:
            if self._hash_pool is None:
                self._hash_pool = ThreadPoolExecutor(
                    self.hash_threads, thread_name_prefix="relay-hash"
                )
            pool = self._hash_pool

        def work(p: ChunkPayload) -> tuple[int, bytes, Any]:
            data = p.contiguous()
            return p.index, digest_of(data, layout.checksum_algo), data

        window: collections.deque[Future] = collections.deque()
        try:
            for payload in iter_chunks(buffers, layout.tensors, layout.chunks):
                window.append(pool.submit(work, payload))
                if len(window) > 2 * self.hash_threads:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:
            for fut in window:
                fut.cancel()

    def _publish_once(
        self,
        relay: RelayRef,
        layout: WeightManifest,
        buffers: Sequence[NamedBuffer],
        deadline: float,
    ) -> WeightManifest:
        session = PublishSession(
            self._stub(relay.address),
            layout,
            origin=relay_pb2.ORIGIN_PUBLISHER,
            sender_id=self.client_id,
            senders=self._senders,
            what=(
                f"publish of weight version {layout.version} to relay {relay.member_id} "
                f"({relay.address})"
            ),
            rpc_timeout_s=self.rpc_timeout_s,
            commit_timeout_s=self.publish_timeout_s,
            deadline=deadline,
            call=functools.partial(self._call_while_master, relay=relay),
            no_abort_on=(_MasterChanged,),  # a paused relay would hold the abort too
        )
        reply = session.run(self._hashed(buffers, layout))
        assert reply is not None, "the client's chunk source never withdraws"
        log.debug(
            "relay %s accepted version %d (visible=%s)", reply.relay_id, reply.version,
            reply.visible,
        )
        return session.manifest
