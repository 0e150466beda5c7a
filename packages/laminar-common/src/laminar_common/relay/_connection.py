"""The relay client's core: connections, the master, status; both halves build on it.

:class:`RelayConnection` holds a client's settings, its gRPC channels and data-plane
senders, finds relays and the master through the coordinator (election
``relay-master``, with the suspect-master logic a failed publish leaves behind), and
answers ``latest`` and ``health``. The publish half is
:class:`~laminar_common.relay.writer.RelayPublisher`, the fetch half
:class:`~laminar_common.relay.reader.RelayReader`;
:class:`~laminar_common.relay.client.RelayClient` is both. The value types the halves
return live here too.

Never imports torch or numpy.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self

import grpc

from laminar_common.auth import CurveAuth, TlsFiles
from laminar_common.codec import WeightManifest
from laminar_common.errors import (
    CoordinationError,
    LaminarError,
    TransportError,
)
from laminar_common.membership import Coordinator, VersionRecord
from laminar_common.net import host_identity
from laminar_common.relay.manifests import (
    DEFAULT_ALIGNMENT,
    DEFAULT_CHUNK_BYTES,
    NamedBuffer,
    plan_chunks,
    tensor_views,
)
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.publish import ChunkSenders
from laminar_common.relay.wire import (
    MASTER_ELECTION,
    RELAY_ROLE,
    RelayStubs,
    call_relay,
    error_from_rpc,
    protocol_metadata,
)

__all__ = ["RelayConnection", "RelayRef", "PublishResult", "RelayHealth", "FetchedWeights",
           "TensorLike"]


# The client's halves log as the client (one logger to configure, as before the split).
log = logging.getLogger("laminar_common.relay.client")

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




class RelayConnection:
    """Connections to the relay tier of one job (see module docstring).

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
        self._stubs = RelayStubs(tls)
        self._senders = ChunkSenders(hwm=send_hwm, send_timeout_s=send_timeout_s, auth=curve)
        self._suspect: tuple[str, float] | None = None
        self._suspect_probed_at = 0.0
        self._closed = threading.Event()
        self._hash_pool: ThreadPoolExecutor | None = None
        self._async_pool: ThreadPoolExecutor | None = None

    def _stub(self, address: str) -> relay_pb2_grpc.RelayStub:
        if self._closed.is_set():
            raise TransportError("RelayClient is closed")
        return self._stubs.get(address)

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
            pools = [p for p in (self._hash_pool, self._async_pool) if p is not None]
            self._hash_pool = self._async_pool = None
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._publish_lock:
            self._senders.close()
        self._stubs.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
