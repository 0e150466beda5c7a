"""Addresses a listening member binds and advertises, and which host it is on.

Owns the one rule every tier follows (:func:`resolve_listen`) and the host
identity same-host decisions compare (:func:`host_identity`). It must not open
listening sockets itself: tiers bind through their transports.

Rules:

- ``advertise_host`` set: peers are told that; ``bind_host`` unset binds it.
- ``bind_host`` a specific address: it is also what is advertised.
- ``bind_host`` a wildcard (``0.0.0.0``, ``::``, ``*``) or nothing set: the
  advertised address is detected as the local address of the interface that
  routes to the etcd endpoint (so on one machine with etcd on loopback it is
  127.0.0.1, and on a cluster it is the address the others reach etcd from);
  an unset ``bind_host`` then binds only that address.
- An advertised loopback address while etcd is not on loopback is refused
  (:class:`ConfigError`): members on other hosts would be told an address
  that reaches themselves.

Host identity: a configured ``host_id`` wins, else ``/etc/machine-id`` (or
D-Bus's copy), else the host name with a warning. Two processes share memory
only when their host ids are equal; host names are not unique across
machines and differ between containers of one machine.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from laminar_common.errors import ConfigError

__all__ = ["Listen", "resolve_listen", "host_identity", "is_loopback", "is_wildcard",
           "bracket_host", "endpoint_host", "route_address"]

log = logging.getLogger(__name__)

WILDCARDS = frozenset({"0.0.0.0", "::", "*", "[::]"})
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


@dataclass(frozen=True, slots=True)
class Listen:
    """Where a member binds and what it tells peers."""

    bind: str
    advertise: str

    def tcp(self, port: int = 0) -> str:
        """The ZeroMQ bind endpoint for ``port`` (0: any free one)."""
        return f"tcp://{bracket_host(self.bind)}:{port if port else '*'}"

    def advertised(self, bound_endpoint: str) -> str:
        """``tcp://<advertise>:<port>`` for an endpoint ZeroMQ reports as bound."""
        if not bound_endpoint.startswith("tcp://"):
            return bound_endpoint  # inproc:// and other non-network schemes stand as bound
        port = bound_endpoint.rsplit(":", 1)[1]
        return f"tcp://{bracket_host(self.advertise)}:{port}"


def bracket_host(host: str) -> str:
    """``host`` as it goes before ``:port`` in an endpoint (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def is_wildcard(host: str | None) -> bool:
    return host in WILDCARDS


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP or a name) means this machine's loopback."""
    h = host.strip("[]")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def endpoint_host(endpoint: str) -> str:
    """The host of an etcd endpoint (``host:port``, ``http(s)://host:port``, ``[v6]:port``)."""
    rest = endpoint.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:rest.index("]")]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def route_address(host: str) -> str:
    """The local address of the interface that routes to ``host`` (no packet is sent).

    Raises:
        ConfigError: ``host`` cannot be resolved or no route leads to it.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)  # UDP connect: picks the route, sends nothing
            return s.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"cannot find the local address that routes to etcd host {host!r}: "
                          f"{exc}; set advertise_host") from exc


def resolve_listen(bind_host: str | None, advertise_host: str | None,
                   etcd_endpoints: Sequence[str]) -> Listen:
    """Apply the module's rules.

    Raises:
        ConfigError: a loopback advertisement while etcd is remote, or no
            route to etcd to detect the address from.
    """
    etcd_hosts = [endpoint_host(e) for e in etcd_endpoints]
    advertise = advertise_host
    if advertise is None:
        if bind_host is not None and not is_wildcard(bind_host):
            advertise = bind_host
        else:
            advertise = route_address(etcd_hosts[0])
    bind = advertise if bind_host is None else bind_host
    remote = [h for h in etcd_hosts if not is_loopback(h)]
    if remote and is_loopback(advertise):
        source = "advertise_host" if advertise_host is not None else "bind_host"
        raise ConfigError(
            f"{source}: {advertise!r} is a loopback address but etcd is at {remote[0]!r}: "
            "members on other hosts would be told an address that reaches themselves; set "
            "advertise_host to an address they can reach (or bind_host to a wildcard to have "
            "it detected)")
    return Listen(bind=bind, advertise=advertise)


def _machine_id() -> str | None:
    for name in MACHINE_ID_FILES:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return None


def host_identity(configured: str | None = None) -> str:
    """This process's host id: ``configured``, else the machine id, else the host name."""
    return configured or _default_host_id()


@functools.cache
def _default_host_id() -> str:
    """Computed (and the fallback warned about) once per process."""
    mid = _machine_id()
    if mid is not None:
        return f"machine-{mid[:16]}"
    name = socket.gethostname()
    log.warning("no /etc/machine-id: host identity falls back to the host name %r; set host_id "
                "on every tier if host names can repeat across machines", name)
    return f"hostname-{name}"
