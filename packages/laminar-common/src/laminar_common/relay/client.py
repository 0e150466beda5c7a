"""Client of the relay tier: publish weight versions, fetch them, ask for status.

Owns how a trainer hands a version to the master relay and how a rollout
reads one from its relay. The trainer calls :meth:`RelayClient.publish`,
which returns once the master has stored and verified every chunk and made
the version visible in etcd (the hand-off); the relays spread it along the
chain afterwards, without the trainer. The publish protocol itself (begin,
chunks, commit, abort) is :class:`~laminar_common.relay.publish.PublishSession`;
this module adds master resolution, retries and checksumming ahead. A rollout
calls :meth:`RelayClient.fetch`, which prefers a relay on its own host and
then maps the relay's shared memory instead of copying the bytes.

Behaviour under failure:

- The master is resolved through the coordinator (election
  ``relay-master``). A publish that fails because the master died or lost the
  election is retried on the newly elected master, with bounded jittered
  backoff, until ``publish_timeout_s``: at most the in-flight version is
  re-sent.
- Refusals (version not newer than the published one, malformed or oversized
  manifest, store full) are raised at once as the relay's error class
  (see ``relay_wire``); they are never retried.
- A fetch tries the local relay (waiting up to ``wait_s`` for a version it is
  still receiving), then the master, then the other relays. A first relay that
  does not answer a health call within ``probe_timeout_s`` (paused, cut off) is
  left out of that read, so a paused relay does not hold its readers for a call
  deadline.

Invariants: a :class:`FetchedWeights` is always a complete version whose
chunks were verified (by the relay that stored it, and by this client when the
bytes crossed a network); buffers passed to ``publish`` are read, never kept
after it returns.

Never imports torch or numpy.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import mmap
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgspec

from laminar_common.auth import CurveAuth, TlsFiles, grpc_channel
from laminar_common.codec import WeightManifest
from laminar_common.errors import (
    CoordinationError,
    EtcdUnavailableError,
    LaminarError,
    ProtocolError,
    PublishSuperseded,
    TransportError,
)
from laminar_common.membership import Coordinator, VersionRecord
from laminar_common.net import host_identity
from laminar_common.relay.manifests import (
    DEFAULT_ALIGNMENT,
    DEFAULT_CHECKSUM,
    DEFAULT_CHUNK_BYTES,
    ChunkPayload,
    NamedBuffer,
    as_named_buffers,
    build_manifest,
    checksum,
    digest_of,
    flatten,
    iter_chunks,
    plan_chunks,
    plan_tensors,
    tensor_views,
    validate_manifest,
    verify_buffer,
    verify_chunk,
)
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.publish import ChunkSenders, PublishSession
from laminar_common.relay.wire import (
    GRPC_OPTIONS,
    MASTER_ELECTION,
    RELAY_ROLE,
    NotMasterError,
    VersionNotFoundError,
    call_relay,
    error_from_rpc,
    manifest_from_proto,
    protocol_metadata,
)

__all__ = ["RelayClient", "PublishResult", "PublishSuperseded", "FetchedWeights", "RelayHealth",
           "RelayRef"]

log = logging.getLogger(__name__)

TensorLike = NamedBuffer | tuple[str, str, Sequence[int], Any]


@dataclass(frozen=True, slots=True)
class RelayRef:
    """One relay as the client addresses it."""

    member_id: str
    address: str
    host: str = ""
    """Its host id (equal to the client's: same host, shared memory may be mapped)."""
    started_at: float = 0.0
    """When its process registered (with ``member_id``: which process it is)."""


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What :meth:`RelayClient.publish` handed off."""

    version: int
    master_id: str
    total_bytes: int
    chunks: int
    seconds: float
    attempts: int
    manifest: WeightManifest


@dataclass(frozen=True, slots=True)
class RelayHealth:
    """A relay's answer to ``Health``."""

    relay_id: str
    master: bool
    master_id: str
    versions: tuple[int, ...]
    receiving: tuple[int, ...]
    upstream_id: str
    downstream_id: str
    chain: tuple[str, ...]
    used_bytes: int
    max_bytes: int
    readers: int
    protocol_version: int
    package_version: str
    data_endpoint: str
    forwarded_version: int
    serving: bool
    rejected: dict[str, int] = field(default_factory=dict)
    sealed_at: dict[int, float] = field(default_factory=dict)
    begun_at: dict[int, float] = field(default_factory=dict)
    first_chunk_at: dict[int, float] = field(default_factory=dict)
    """Unix time at which each version held was sealed on this relay."""


class FetchedWeights:
    """A complete weight version, readable as one flat buffer or per tensor.

    ``source`` is ``"shm"`` when ``buffer`` maps the relay's shared memory (no
    copy; the relay keeps the version until :meth:`release`), ``"stream"``
    when the bytes were copied over the network into this process, or
    ``"delta"`` when the version was rebuilt here from a base version and one
    or more delta versions (verified against the full version's checksums).
    ``wire_bytes`` counts the version bytes read to get it (deltas included).
    Use as a context manager, or call :meth:`release` once the weights are
    loaded; the buffer stays readable afterwards, but the relay may then drop
    the version.
    """

    def __init__(
        self,
        manifest: WeightManifest,
        buffer: memoryview,
        source: str,
        relay_id: str,
        release: Callable[[], None] | None = None,
        wire_bytes: int | None = None,
    ) -> None:
        self.manifest = manifest
        self.buffer = buffer
        self.source = source
        self.relay_id = relay_id
        self._release = release
        self.wire_bytes = manifest.total_bytes if wire_bytes is None else wire_bytes

    @property
    def version(self) -> int:
        return self.manifest.version

    def tensors(self) -> dict[str, memoryview]:
        """Zero-copy byte views of every tensor, by name (dtype/shape are in the manifest)."""
        return tensor_views(self.manifest, self.buffer)

    def release(self) -> None:
        """Give the relay its reader lease back (idempotent)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> FetchedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Backoff:
    def __init__(self, initial: float = 0.1, maximum: float = 2.0) -> None:
        self.initial, self.maximum, self.attempt = initial, maximum, 0

    def next_delay(self) -> float:
        delay = min(self.maximum, self.initial * (2**self.attempt))
        self.attempt += 1
        return random.uniform(delay / 2, delay)


@dataclass(slots=True)
class _DeltaBase:
    """The version a publisher's next delta is taken against."""

    version: int
    manifest: WeightManifest
    flat: bytearray
    master_id: str
    since_full: int


class _MasterChanged(TransportError):
    """The relay a publish was talking to is no longer the master (it stopped answering)."""


class RelayClient:
    """Publishes to and fetches from the relay tier of one job.

    Args:
        coordinator: the job's coordinator, used read-only to find relays,
            the master and the latest version (the client does not register).
        address: instead of a coordinator, one relay's gRPC ``host:port``
            (used as master and as the only read source).
        client_id: names this client in relay logs and reader leases.
        host: this machine's host id (:func:`~laminar_common.net.host_identity`), to
            recognise same-host relays (default: this machine's).
        chunk_bytes: chunk size of published versions.
        rpc_timeout_s: deadline of each short control call.
        publish_timeout_s: total time a publish may take, retries included.
        failover_wait_s: after a master fails, how long to wait for another
            relay to win the election before trying the same one again.
        hash_threads: threads checksumming chunks while they are sent.
        send_timeout_s: a chunk the master does not take within this fails the
            attempt (how long a publish notices a master that died mid-send).
        use_shared_memory: map a same-host relay's memory instead of streaming.
        tls: CA (and client certificate for mutual TLS) to reach relays over TLS.
        curve: CURVE keys for the weight data plane (a publisher pushes chunks over it).
        delta_full_every: 0 publishes every version in full. K > 0 publishes a
            version as a delta against the one this client published before
            (:mod:`laminar_common.relay.delta`), with a full version every K
            versions, and also whenever the master relay changed, the layout
            changed, or the delta would be at least half the full version's
            bytes (``publish(full=True)`` asks for one). Costs one host copy of
            the published version, kept as the next delta's base.
        probe_timeout_s: before a read that may wait at its first relay, that relay
            must answer a health call within this; one that does not (paused, cut off)
            is left out of the read (where another relay is there to read from).
    """

    def __init__(
        self,
        coordinator: Coordinator | None = None,
        *,
        address: str | None = None,
        client_id: str | None = None,
        host: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        alignment: int = DEFAULT_ALIGNMENT,
        rpc_timeout_s: float = 10.0,
        publish_timeout_s: float = 300.0,
        failover_wait_s: float = 10.0,
        max_attempts: int = 8,
        hash_threads: int = 2,
        send_hwm: int = 8,
        send_timeout_s: float = 10.0,
        use_shared_memory: bool = True,
        tls: TlsFiles | None = None,
        curve: CurveAuth | None = None,
        delta_full_every: int = 0,
        probe_timeout_s: float = 1.0,
    ) -> None:
        if (coordinator is None) == (address is None):
            raise ValueError("give exactly one of coordinator or address")
        plan_chunks(1, chunk_bytes)  # validates chunk_bytes
        self._coord = coordinator
        self._address = address
        self.client_id = client_id or f"client-{socket.gethostname()}-{os.getpid()}"
        self.host = host or host_identity()
        self.chunk_bytes = chunk_bytes
        self.alignment = alignment
        self.rpc_timeout_s = rpc_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self.failover_wait_s = failover_wait_s
        self.probe_timeout_s = probe_timeout_s
        self.max_attempts = max(1, max_attempts)
        self.hash_threads = max(1, hash_threads)
        self.use_shared_memory = use_shared_memory
        self.shm_fallbacks = 0
        """Same-host fetches that had to stream because shared memory was unusable."""
        self.delta_fetches = 0
        """Versions this client rebuilt from deltas."""
        if delta_full_every < 0:
            raise ValueError(f"delta_full_every must be >= 0, got {delta_full_every}")
        self.delta_full_every = delta_full_every
        self._delta_base: _DeltaBase | None = None
        self.tls = tls
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, relay_pb2_grpc.RelayStub]] = {}
        self._senders = ChunkSenders(hwm=send_hwm, send_timeout_s=send_timeout_s, auth=curve)
        self._suspect: tuple[str, float] | None = None
        self._suspect_probed_at = 0.0
        self._closed = threading.Event()
        self._hash_pool: ThreadPoolExecutor | None = None
        self._async_pool: ThreadPoolExecutor | None = None

    # -- plumbing -----------------------------------------------------------

    def _stub(self, address: str) -> relay_pb2_grpc.RelayStub:
        with self._lock:
            if self._closed.is_set():
                raise TransportError("RelayClient is closed")
            entry = self._channels.get(address)
            if entry is None:
                channel = grpc_channel(address, self.tls, GRPC_OPTIONS)
                entry = (channel, relay_pb2_grpc.RelayStub(channel))
                self._channels[address] = entry
            return entry[1]

    def _call_while_master(self, method: Any, request: Any, what: str, timeout: float, *,
                           relay: RelayRef) -> Any:
        """A call to the master that may take long (a commit waits for every chunk), given
        up as soon as another relay wins the election: a master that is paused (SIGSTOP,
        a GC or network pause) loses its lease, and the publish moves on to the new one
        instead of waiting for the old one to wake."""
        if self._coord is None:
            return call_relay(method, request, what, timeout)
        call = method.future(request, timeout=max(0.1, timeout), metadata=protocol_metadata())
        while True:
            try:
                return call.result(timeout=0.5)
            except grpc.FutureTimeoutError:
                pass
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, what) from exc
            try:
                leader = self._coord.leader(MASTER_ELECTION)
            except CoordinationError:
                continue  # cannot tell from here: keep waiting for the master's answer
            if leader is not None and leader != relay.member_id:
                call.cancel()
                raise _MasterChanged(f"{what}: relay {leader!r} won the master election while "
                                     f"{relay.member_id!r} was not answering")

    def relays(self) -> dict[str, RelayRef]:
        """Live relays by member id (the fixed address alone without a coordinator)."""
        if self._coord is None:
            assert self._address is not None
            return {self._address: RelayRef(self._address, self._address)}
        return {
            mid: RelayRef(mid, rec.address, rec.host_id, rec.started_at)
            for mid, rec in self._coord.members(RELAY_ROLE).items()
        }

    def master(self, wait_s: float = 0.0) -> RelayRef:
        """The master relay, waiting up to ``wait_s`` for one to be elected.

        Raises:
            TransportError: no master was elected in time.
        """
        return self._master(time.monotonic() + wait_s)

    def _master(self, deadline: float) -> RelayRef:
        if self._coord is None:
            assert self._address is not None
            return RelayRef(self._address, self._address)
        # Short polls while a master just failed: a standby takes over within a
        # probe interval when the old one's port refuses connections.
        backoff = _Backoff(maximum=0.5 if self._suspect is not None else 2.0)
        problem = "no relay has won the master election"
        while True:
            try:
                leader = self._coord.leader(MASTER_ELECTION)
                rec = None if leader is None else self._coord.members(RELAY_ROLE).get(leader)
                if rec is not None:
                    ref = RelayRef(rec.member_id, rec.address, rec.host_id, rec.started_at)
                    if not self._is_suspect(ref) or self._answers_again(ref):
                        return ref
                    problem = f"master {leader!r} just failed and no other relay took over yet"
                elif leader is not None:
                    problem = f"master {leader!r} has no live member record"
            except CoordinationError as exc:
                problem = f"etcd lookup failed: {exc}"
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"no usable relay master for job {self._coord.keys.job!r}: {problem}; are "
                    "laminar-relay processes running for this job?"
                )
            self._closed.wait(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
            if self._closed.is_set():
                raise TransportError("RelayClient is closed")

    def _answers_again(self, ref: RelayRef) -> bool:
        """Whether the suspect master, still the master, answers a health call within
        ``probe_timeout_s`` (at most 0.5 s; asked at most once a second, so a paused master
        delays noticing its successor by no more than that): then the failure was its link
        (cut and healed) or a moment's slowness, not its death, and waiting
        ``failover_wait_s`` for another master that will not come would only stall the
        publish. A dead master is refused, a paused one does not answer in time."""
        now = time.monotonic()
        if now - self._suspect_probed_at < 1.0:
            return False
        self._suspect_probed_at = now
        try:
            call_relay(self._stub(ref.address).Health, relay_pb2.HealthRequest(),
                       f"health of relay {ref.member_id}", min(self.probe_timeout_s, 0.5))
        except LaminarError:
            return False
        log.info("master %s answers again; publishing to it", ref.member_id)
        self._suspect = None
        return True

    def _is_suspect(self, ref: RelayRef) -> bool:
        """The master a publish just failed on, the same process (a relay restarted
        under the same member id is another one), within ``failover_wait_s``."""
        suspect = self._suspect
        return (
            suspect is not None
            and suspect[0] == (ref.member_id, ref.started_at, ref.address)
            and time.monotonic() - suspect[1] < self.failover_wait_s
        )

    # -- publish ------------------------------------------------------------

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
        specs, total = plan_tensors(buffers, self.alignment)
        layout = WeightManifest(
            version=version,
            total_bytes=total,
            chunk_bytes=self.chunk_bytes,
            tensors=specs,
            chunks=plan_chunks(total, self.chunk_bytes),
            created_at=time.time(),
            trainer_step=trainer_step,
            checksum_algo=DEFAULT_CHECKSUM,
        )
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
                sent_layout, sent_buffers = layout, buffers
                if delta is not None and delta[0].base_version >= 0 \
                        and self._delta_base is not None \
                        and relay.member_id == self._delta_base.master_id \
                        and self._holds(relay, delta[0].base_version):
                    sent_layout, sent_buffers = delta[0], delta[1]
                try:
                    manifest = self._publish_once(relay, sent_layout, sent_buffers, deadline)
                except (NotMasterError, TransportError, EtcdUnavailableError) as exc:
                    if isinstance(exc, NotMasterError) and self._coord is None:
                        raise  # a fixed address cannot be re-resolved
                    last = exc
                    self._suspect = ((relay.member_id, relay.started_at, relay.address),
                                     time.monotonic())
                    log.warning(
                        "publish of version %d to master %s failed (attempt %d): %s",
                        version,
                        relay.member_id,
                        attempt,
                        exc,
                    )
                    if time.monotonic() >= deadline:
                        break
                    if superseded is not None and superseded():
                        raise PublishSuperseded(
                            f"publish of weight version {version} given up after {attempt} "
                            f"attempt(s): a newer version waits to be published") from exc
                    self._closed.wait(
                        min(backoff.next_delay(), max(0.0, deadline - time.monotonic()))
                    )
                    continue
                self._suspect = None
                if delta is not None:  # the next delta is taken against this version
                    since = self._delta_base.since_full + 1 \
                        if sent_layout is not layout and self._delta_base is not None else 0
                    self._delta_base = _DeltaBase(version, delta[2], delta[3], relay.member_id,
                                                  since)
                return PublishResult(
                    version,
                    relay.member_id,
                    sent_layout.total_bytes,
                    len(sent_layout.chunks),
                    time.monotonic() - start,
                    attempt,
                    manifest,
                )
        raise TransportError(
            f"publish of weight version {version} did not reach a master relay "
            f"({self.max_attempts} attempts, {self.publish_timeout_s:.0f}s): {last}"
        ) from last

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

    # -- fetch --------------------------------------------------------------

    def latest(self) -> VersionRecord | None:
        """The latest complete version: from etcd, or the fixed relay's newest."""
        if self._coord is not None:
            return self._coord.latest_version()
        relay = self._master(time.monotonic())
        reply = call_relay(
            self._stub(relay.address).Latest,
            relay_pb2.LatestRequest(),
            f"latest on relay {relay.address}",
            self.rpc_timeout_s,
        )
        if reply.version < 0:
            return None
        return VersionRecord(
            version=reply.version,
            total_bytes=reply.total_bytes,
            master_id=reply.relay_id,
            trainer_step=reply.trainer_step,
        )

    def _read_candidates(self) -> list[RelayRef]:
        relays = self.relays()
        if self._coord is None:
            return list(relays.values())
        leader = self._coord.leader(MASTER_ELECTION)

        def rank(r: RelayRef) -> bytes:
            return hashlib.blake2b(
                f"{self.client_id}/{r.member_id}".encode(), digest_size=8
            ).digest()

        local = sorted((r for r in relays.values() if r.host == self.host), key=rank)
        rest = sorted((r for r in relays.values() if r.host != self.host), key=rank)
        rest.sort(key=lambda r: r.member_id != leader)
        return local + rest

    def fetch(
        self,
        version: int | None = None,
        *,
        wait_s: float = 30.0,
        verify: bool | None = None,
        relay: str | None = None,
        base: FetchedWeights | None = None,
    ) -> FetchedWeights:
        """Read one complete weight version.

        A version published as a delta (:mod:`laminar_common.relay.delta`) is
        rebuilt here: over ``base`` when the delta applies to it, else over its
        own base version, fetched the same way (down to a full version). The
        result is always checked against the full version's checksums.

        Args:
            version: the version to read; ``None`` for the latest (from etcd
                when the client has a coordinator, else the relay's newest).
            wait_s: how long the first relay tried may wait for a version it
                is still receiving through the chain.
            verify: check every chunk checksum here. Default: yes for bytes
                that crossed the network, no for same-host shared memory
                (the relay verified them when it stored them).
            relay: read from this relay only (member id or ``host:port``).
            base: a version this reader holds in its own memory (not a
                shared-memory mapping), for deltas to apply to.

        Raises:
            VersionNotFoundError: no relay holds the version (or none is published).
            TransportError: no relay could be reached.
            ProtocolError: the bytes failed verification.
        """
        if version is None and self._coord is not None:
            record = self._coord.latest_version()
            if record is None:
                raise VersionNotFoundError(
                    f"no weight version has been published yet in job {self._coord.keys.job!r}"
                )
            version = record.version
        if relay is not None:
            known = self.relays()
            candidates = [known.get(relay) or RelayRef(relay, relay)]
        else:
            candidates = self._read_candidates()
        if not candidates:
            raise TransportError("no relay is registered for this job")
        if len(candidates) > 1 and wait_s > 0 and not self._answers(candidates[0]):
            # The first relay may wait ``wait_s`` for a version still on its way; one
            # that does not answer at all (paused, cut off) would hold the read for a
            # whole call deadline, first or last. This read goes without it.
            log.info("relay %s does not answer within %.1fs; reading from the others",
                     candidates[0].member_id, self.probe_timeout_s)
            candidates = candidates[1:]
        errors: list[str] = []
        last: LaminarError | None = None
        for i, ref in enumerate(candidates):
            try:
                fetched = self._fetch_from(ref, version, wait_s if i == 0 else 0.0, verify)
            except (VersionNotFoundError, TransportError) as exc:
                errors.append(f"{ref.member_id}: {exc}")
                last = exc
                continue
            if fetched.manifest.full is None:
                return fetched
            return self._rebuild(fetched, base, wait_s, verify)
        what = "the latest version" if version is None else f"weight version {version}"
        cls = VersionNotFoundError if isinstance(last, VersionNotFoundError) else TransportError
        raise cls(f"could not fetch {what} from any relay: " + "; ".join(errors)) from last

    def _answers(self, ref: RelayRef) -> bool:
        """Whether ``ref`` answers a health call within ``probe_timeout_s``."""
        try:
            call_relay(self._stub(ref.address).Health, relay_pb2.HealthRequest(),
                       f"health of relay {ref.member_id}", self.probe_timeout_s)
        except LaminarError:
            return False
        return True

    def _fetch_from(
        self, ref: RelayRef, version: int | None, wait_s: float, verify: bool | None
    ) -> FetchedWeights:
        stub = self._stub(ref.address)
        label = "latest" if version is None else f"version {version}"
        what = f"fetch of {label} from relay {ref.member_id}"
        reply = call_relay(
            stub.Fetch,
            relay_pb2.FetchRequest(
                version=-1 if version is None else version, reader_id=self.client_id, wait_s=wait_s
            ),
            what,
            wait_s + self.rpc_timeout_s,
        )
        relay_id = reply.relay_id or ref.member_id

        def release() -> None:
            self._release(ref, reply.lease)

        try:
            manifest = manifest_from_proto(reply.manifest)
            validate_manifest(manifest)
            if version is not None and manifest.version != version:
                raise ProtocolError(f"{what}: relay answered with version {manifest.version}")
            if self.use_shared_memory and reply.shm_path and reply.host == self.host:
                view = self._map_shared(reply.shm_path, manifest, verify=bool(verify))
                if view is not None:
                    return FetchedWeights(manifest, view, "shm", relay_id, release)
            buf = self._read_stream(stub, reply.lease, manifest, verify is not False, what)
        except BaseException:
            release()
            raise
        release()
        return FetchedWeights(manifest, memoryview(buf), "stream", relay_id)

    def _rebuild(self, delta: FetchedWeights, base: FetchedWeights | None, wait_s: float,
                 verify: bool | None) -> FetchedWeights:
        """The full version a fetched delta stands for, over ``base`` or its own base."""
        from laminar_common.relay.delta import apply_delta

        m = delta.manifest
        try:
            if base is not None and base.version == m.base_version \
                    and base.manifest.full is None and base.source != "shm":
                under, own = base, False
            else:
                if base is not None and base.version > m.base_version:
                    base = None  # a newer base is no use further down the chain
                under, own = self.fetch(m.base_version, wait_s=wait_s, verify=verify,
                                        base=base), True
            try:
                out = apply_delta(m, delta.buffer, under.buffer)
            finally:
                if own:
                    under.release()
        finally:
            delta.release()
        assert m.full is not None
        wire = delta.wire_bytes + (under.wire_bytes if own else 0)
        self.delta_fetches += 1
        return FetchedWeights(m.full, memoryview(out), "delta", delta.relay_id, wire_bytes=wire)

    def _shm_fallback(self, why: str) -> None:
        """Same host, but the relay's shared memory is not usable: stream (slower).

        Warned once per client (a container with its own /dev/shm stays that
        way), then counted at debug level.
        """
        self.shm_fallbacks += 1
        (log.warning if self.shm_fallbacks == 1 else log.debug)(
            "%s; fetching over the network instead (a copy)", why)

    def _map_shared(self, path: str, manifest: WeightManifest, verify: bool) -> memoryview | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            self._shm_fallback(f"cannot open relay shared memory {path} ({exc})")
            return None
        try:
            size = os.fstat(fd).st_size
            if size < manifest.total_bytes:
                self._shm_fallback(f"relay shared memory {path} is {size} bytes, "
                                   f"need {manifest.total_bytes}")
                return None
            mm = mmap.mmap(fd, manifest.total_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        view = memoryview(mm)
        if verify:
            verify_buffer(manifest, view)
        else:
            first = manifest.chunks[0]
            # Identity check: a same-named host with another relay must not pass.
            first_bytes = view[first.offset : first.offset + first.nbytes]
            if checksum(first_bytes, manifest.checksum_algo) != first.checksum:
                log.warning(
                    "relay shared memory %s does not hold version %d; streaming instead",
                    path,
                    manifest.version,
                )
                return None
        return view

    def _read_stream(
        self,
        stub: relay_pb2_grpc.RelayStub,
        lease: str,
        manifest: WeightManifest,
        verify: bool,
        what: str,
    ) -> bytearray:
        out = bytearray(manifest.total_bytes)
        expected = 0
        try:
            for chunk in stub.Read(
                relay_pb2.ReadRequest(lease=lease),
                timeout=self.rpc_timeout_s + manifest.total_bytes / 50e6,
                metadata=protocol_metadata(),
            ):
                if chunk.index != expected or expected >= len(manifest.chunks):
                    raise ProtocolError(f"{what}: got chunk {chunk.index}, expected {expected}")
                spec = manifest.chunks[expected]
                if verify:
                    verify_chunk(spec, chunk.data, manifest.checksum_algo)
                elif len(chunk.data) != spec.nbytes:
                    raise ProtocolError(f"{what}: chunk {expected} has {len(chunk.data)} bytes")
                out[spec.offset : spec.offset + spec.nbytes] = chunk.data
                expected += 1
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, what) from exc
        if expected != len(manifest.chunks):
            raise ProtocolError(
                f"{what}: stream ended after {expected} of {len(manifest.chunks)} chunks"
            )
        return out

    def _release(self, ref: RelayRef, lease: str) -> None:
        if not lease:
            return
        try:
            call_relay(
                self._stub(ref.address).Release,
                relay_pb2.ReleaseRequest(lease=lease),
                f"release on relay {ref.member_id}",
                self.rpc_timeout_s,
            )
        except LaminarError as exc:
            log.warning(
                "could not release reader lease on relay %s (it will expire): %s",
                ref.member_id,
                exc,
            )

    # -- status -------------------------------------------------------------

    def health(self, relay: str | None = None) -> RelayHealth:
        """Health of one relay (member id or ``host:port``; default: the master)."""
        if relay is None:
            ref = self._master(time.monotonic())
        else:
            ref = self.relays().get(relay) or RelayRef(relay, relay)
        r = call_relay(
            self._stub(ref.address).Health,
            relay_pb2.HealthRequest(),
            f"health of relay {ref.member_id}",
            self.rpc_timeout_s,
        )
        return RelayHealth(
            relay_id=r.relay_id,
            master=r.master,
            master_id=r.master_id,
            versions=tuple(r.versions),
            receiving=tuple(r.receiving),
            upstream_id=r.upstream_id,
            downstream_id=r.downstream_id,
            chain=tuple(r.chain),
            used_bytes=r.used_bytes,
            max_bytes=r.max_bytes,
            readers=r.readers,
            protocol_version=r.protocol_version,
            package_version=r.package_version,
            data_endpoint=r.data_endpoint,
            forwarded_version=r.forwarded_version,
            serving=r.serving,
            rejected=dict(r.rejected),
            sealed_at=dict(r.sealed_at),
            begun_at=dict(r.begun_at),
            first_chunk_at=dict(r.first_chunk_at),
        )

    def close(self) -> None:
        """Close channels, sockets and worker threads (idempotent)."""
        self._closed.set()
        with self._lock:
            channels, self._channels = self._channels, {}
            pools = [p for p in (self._hash_pool, self._async_pool) if p is not None]
            self._hash_pool = self._async_pool = None
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._publish_lock:
            self._senders.close()
        for channel, _ in channels.values():
            channel.close()

    def __enter__(self) -> RelayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
