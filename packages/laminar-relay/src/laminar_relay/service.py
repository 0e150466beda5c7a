"""RelayService: one relay process, wired together.

Owns the relay's lifecycle and background work: the data-plane intake
(:mod:`.intake`: the receiver and the pool that checksums and stores incoming
chunks), the gRPC server, the chain forwarder (:mod:`.chain`), registration in
etcd (control address, data-plane address, store kind), the master election
(:mod:`.election`) and the control loop that follows membership to rebuild the
chain. Its metrics are read from its health reply (:mod:`.telemetry`).

Behaviour:

- Every relay campaigns for ``relay-master`` whenever nobody holds it; the
  election key is bound to the winner's lease. Publishers re-resolve the master.
- A master whose process is gone fails over at once: the relay after it in the
  chain checks every ``master_probe_interval_s`` that the master's gRPC port
  accepts connections; a refused connection (the port is closed, so the
  process is dead, not paused or cut off) makes it revoke the master's lease
  and campaign. A relay restarted under its old member id takes the election
  back from its dead predecessor the same way. A paused or partitioned master
  (timeouts, not refusals) loses the election when its lease expires, about
  one TTL.
- Fencing: the master makes a version visible in etcd only while it still
  holds the very election key it won (one transaction), so an old master that
  wakes or reconnects after losing it cannot publish a version twice.
- The chain is recomputed on every membership change (and every
  ``control_interval_s``): a relay whose lease expired drops out and its
  neighbours are joined; the new downstream is offered the newest version.
- etcd outages are logged and retried by the control loop; the relay keeps
  serving what it holds.

Invariants: components get plain arguments (see :func:`make_relay_service`
for the config mapping); the master publishes a version in etcd only from the
store's ``before_seal`` hook, i.e. after every chunk is stored and verified.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from laminar_common.auth import CurveAuth, TlsFiles, grpc_server_credentials
from laminar_common.codec import PROTOCOL_VERSION
from laminar_common.errors import (
    LaminarError,
    TransportError,
)
from laminar_common.membership import Coordinator, MemberRecord, MembershipEvent
from laminar_common.metrics import Metric, MetricsServer
from laminar_common.net import host_identity, is_wildcard
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.wire import (
    EXTRA_DATA_ENDPOINT,
    EXTRA_STORE,
    GRPC_OPTIONS,
    RELAY_ROLE,
    RelayStubs,
)
from laminar_common.roles import Extra
from laminar_common.service import Service

from .chain import ChainForwarder
from .config import RelayConfig
from .election import ChainPosition
from .intake import ChunkIntake
from .memory import make_allocator
from .server import RelayServicer
from .store import WeightStore
from .telemetry import relay_metrics
from .version import __version__

__all__ = ["RelayService", "make_relay_service", "default_member_id"]

log = logging.getLogger(__name__)

# No SO_REUSEPORT: a second relay given the same port must fail to bind, not share it.
_SERVER_OPTIONS = (*GRPC_OPTIONS, ("grpc.so_reuseport", 0))
_RPC_TIMEOUT_S = 10.0
"""Deadline of a control call to another relay."""


def default_member_id() -> str:
    """``relay-<hostname>-<pid>``, made safe for an etcd key segment."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"relay-{host or 'host'}-{os.getpid()}"


class RelayService(Service):
    """One relay: store, gRPC control API, data plane, chain, etcd membership.

    Args:
        member_id: this relay's id in the job.
        coordinator: the job's coordinator (real etcd or the in-memory twin).
        store: the weight store.
        config: every setting, one value (:class:`~laminar_relay.config.RelayConfig`:
            ``grpc_port``, ``grpc_workers``, ``max_fetch_wait_s``, ``host``; ``data``
            (port, chunk size cap, backpressure, verify threads); ``chain`` (forward
            pacing, commit and session timeouts, control and master-probe periods,
            default control period TTL / 3); ``store.backend`` and
            ``store.reader_lease_s``; ``metrics``; ``auth.mutual_tls``).
        bind_host: interface the servers listen on (default ``config.bind_host``).
        advertise_host: host name or IP peers use to reach this relay (default:
            ``bind_host``; required when that is a wildcard).
        tls_server, tls_client, curve: TLS for the control API and CURVE for the data
            plane, made (:func:`make_relay_service` makes them from ``config.auth``).
    """

    name = "relay"

    def __init__(self, *, member_id: str, coordinator: Coordinator, store: WeightStore,
                 config: RelayConfig | None = None, bind_host: str | None = None,
                 advertise_host: str | None = None, tls_server: TlsFiles | None = None,
                 tls_client: TlsFiles | None = None, curve: CurveAuth | None = None) -> None:
        super().__init__()
        cfg = self.config = config if config is not None else RelayConfig()
        self._curve = curve
        self._tls_server = tls_server
        self._tls_client = tls_client
        self._mutual_tls = cfg.auth.mutual_tls
        self.member_id = member_id
        self.metrics: MetricsServer | None = None
        self.coordinator = coordinator
        self.store = store
        bind_host = bind_host or cfg.bind_host or "127.0.0.1"
        if advertise_host is None and is_wildcard(bind_host):
            raise ValueError(f"bind_host {bind_host!r} listens on every interface: give "
                             "advertise_host, the address peers reach this relay at "
                             "(make_relay_service resolves it from the config)")
        self.bind_host = bind_host
        self.advertise_host = advertise_host or bind_host
        self.host = cfg.host or host_identity()
        self.store_backend = cfg.store.backend
        self._control_interval_s = cfg.chain.control_interval_s or max(0.2, cfg.etcd.ttl_s / 3)
        self._rpc_timeout_s = _RPC_TIMEOUT_S
        self.address = ""
        self.data_endpoint = ""
        self._wake = threading.Event()
        self.position = ChainPosition(coordinator, member_id, self._set_downstream, self._wake,
                                      cfg.chain.master_probe_interval_s)
        """The master election, the chain and the master probe (:mod:`.election`)."""
        self._stubs = RelayStubs(tls_client)
        """gRPC stubs of the other relays (the chain's commits, forwarding)."""
        self.intake: ChunkIntake | None = None
        """The data plane's receiving end (:mod:`.intake`)."""
        self._server: grpc.Server | None = None
        self.servicer: RelayServicer | None = None
        self.forwarder: ChainForwarder | None = None

    # -- lifecycle ----------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        data, chain = cfg.data, cfg.chain
        self.intake = ChunkIntake(self.store, self.member_id, data, bind_host=self.bind_host,
                                  advertise_host=self.advertise_host, curve=self._curve,
                                  stopping=self.stopping)
        self.data_endpoint = self.intake.endpoint
        self.forwarder = ChainForwarder(
            self.store, self.member_id, self._stub, send_hwm=data.send_hwm,
            send_timeout_s=data.send_timeout_s, rpc_timeout_s=self._rpc_timeout_s,
            commit_timeout_s=chain.commit_timeout_s,
            max_bytes_per_s=chain.max_forward_bytes_per_s, curve=self._curve).start()
        self.servicer = RelayServicer(
            self.store, relay_id=self.member_id, host=self.host,
            data_endpoint=self.data_endpoint, master_id=self.position.current_master,
            latest_published=self._latest_published, make_visible=self.position.make_visible,
            on_begin=self.forwarder.offer, health=self.health,
            commit_timeout_s=chain.commit_timeout_s, reader_lease_s=cfg.store.reader_lease_s,
            max_fetch_wait_s=cfg.max_fetch_wait_s,
            max_waiting_fetches=max(1, cfg.grpc_workers - 4),
            check_publisher=self._tls_server is not None and self._mutual_tls)
        self.address = f"{self.advertise_host}:{self._serve_grpc()}"
        self.coordinator.watch_members(self._on_membership, role=RELAY_ROLE)
        self._register()
        self.position.refresh()
        self.spawn(self._control_loop, "control")
        if chain.master_probe_interval_s > 0:
            self.spawn(lambda: self.position.probe_loop(self.stopping), "master-probe")

    def _serve_grpc(self) -> int:
        """Start the control API's gRPC server; returns its port."""
        self._server = grpc.server(
            ThreadPoolExecutor(self.config.grpc_workers, thread_name_prefix="relay-grpc"),
            options=_SERVER_OPTIONS)
        relay_pb2_grpc.add_RelayServicer_to_server(self.servicer, self._server)
        where = f"{self.bind_host}:{self.config.grpc_port}"
        try:
            port = self._server.add_secure_port(
                where, grpc_server_credentials(self._tls_server, self._mutual_tls)
            ) if self._tls_server is not None else self._server.add_insecure_port(where)
        except RuntimeError as exc:
            raise TransportError(f"cannot bind the relay gRPC server on {where}: {exc}") from exc
        if port == 0:
            raise TransportError(f"cannot bind the relay gRPC server on {where}")
        self._server.start()
        return port

    def _register(self) -> None:
        """The relay's member record (with its metrics endpoint, when on)."""
        extra = {EXTRA_DATA_ENDPOINT: self.data_endpoint, EXTRA_STORE: self.store_backend,
                 Extra.READY: "1"}
        metrics = self.config.metrics
        if metrics.port is not None:
            self.metrics = MetricsServer(RELAY_ROLE, self.coordinator.keys.job, self.member_id,
                                         self._metrics)
            extra[Extra.METRICS] = self.metrics.start(metrics.host, metrics.port,
                                                       self.advertise_host)
        self.coordinator.register(MemberRecord(
            member_id=self.member_id, role=RELAY_ROLE, address=self.address,
            host_id=self.host, package_version=__version__, protocol_version=PROTOCOL_VERSION,
            capacity=self.store.max_bytes, extra=extra))
        log.info("relay %s serving: control %s, data %s, store %s (%d bytes max)",
                 self.member_id, self.address, self.data_endpoint, self.store_backend,
                 self.store.max_bytes)

    def _close(self) -> None:
        # Revoking the lease removes this relay's record and, if it is the master,
        # the election key with it: the others rebuild the chain and elect at once.
        self.coordinator.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self._server is not None:
            self._server.stop(grace=1.0).wait(5.0)
        if self.forwarder is not None:
            self.forwarder.close()
        if self.intake is not None:
            self.intake.close()
        self.store.close()
        self._stubs.close()

    # -- control loop -------------------------------------------------------

    def _on_membership(self, event: MembershipEvent) -> None:
        # Called from the coordinator's thread (inline, with its lock, for the twin):
        # only wake the control loop.
        self._wake.set()

    def _control_loop(self) -> None:
        next_check = time.monotonic() + self._control_interval_s
        while not self.stopping.is_set():
            # Short waits so close() is not held up; membership events wake us at once.
            if not self._wake.wait(0.1) and time.monotonic() < next_check:
                continue
            self._wake.clear()
            next_check = time.monotonic() + self._control_interval_s
            try:
                self.position.refresh()
            except LaminarError as exc:
                log.warning(
                    "relay %s: election/chain check failed, retrying: %s", self.member_id, exc
                )
            self.store.maintain(self.config.chain.session_idle_s)

    # -- what the tier sees of this relay --------------------------------------

    @property
    def is_master(self) -> bool:
        return self.position.is_master

    @property
    def master_id(self) -> str | None:
        return self.position.master_id

    @property
    def chain(self) -> list[str]:
        return self.position.chain

    @property
    def upstream_id(self) -> str:
        return self.position.upstream_id

    @property
    def takeovers(self) -> int:
        """Times this relay revoked a dead master's lease to take over."""
        return self.position.takeovers

    def _set_downstream(self, downstream: MemberRecord | None) -> None:
        assert self.forwarder is not None
        self.forwarder.set_downstream(downstream)

    # -- hooks for the servicer ----------------------------------------------

    def _latest_published(self) -> int:
        record = self.coordinator.latest_version()
        return -1 if record is None else record.version

    def _stub(self, address: str) -> relay_pb2_grpc.RelayStub:
        return self._stubs.get(address)

    # -- status -------------------------------------------------------------

    def _metrics(self) -> list[Metric]:
        return relay_metrics(self.health(), self.servicer.fetches if self.servicer else {})

    def health(self) -> relay_pb2.HealthReply:
        stats = self.store.stats()
        rejected: dict[str, int] = {}
        for source in (self.servicer.rejected if self.servicer else {},
                       self.intake.rejected() if self.intake else {}):
            for key, value in source.items():
                rejected[key] = rejected.get(key, 0) + int(value)
        forwarder = self.forwarder
        downstream = forwarder.downstream if forwarder else None
        return relay_pb2.HealthReply(
            relay_id=self.member_id,
            master=self.is_master,
            master_id=self.master_id or "",
            versions=stats["versions"],
            receiving=stats["receiving"],
            upstream_id=self.upstream_id,
            downstream_id=downstream.member_id if downstream else "",
            chain=self.chain,
            used_bytes=stats["used_bytes"],
            max_bytes=stats["max_bytes"],
            readers=stats["readers"],
            protocol_version=PROTOCOL_VERSION,
            package_version=__version__,
            data_endpoint=self.data_endpoint,
            forwarded_version=forwarder.forwarded_version if forwarder else -1,
            rejected=rejected,
            serving=self.state == "running",
            sealed_at=stats["sealed_at"],
            begun_at=stats["begun_at"],
            first_chunk_at=stats["first_chunk_at"],
        )


def make_relay_service(config: RelayConfig, coordinator: Coordinator | None = None) -> RelayService:
    """Build a :class:`RelayService` from a validated :class:`RelayConfig`.

    Args:
        coordinator: use this coordinator instead of connecting to
            ``config.etcd`` (tests pass the in-memory twin).

    Raises:
        EtcdUnavailableError: etcd could not be reached.
        LaminarError: the store backend is unavailable on this platform.
    """
    member_id = config.member_id or default_member_id()
    store = WeightStore(
        make_allocator(config.store.backend),
        max_bytes=config.store.max_bytes,
        max_version_bytes=config.store.version_limit,
        keep_versions=config.store.keep_versions,
        max_tensors=config.store.max_tensors,
        verify_forwarded=config.chain.verify_forwarded,
        name=f"laminar-{config.job}-{member_id}",
    )
    if coordinator is None:
        from laminar_common.etcd import make_coordinator

        coordinator = make_coordinator(config.etcd, config.job)
    listen = config.addresses()
    return RelayService(
        member_id=member_id, coordinator=coordinator, store=store, config=config,
        bind_host=listen.bind, advertise_host=listen.advertise,
        tls_server=TlsFiles.server_from_dir(config.auth.dir) if config.auth.dir else None,
        tls_client=TlsFiles.client_from_dir(config.auth.dir, "relay") if config.auth.dir else None,
        curve=config.auth.curve())
