"""The real :class:`~laminar_common.membership.Coordinator`, on etcd v3.

Owns the only use of the etcd client library (``pyetcd``, from the
``etcd-sdk-python`` distribution); its errors are re-raised here as
:class:`EtcdUnavailableError` / :class:`CoordinationError`.

TLS: on when ``ca_cert`` is given or the endpoints are ``https://``; with
``client_cert`` / ``client_key`` the member also proves itself to an etcd run
with ``--client-cert-auth``. The files are read once, at construction, so a
missing file fails at once with :class:`ConfigError`. An etcd that refuses
the handshake (TLS expected but not offered, unknown CA, missing client
certificate) fails like an unreachable one, within ``connect_timeout_s``,
with a message naming the endpoint and the TLS settings to check.

Behaviour under failure:

- Start-up retries the connection with bounded, jittered backoff for
  ``connect_timeout_s``, then raises :class:`EtcdUnavailableError`.
- A keepalive thread refreshes the lease every ``ttl/3``. When etcd is
  unreachable it backs off and keeps trying (the member never exits for it);
  when the lease turns out to be gone (etcd restarted or wiped, or the member
  was partitioned past its TTL) it grants a new lease and re-registers,
  re-campaigning for the elections it held.
- Each watch runs in its own thread: it lists the prefix, emits the diff
  against what it had seen, then watches from that revision. After a broken
  stream or a compacted revision it lists again, so no change is lost (some
  may arrive coalesced).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

from laminar_common.codec import PROTOCOL_VERSION
from laminar_common.config import check_etcd_tls
from laminar_common.errors import ConfigError, CoordinationError, EtcdUnavailableError, FencedError
from laminar_common.keys import JobKeys
from laminar_common.membership import (
    Coordinator,
    MemberRecord,
    MembershipEvent,
    VersionRecord,
    WatchHandle,
    check_protocol,
    decode_leader,
    decode_member,
    decode_members,
    decode_version,
    encode_record,
)

__all__ = ["EtcdCoordinator", "make_coordinator", "Backoff", "parse_endpoint"]

log = logging.getLogger(__name__)
_ETCD_ERRORS = (etcd_exc.Etcd3Exception, grpc.RpcError, ValueError)


def describe_error(exc: BaseException) -> str:
    """``repr(exc)``, plus the gRPC status behind it (the client library drops it).

    The status details are what tell a refused TLS handshake ("Socket closed",
    "CERTIFICATE_VERIFY_FAILED") from an etcd that is simply down.
    """
    if isinstance(exc, grpc.Call):
        return f"{type(exc).__name__}({exc.code().name}: {exc.details()})"
    cause = exc.__context__
    if isinstance(cause, grpc.Call):
        return f"{exc!r} ({cause.code().name}: {cause.details()})"
    return repr(exc)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (an ``http://`` or ``https://`` prefix is allowed)."""
    text = endpoint.split("://", 1)[-1].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise CoordinationError(f"etcd endpoint {endpoint!r} is not host:port")
    return host, int(port)


class Backoff:
    """Bounded exponential backoff with full jitter."""

    def __init__(self, initial: float = 0.1, maximum: float = 2.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.attempt = 0

    def next_delay(self) -> float:
        delay = min(self.maximum, self.initial * (2**self.attempt))
        self.attempt += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempt = 0


class EtcdCoordinator(Coordinator):
    """:class:`Coordinator` backed by a real etcd cluster."""

    def __init__(
        self,
        endpoints: Sequence[str],
        job: str,
        ttl_s: int = 10,
        connect_timeout_s: float = 30.0,
        rpc_timeout_s: float = 5.0,
        user: str | None = None,
        password: str | None = None,
        ca_cert: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
    ) -> None:
        """Connect, retrying with backoff for up to ``connect_timeout_s``.

        Raises:
            ConfigError: endpoints and TLS settings disagree, or a TLS file
                cannot be read.
            EtcdUnavailableError: etcd did not answer (or refused the TLS
                handshake, or the credentials) within ``connect_timeout_s``.
        """
        self.keys = JobKeys(job)
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        try:
            self.tls = check_etcd_tls(endpoints, ca_cert, client_cert, client_key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.ttl_s = int(ttl_s)
        self._rpc_timeout = rpc_timeout_s
        self._user, self._password = user, password
        self._tls_files = (ca_cert, client_cert, client_key)
        self._creds = self._credentials() if self.tls else None
        self._client_lock = threading.Lock()
        self._client: pyetcd.MultiEndpointEtcd3Client | None = None
        self._stop = threading.Event()
        self._state_lock = threading.RLock()
        self._record: MemberRecord | None = None
        self._lease_id: int | None = None
        self._elections: dict[str, str] = {}
        self._fences: dict[str, int] = {}
        """Election -> the create revision of the key this process won (its fencing
        token: a key deleted and won again, even by the same member id, has another)."""
        self._keepalive: threading.Thread | None = None
        self._watches: list[WatchHandle] = []
        self.reregistrations = 0
        self._connect(connect_timeout_s)

    # -- connection ---------------------------------------------------------

    def _credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials (system roots when no CA file is given)."""
        pem = []
        for field, path in zip(("ca_cert", "client_cert", "client_key"), self._tls_files):
            if path is None:
                pem.append(None)
                continue
            try:
                with open(path, "rb") as fh:
                    pem.append(fh.read())
            except OSError as exc:
                raise ConfigError(f"etcd.{field}: cannot read {path!r}: {exc}") from exc
        ca, cert, key = pem
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def _make_client(self) -> pyetcd.MultiEndpointEtcd3Client:
        creds = self._creds
        eps = [
            pyetcd.Endpoint(host, port, secure=creds is not None, creds=creds, time_retry=0.2)
            for host, port in self.endpoints
        ]
        client = pyetcd.MultiEndpointEtcd3Client(
            endpoints=eps, timeout=self._rpc_timeout, user=self._user, password=self._password,
            failover=True,
        )
        if creds is None:
            # gRPC refuses call credentials on a plaintext channel; etcd reads the auth
            # token from the request metadata, which the client sends as well.
            client.call_credentials = None
        return client

    def _connect(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        while True:
            try:
                client = self._make_client()
                client.status()
            except _ETCD_ERRORS as exc:
                if time.monotonic() >= deadline:
                    raise EtcdUnavailableError(
                        f"cannot reach etcd at {self._endpoint_text()} after {timeout_s:.0f}s: "
                        f"{describe_error(exc)}; {self._connect_hint()}"
                    ) from exc
                self._stop.wait(backoff.next_delay())
                continue
            with self._client_lock:
                self._client = client
            return

    def _endpoint_text(self) -> str:
        scheme = "https" if self.tls else "http"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.endpoints)

    def _connect_hint(self) -> str:
        ca_cert, client_cert, _ = self._tls_files
        if not self.tls:
            return ("is etcd running (laminar-common's local launcher, or etcd.endpoints in the "
                    "config)? If it serves TLS, set etcd.ca_cert (or auth.dir holding "
                    "etcd-ca.pem) or use https:// endpoints")
        if client_cert is None:
            client = "an etcd run with --client-cert-auth also needs etcd.client_cert/client_key"
        else:
            client = f"etcd's --trusted-ca-file must have signed the client certificate {client_cert!r}"
        return (f"is etcd running and serving TLS? The server certificate must be signed by "
                f"{ca_cert or 'a system-trusted CA'} (etcd.ca_cert) and name the endpoint host; "
                f"{client}")

    def _reset_client(self, broken: pyetcd.MultiEndpointEtcd3Client) -> None:
        with self._client_lock:
            if self._client is broken:
                try:
                    broken.close()
                except _ETCD_ERRORS as exc:
                    log.debug("closing a broken etcd client raised %r", exc)
                self._client = self._make_client()

    def _call(self, what: str, fn: Callable[[pyetcd.MultiEndpointEtcd3Client], object]):
        with self._client_lock:
            client = self._client
        if client is None:
            raise EtcdUnavailableError(f"etcd {what}: coordinator is closed")
        try:
            return fn(client)
        except etcd_exc.RevisionCompactedError:
            raise
        except _ETCD_ERRORS as exc:
            self._reset_client(client)
            raise EtcdUnavailableError(
                f"etcd {what} failed at {self._endpoint_text()}: {describe_error(exc)}"
            ) from exc

    # -- membership ---------------------------------------------------------

    def register(self, record: MemberRecord) -> None:
        proto_key = self.keys.protocol()
        self._call("set protocol", lambda c: c.put_if_not_exists(proto_key, str(PROTOCOL_VERSION)))
        raw, _ = self._call("get protocol", lambda c: c.get(proto_key))
        check_protocol(int(raw or b"0"), record)
        with self._state_lock:
            self._record = record
            self._grant_and_put()
        if self._keepalive is None:
            self._keepalive = threading.Thread(
                target=self._keepalive_loop, name=f"etcd-keepalive-{record.member_id}", daemon=True
            )
            self._keepalive.start()

    def _grant_and_put(self) -> None:
        record = self._record
        assert record is not None
        lease = self._call("grant lease", lambda c: c.lease(self.ttl_s))
        key = self.keys.member(record.role, record.member_id)
        self._call("register", lambda c: c.put(key, encode_record(record), lease=lease.id))
        self._lease_id = lease.id
        for name, value in list(self._elections.items()):
            if not self._try_campaign(name, value):
                log.warning("lost election %r while re-registering", name)
                self._elections.pop(name, None)

    def update_record(self, record: MemberRecord) -> None:
        with self._state_lock:
            if self._lease_id is None:
                raise CoordinationError("register() before update_record()")
            self._record = record
            key = self.keys.member(record.role, record.member_id)
            lease_id = self._lease_id
            self._call("update record", lambda c: c.put(key, encode_record(record), lease=lease_id))

    def _keepalive_loop(self) -> None:
        interval = max(0.2, self.ttl_s / 3)
        backoff = Backoff(maximum=min(2.0, interval))
        outage = False
        while not self._stop.wait(interval if not outage else backoff.next_delay()):
            try:
                with self._state_lock:
                    if self._stop.is_set():
                        return
                    lease_id = self._lease_id
                    alive = False
                    if lease_id is not None:
                        replies = self._call(
                            "keepalive", lambda c, le=lease_id: list(c.refresh_lease(le))
                        )
                        alive = bool(replies) and replies[0].TTL > 0
                    if not alive:
                        log.warning("etcd lease %s is gone; re-registering", lease_id)
                        self._grant_and_put()
                        self.reregistrations += 1
                if outage:
                    log.info("etcd reachable again at %s", self._endpoint_text())
                outage = False
                backoff.reset()
            except EtcdUnavailableError as exc:
                if not outage:
                    log.warning("etcd unreachable, retrying with backoff: %s", exc)
                outage = True
            except Exception:  # top of a long-lived loop: log and keep the member alive
                log.exception("etcd keepalive loop failed unexpectedly; retrying")
                outage = True

    @property
    def registered(self) -> bool:
        rec = self._record
        if rec is None or self._lease_id is None:
            return False
        try:
            raw, meta = self._call("get", lambda c: c.get(self.keys.member(rec.role, rec.member_id)))
        except EtcdUnavailableError:
            return False
        return raw is not None and meta.lease_id == self._lease_id

    def members(self, role: str | None = None) -> dict[str, MemberRecord]:
        found = self._call("list members", lambda c: list(c.get_prefix(self.keys.members(role))))
        return decode_members((meta.key.decode(), raw) for raw, meta in found)

    def watch_members(self, callback, role=None) -> WatchHandle:
        def on_event(kind: str, key: str, value: bytes | None) -> None:
            try:
                r, mid = self.keys.parse_member(key)
                rec = decode_member(value, key) if value is not None else None
            except (ValueError, CoordinationError) as exc:
                log.warning("ignoring bad member key %r: %s", key, exc)
                return
            callback(MembershipEvent(kind, r, mid, rec))

        return self._start_watch(self.keys.members(role), on_event)

    # -- versions -----------------------------------------------------------

    def latest_version(self) -> VersionRecord | None:
        key = self.keys.weights_latest()
        raw, _ = self._call("get latest", lambda c: c.get(key))
        return None if raw is None else decode_version(raw, key)

    def publish_version(self, record: VersionRecord, fence: str | None = None) -> None:
        key = self.keys.weights_latest()
        fenced = None
        if fence is not None:
            token = self._fences.get(fence) if self.owns(fence) else None
            if token is None:
                raise FencedError(f"this member does not hold the {fence!r} election (any "
                                  f"more): now {self.leader(fence) or 'nobody'}")
            fenced = (self.keys.election(fence), token)
        raw, meta = self._call("get latest", lambda c: c.get(key))
        if raw is not None:
            current = decode_version(raw, key)
            if record.version <= current.version:
                raise CoordinationError(
                    f"weight version {record.version} is not newer than the published "
                    f"{current.version}: versions only move forward"
                )

        def txn(c):
            cmp = c.transactions.create(key) == 0 if raw is None else (
                c.transactions.mod(key) == meta.mod_revision
            )
            compare = [cmp]
            if fenced is not None:
                compare.append(c.transactions.create(fenced[0]) == fenced[1])
            return c.transaction(
                compare=compare,
                success=[
                    c.transactions.put(key, encode_record(record)),
                    c.transactions.put(self.keys.weights_version(record.version), encode_record(record)),
                ],
                failure=[],
            )

        ok, _ = self._call("publish version", txn)
        if not ok and fenced is not None:
            raw_held, held = self._call("get leader", lambda c: c.get(fenced[0]))
            if raw_held is not None and held.lease_id == self._lease_id \
                    and held.create_revision != fenced[1]:
                # Still this process's key, won again under a new lease: a new token.
                self._fences[fence] = held.create_revision
                return self.publish_version(record, fence)
            if raw_held is None or held.create_revision != fenced[1]:
                self._elections.pop(fence, None)
                raise FencedError(f"this member lost the {fence!r} election before weight "
                                  f"version {record.version} became visible: now "
                                  f"{self.leader(fence) or 'nobody'}")
        if not ok:
            raise CoordinationError(
                f"lost the compare-and-swap publishing weight version {record.version}: "
                "another publisher moved weights/latest; re-read and retry"
            )

    def watch_latest(self, callback) -> WatchHandle:
        key = self.keys.weights_latest()

        def on_event(kind: str, k: str, value: bytes | None) -> None:
            if k == key and value is not None:
                callback(decode_version(value, key))

        return self._start_watch(key, on_event)

    # -- elections and state -------------------------------------------------

    def _try_campaign(self, name: str, value: str) -> bool:
        key = self.keys.election(name)
        lease_id = self._lease_id
        self._call("campaign", lambda c: c.put_if_not_exists(key, value, lease=lease_id))
        raw, meta = self._call("get leader", lambda c: c.get(key))
        won = raw is not None and meta.lease_id == lease_id
        if won:
            self._fences[name] = meta.create_revision
        return won

    def campaign(self, name: str, value: str) -> bool:
        with self._state_lock:
            if self._lease_id is None:
                raise CoordinationError("register() before campaigning")
            won = self._try_campaign(name, value)
            if won:
                self._elections[name] = value
            return won

    def leader(self, name: str) -> str | None:
        key = self.keys.election(name)
        raw, _ = self._call("get leader", lambda c: c.get(key))
        return None if raw is None else decode_leader(raw, key)

    def owns(self, name: str) -> bool:
        if name in self._elections and name in self._fences:
            return True
        # A campaign whose answer was lost to an etcd error, or a re-registration that
        # re-won under the new lease before failing: the key is bound to this process's
        # own lease, so it holds the election; adopt it (else nobody would, ever).
        key = self.keys.election(name)
        raw, meta = self._call("get leader", lambda c: c.get(key))
        with self._state_lock:
            if raw is None or self._lease_id is None or meta.lease_id != self._lease_id:
                return False
            self._elections[name] = raw.decode(errors="replace")
            self._fences[name] = meta.create_revision
            return True

    def election(self, name: str) -> tuple[str, int] | None:
        key = self.keys.election(name)
        raw, meta = self._call("get leader", lambda c: c.get(key))
        return None if raw is None else (decode_leader(raw, key), meta.lease_id)

    def evict_leader(self, name: str, holder: str, lease: int | None = None) -> bool:
        key = self.keys.election(name)
        raw, meta = self._call("get leader", lambda c: c.get(key))
        if raw is None or raw.decode(errors="replace") != holder or not meta.lease_id \
                or meta.lease_id == self._lease_id or (lease is not None
                                                       and meta.lease_id != lease):
            return False

        def revoke(c) -> bool:
            try:
                c.revoke_lease(meta.lease_id)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return False  # gone already (expired, or another member revoked it)
                raise
            return True

        return bool(self._call("revoke lease", revoke))

    def resign(self, name: str) -> None:
        with self._state_lock:
            if self._elections.pop(name, None) is None:
                return
            key = self.keys.election(name)
            raw, meta = self._call("get leader", lambda c: c.get(key))
            if raw is None or meta.lease_id != self._lease_id:
                return

            def txn(c):
                # Delete only the owner record we just read (same revision).
                return c.transaction(
                    compare=[c.transactions.mod(key) == meta.mod_revision],
                    success=[c.transactions.delete(key)],
                    failure=[],
                )

            self._call("resign", txn)

    def get_state(self, name: str) -> bytes | None:
        raw, _ = self._call("get state", lambda c: c.get(self.keys.state(name)))
        return raw

    def put_state(self, name: str, value: bytes) -> None:
        self._call("put state", lambda c: c.put(self.keys.state(name), value))

    # -- watches ------------------------------------------------------------

    def _start_watch(self, prefix: str, on_event: Callable[[str, str, bytes | None], None]) -> WatchHandle:
        stop = threading.Event()
        cancel_current: list[Callable[[], None]] = []

        def run() -> None:
            known: dict[str, bytes] = {}
            revision: int | None = None
            backoff = Backoff()
            broken = False  # an outage is logged once as a warning, its retries at debug
            while not stop.is_set() and not self._stop.is_set():
                try:
                    if revision is None:
                        resp = self._call("list", lambda c: c.get_prefix_response(prefix))
                        current = {kv.key.decode(): kv.value for kv in resp.kvs}
                        for key in sorted(known.keys() - current.keys()):
                            on_event("delete", key, None)
                        for key, value in sorted(current.items()):
                            if known.get(key) != value:
                                on_event("put", key, value)
                        known = current
                        revision = resp.header.revision
                        if broken:
                            log.info("watch on %s resynced (%d keys)", prefix, len(known))
                            broken = False
                    start = revision + 1
                    iterator, cancel = self._call(
                        "watch", lambda c, s=start: c.watch_prefix_response(prefix, start_revision=s)
                    )
                    cancel_current[:] = [cancel]
                    if stop.is_set():
                        cancel()
                    backoff.reset()
                    for resp in iterator:
                        for ev in resp.events:
                            key = ev.key.decode()
                            if isinstance(ev, pyetcd.events.DeleteEvent):
                                known.pop(key, None)
                                on_event("delete", key, None)
                            else:
                                known[key] = ev.value
                                on_event("put", key, ev.value)
                        revision = max(revision, resp.header.revision)
                except etcd_exc.RevisionCompactedError:
                    log.info("watch on %s hit a compacted revision; resyncing", prefix)
                    revision = None
                except (EtcdUnavailableError, *_ETCD_ERRORS) as exc:
                    (log.debug if broken else log.warning)(
                        "watch on %s broke (%r); relisting after backoff", prefix, exc)
                    broken = True
                    revision = None
                    stop.wait(backoff.next_delay())
                except Exception:  # top of a long-lived loop
                    log.exception("watch on %s failed unexpectedly; resyncing", prefix)
                    revision = None
                    stop.wait(backoff.next_delay())

        thread = threading.Thread(target=run, name=f"etcd-watch-{prefix}", daemon=True)

        def cancel_watch() -> None:
            stop.set()
            for cancel in cancel_current:
                try:
                    cancel()
                except _ETCD_ERRORS as exc:
                    log.debug("cancelling watch on %s raised %r", prefix, exc)

        handle = WatchHandle(cancel_watch)
        self._watches.append(handle)
        thread.start()
        return handle

    # -- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        for handle in self._watches:
            handle.cancel()
        with self._state_lock:
            lease_id, self._lease_id = self._lease_id, None
            if lease_id is not None:
                try:
                    self._call("revoke lease", lambda c: c.revoke_lease(lease_id))
                except EtcdUnavailableError as exc:
                    log.warning("could not revoke lease on close (it will expire): %s", exc)
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def make_coordinator(etcd_config, job: str) -> EtcdCoordinator:
    """Build an :class:`EtcdCoordinator` from an :class:`~laminar_common.config.EtcdConfig`."""
    return EtcdCoordinator(
        endpoints=etcd_config.endpoints,
        job=job,
        ttl_s=etcd_config.ttl_s,
        connect_timeout_s=etcd_config.connect_timeout_s,
        user=etcd_config.user,
        password=etcd_config.password,
        ca_cert=etcd_config.ca_cert,
        client_cert=etcd_config.client_cert,
        client_key=etcd_config.client_key,
    )
