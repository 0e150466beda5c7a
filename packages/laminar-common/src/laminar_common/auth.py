"""Authentication material and its application to sockets and channels.

ZeroMQ: CURVE. ``laminar keys --out DIR`` writes a job-wide server keypair
(``server.key`` / ``server.key_secret``), a client keypair (``client.key`` /
``client.key_secret``) and ``authorized/`` holding the public keys allowed to
connect. Binding sockets act as CURVE servers and check every client key
against ``authorized/`` through one ZAP handler per process; a peer whose key
is not there is refused, logged at WARNING with its key, and counted in
:data:`REFUSED`. A peer without CURVE, or without the server's public key,
cannot even complete the handshake: a monitor on every CURVE server socket
sees that failure, logs it (the first :data:`LOG_FIRST` of each kind, then
every 1000th) and counts it in :data:`HANDSHAKE_FAILURES`. Every tier's
``/metrics`` exports both as ``auth_refused_total{reason}``
(:func:`refusals`).

gRPC (relay control plane): mutual TLS with a CA written by ``laminar keys``
(``ca.pem``; ``server.pem`` / ``server-key.pem`` naming 127.0.0.1, localhost
and the ``--host`` names and addresses given, which relays also present as
clients of each other; ``client.pem`` / ``client-key.pem`` for readers;
``publisher.pem`` / ``publisher-key.pem`` for the trainer). Each certificate's
common name is its role: a relay lets only :data:`PUBLISHER_CN` and
:data:`RELAY_CN` publish (:func:`peer_role`). Hand ``publisher*.pem`` to the
trainer's hosts only (``laminar keys --split`` writes a directory per tier).

Weight data plane: the relay's chunk socket is a CURVE server like every
binding ZeroMQ socket, so only authorized keys push chunks.

etcd: ``laminar keys --etcd`` adds a separate etcd PKI with the same layout
under an ``etcd-`` prefix (``etcd-ca.pem``, ``etcd-server.pem`` /
``etcd-server-key.pem`` for the etcd server, ``etcd-client.pem`` /
``etcd-client-key.pem`` for members). Where ``auth.dir`` holds
``etcd-ca.pem``, every member reaches etcd over TLS (mutual when
``etcd-client.pem`` is there too); see :func:`etcd_tls_paths`.

Off by default (local runs); one config switch (``auth.dir``) turns it on.
Existing files are never overwritten: running ``laminar keys`` again on a dir
only adds what is missing.
"""

from __future__ import annotations

import collections
import datetime
import ipaddress
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from laminar_common.errors import ConfigError

__all__ = ["CurveAuth", "TlsFiles", "create_keys", "split_keys", "peer_role", "PUBLISHER_CN",
           "RELAY_CN", "CLIENT_CN", "etcd_tls_paths", "grpc_channel",
           "grpc_server_credentials", "REFUSED", "HANDSHAKE_FAILURES", "refusals", "ETCD_CA", "ETCD_CLIENT_CERT", "ETCD_CLIENT_KEY",
           "ETCD_SERVER_CERT", "ETCD_SERVER_KEY"]

log = logging.getLogger(__name__)

ETCD_CA = "etcd-ca.pem"
ETCD_SERVER_CERT = "etcd-server.pem"
ETCD_SERVER_KEY = "etcd-server-key.pem"
ETCD_CLIENT_CERT = "etcd-client.pem"
ETCD_CLIENT_KEY = "etcd-client-key.pem"

PUBLISHER_CN = "laminar-publisher"
"""Common name of the trainer's client certificate: may publish weights."""
RELAY_CN = "laminar-server"
"""Common name of the relays' certificate (server, and client of other relays)."""
CLIENT_CN = "laminar-client"
"""Common name of the readers' (rollouts') client certificate: may only read."""
_CERT_OF_ROLE = {"client": "client", "publisher": "publisher", "relay": "server"}

REFUSED: collections.Counter[str] = collections.Counter()
"""CURVE client keys refused by this process's ZAP handler (z85 text -> count)."""
HANDSHAKE_FAILURES: collections.Counter[str] = collections.Counter()
"""Peers whose handshake with one of this process's CURVE server sockets failed
(no CURVE, a wrong server key, a malformed greeting), by kind."""
LOG_FIRST = 50
"""Refusals of each kind logged one by one before only every 1000th is."""

_auth_lock = threading.Lock()
_authenticator: ThreadAuthenticator | None = None
_allowed: set[bytes] = set()


class _KeyCheck:
    """ZAP credentials provider: allow only authorized client keys."""

    def callback(self, domain: str, key: bytes) -> bool:
        z85 = zmq.utils.z85.encode(key) if len(key) == 32 else key
        if z85 in _allowed:
            return True
        text = z85.decode(errors="replace")
        REFUSED[text] += 1
        if _worth_logging(sum(REFUSED.values())):
            log.warning("refused a ZeroMQ peer: CURVE key %s is not authorized (domain %r)",
                        text, domain)
        return False


def _worth_logging(count: int) -> bool:
    return count <= LOG_FIRST or count % 1000 == 0


def refusals() -> dict[str, int]:
    """ZeroMQ peers this process refused, by reason: ``unauthorized-key`` (ZAP) and
    ``handshake-<kind>`` (no CURVE, a wrong server key, ...)."""
    out = {"unauthorized-key": sum(REFUSED.values())}
    out.update({f"handshake-{kind}": n for kind, n in list(HANDSHAKE_FAILURES.items())})
    return out


class _HandshakeWatcher:
    """One daemon thread reading the monitor sockets of every CURVE server socket.

    A monitor socket is created on the thread that owns the watched socket and
    handed over under a lock; it is closed when its socket closes (libzmq's
    ``MONITOR_STOPPED``).
    """

    EVENTS = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
              zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol-error"}

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[zmq.Socket] = []
        self._added = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, sock: zmq.Socket) -> None:
        mask = zmq.EVENT_MONITOR_STOPPED
        for event in self.EVENTS:
            mask |= event
        monitor = sock.get_monitor_socket(mask)
        monitor.linger = 0
        with self._lock:
            self._new.append(monitor)
            self._added.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="laminar-zmq-handshakes",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        monitors: set[zmq.Socket] = set()
        while True:
            with self._lock:
                for monitor in self._new:
                    poller.register(monitor, zmq.POLLIN)
                    monitors.add(monitor)
                self._new.clear()
                self._added.clear()
            if not monitors:
                # Every watched socket closed: wait for a new one. (A poll of no sockets
                # returns at once: this loop used to spin a core and starve the
                # process's other threads of the GIL from then on.)
                self._added.wait(1.0)
                continue
            try:
                ready = dict(poller.poll(200))
            except zmq.ZMQError as exc:  # the context is being terminated: let it finish
                log.debug("handshake monitor stops: %s", exc)
                for monitor in monitors:
                    monitor.close(0)
                return
            for monitor in list(monitors):
                if monitor not in ready:
                    continue
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    log.debug("handshake monitor read failed: %s", exc)
                    event = {"event": zmq.EVENT_MONITOR_STOPPED}
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    poller.unregister(monitor)
                    monitors.discard(monitor)
                    monitor.close(0)
                    continue
                if event["event"] not in self.EVENTS:
                    continue
                kind = _PROTOCOL_ERRORS.get(event.get("value"), self.EVENTS[event["event"]])
                HANDSHAKE_FAILURES[kind] += 1
                if _worth_logging(HANDSHAKE_FAILURES[kind]):
                    endpoint = event.get("endpoint", b"")
                    log.warning(
                        "refused a ZeroMQ peer at %s: CURVE handshake failed (%s): a peer "
                        "without CURVE keys (mechanism-mismatch) or with another job's server "
                        "key (cryptographic)",
                        endpoint.decode(errors="replace") if isinstance(endpoint, bytes)
                        else endpoint, kind)


_PROTOCOL_ERRORS = {int(getattr(zmq, name)): name.removeprefix("PROTOCOL_ERROR_")
                    .removeprefix("ZMTP_").removeprefix("ZAP_").lower().replace("_", "-")
                    for name in dir(zmq) if name.startswith("PROTOCOL_ERROR_")}
"""libzmq's handshake error codes by name (``mechanism-mismatch``, ``cryptographic``, ...)."""

_watcher = _HandshakeWatcher()


def _ensure_authenticator(authorized: set[bytes]) -> None:
    global _authenticator
    with _auth_lock:
        _allowed.update(authorized)
        if _authenticator is None:
            auth = ThreadAuthenticator(zmq.Context.instance())
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=_KeyCheck())
            _authenticator = auth


@dataclass(frozen=True)
class CurveAuth:
    """CURVE keys of one job (z85-encoded, as pyzmq uses them)."""

    server_public: bytes
    server_secret: bytes | None
    client_public: bytes
    client_secret: bytes
    authorized: frozenset[bytes]

    @classmethod
    def from_dir(cls, path: str | Path) -> CurveAuth:
        d = Path(path)
        try:
            server_public, server_secret = zmq.auth.load_certificate(str(d / "server.key_secret")) \
                if (d / "server.key_secret").is_file() else \
                (zmq.auth.load_certificate(str(d / "server.key"))[0], None)
            client_public, client_secret = zmq.auth.load_certificate(str(d / "client.key_secret"))
            authorized = frozenset(zmq.auth.load_certificates(str(d / "authorized")).keys())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"auth.dir {str(d)!r}: cannot load CURVE keys ({exc}); "
                              "create them with `laminar keys --out DIR`") from exc
        if client_secret is None:
            raise ConfigError(f"auth.dir {str(d)!r}: client.key_secret holds no secret key")
        return cls(server_public, server_secret, client_public, client_secret, authorized)

    def apply_server(self, sock: zmq.Socket) -> None:
        """Make a binding socket a CURVE server that checks client keys."""
        if self.server_secret is None:
            raise ConfigError("auth: this process binds a socket but has no server.key_secret")
        _ensure_authenticator(set(self.authorized))
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True
        _watcher.watch(sock)

    def apply_client(self, sock: zmq.Socket) -> None:
        """Make a connecting socket a CURVE client of the job's server key."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


@dataclass(frozen=True)
class TlsFiles:
    """TLS material for gRPC (PEM bytes)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def server_from_dir(cls, path: str | Path) -> TlsFiles:
        d = Path(path)
        return cls(_read(d / "ca.pem"), _read(d / "server.pem"), _read(d / "server-key.pem"))

    @classmethod
    def client_from_dir(cls, path: str | Path, role: str = "client") -> TlsFiles:
        """The CA plus the client certificate of ``role`` (client, publisher or relay).

        A missing certificate leaves server-only TLS (refused by a relay that
        requires mutual TLS), except ``publisher``: the trainer must hold one.
        """
        d = Path(path)
        name = _CERT_OF_ROLE[role]
        cert = d / f"{name}.pem"
        if not cert.is_file():
            if role == "publisher":
                raise ConfigError(
                    f"auth.dir {str(d)!r} holds no publisher.pem: the trainer needs the "
                    "publisher certificate to publish weights (`laminar keys --out DIR` "
                    "writes it into a new DIR; a DIR from before it existed must be re-created)")
            return cls(_read(d / "ca.pem"))
        return cls(_read(d / "ca.pem"), _read(cert), _read(d / f"{name}-key.pem"))


def peer_role(context) -> str | None:
    """The common name of a gRPC caller's verified client certificate (None: no certificate)."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode(errors="replace") if names else None


def grpc_server_credentials(tls: TlsFiles, mutual: bool = False):
    """Server credentials for ``add_secure_port`` (client certs required when ``mutual``)."""
    import grpc

    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                       require_client_auth=mutual)


def grpc_channel(address: str, tls: TlsFiles | None, options=()):
    """A gRPC channel: TLS (with a client certificate if ``tls`` has one) or insecure."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                         certificate_chain=tls.cert)
    return grpc.secure_channel(address, creds, options=list(options))


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"auth: cannot read {p}: {exc}") from exc


ETCD_TLS_FIELDS = ("ca_cert", "client_cert", "client_key")


def etcd_tls_for(auth_dir: str | Path | None, etcd: Mapping[str, Any]) -> dict[str, str]:
    """The etcd TLS files a member takes from ``auth.dir`` (one rule for every caller).

    Explicit ``etcd`` files win, all three together: when ``etcd`` sets any of
    ``ca_cert`` / ``client_cert`` / ``client_key``, or there is no ``auth_dir``,
    nothing is taken (``{}``); otherwise :func:`etcd_tls_paths` of the dir.
    """
    if auth_dir is None or any(etcd.get(k) is not None for k in ETCD_TLS_FIELDS):
        return {}
    return etcd_tls_paths(auth_dir)


def etcd_tls_paths(path: str | Path) -> dict[str, str]:
    """The etcd TLS files an ``auth.dir`` holds, as :class:`~laminar_common.config.EtcdConfig` fields.

    Returns:
        ``{}`` when ``path`` has no ``etcd-ca.pem`` (etcd TLS stays off);
        ``{"ca_cert": ...}`` plus ``client_cert`` / ``client_key`` when
        ``etcd-client.pem`` and ``etcd-client-key.pem`` are there.

    Raises:
        ConfigError: only one of ``etcd-client.pem`` / ``etcd-client-key.pem`` exists,
            or ``path`` cannot be looked at (a name too long, no permission).
    """
    d = Path(path)
    try:
        has_ca, has_cert, has_key = (
            (d / name).is_file() for name in (ETCD_CA, ETCD_CLIENT_CERT, ETCD_CLIENT_KEY))
    except OSError as exc:
        raise ConfigError(f"auth.dir {str(d)!r} cannot be read: {exc.strerror or exc}") from exc
    if not has_ca:
        return {}
    out = {"ca_cert": str(d / ETCD_CA)}
    cert, key = d / ETCD_CLIENT_CERT, d / ETCD_CLIENT_KEY
    if has_cert != has_key:
        have, missing = (cert, key) if has_cert else (key, cert)
        raise ConfigError(f"auth.dir {str(d)!r}: {have.name} is there but {missing.name} is not; "
                          "etcd mutual TLS needs both (or remove both for server-only TLS)")
    if has_cert:
        out.update(client_cert=str(cert), client_key=str(key))
    return out


def create_keys(out: str | Path, etcd_hosts: Sequence[str] | None = None,
                hosts: Sequence[str] = ()) -> Path:
    """Write CURVE keypairs and a TLS CA + server/client/publisher certificates into ``out``.

    Args:
        out: the directory (created if needed); it becomes ``auth.dir``.
        hosts: DNS names or IP addresses the relays' server certificate names
            besides 127.0.0.1 and localhost (every address a relay advertises).
        etcd_hosts: when given (even empty), also write the etcd PKI
            (``etcd-*.pem``); its server certificate names 127.0.0.1,
            localhost and these hosts (DNS names or IP addresses).
    """
    d = Path(out)
    (d / "authorized").mkdir(parents=True, exist_ok=True)
    for name in ("server", "client"):
        if not (d / f"{name}.key_secret").is_file():
            zmq.auth.create_certificates(str(d), name)
    (d / "authorized" / "client.key").write_bytes((d / "client.key").read_bytes())
    _create_tls(d, "", tuple(hosts), ("server", "client", "publisher"))
    if etcd_hosts is not None:
        _create_tls(d, "etcd-", tuple(etcd_hosts))
    return d


def _create_tls(d: Path, prefix: str, hosts: Sequence[str],
                names: Sequence[str] = ("server", "client")) -> None:
    """A CA plus one server and one client certificate, as ``<prefix>{ca,server,client}*.pem``.

    The CA key is not kept, so an existing ``<prefix>ca.pem`` means the set is
    complete and nothing is written.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if (d / f"{prefix}ca.pem").is_file():
        return
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"laminar-{prefix}ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=365))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                               f"laminar-{prefix}{name}")]))
                   .issuer_name(ca_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=365)))
        if name == "server":
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        (d / f"{prefix}{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{prefix}{name}-key.pem").write_bytes(pem_key(key))
    # Written last: its presence is what marks the set complete.
    (d / f"{prefix}ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))


# What each tier's directory holds (``laminar keys --split``): the trainer publishes
# (publisher.pem) and binds; relays serve TLS and CURVE; rollouts read and the
# manager binds. Nobody but the trainer gets publisher-key.pem.
_SPLIT = {
    "trainer": ("ca.pem", "publisher.pem", "publisher-key.pem", "client.key", "client.key_secret",
                "server.key", "server.key_secret", "authorized/client.key"),
    "relay": ("ca.pem", "server.pem", "server-key.pem", "client.key", "client.key_secret",
              "server.key", "server.key_secret", "authorized/client.key"),
    "rollout": ("ca.pem", "client.pem", "client-key.pem", "client.key", "client.key_secret",
                "server.key", "server.key_secret", "authorized/client.key"),
}


def split_keys(src: str | Path, out: str | Path) -> dict[str, Path]:
    """Copy from a full ``laminar keys`` dir one ``auth.dir`` per tier: ``out/{trainer,relay,rollout}``.

    Etcd client files (``etcd-ca.pem``, ``etcd-client*.pem``) go to every tier when present.
    """
    s, o = Path(src), Path(out)
    etcd = [n for n in (ETCD_CA, ETCD_CLIENT_CERT, ETCD_CLIENT_KEY) if (s / n).is_file()]
    made = {}
    for tier, names in _SPLIT.items():
        d = o / tier
        (d / "authorized").mkdir(parents=True, exist_ok=True)
        for name in (*names, *etcd):
            if not (s / name).is_file():
                raise ConfigError(f"laminar keys --split: {s / name} is missing; run "
                                  f"`laminar keys --out {s}` first")
            (d / name).write_bytes((s / name).read_bytes())
        made[tier] = d
    return made
