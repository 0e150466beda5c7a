"""Emulated hosts on one machine: network namespaces, a bridge, capped links, cuts.

Each host is a network namespace of its own (its own network stack, as a
separate machine has), with one interface ``eth0`` holding an address of the
benchmarking range 198.18.0.0/15 (RFC 2544), joined to the other hosts by a
Linux bridge that lives in a namespace of its own too: nothing is added to the
network of the machine the tests run on. Each host's link is capped with
``tc ... tbf`` in both directions (its upload on ``eth0``, its download on the
bridge's port), so a link at B bytes/s is a full-duplex NIC at B, and the
network, not loopback, is what a broadcast waits on.

Faults on links (what process signals cannot do: both sides stay alive and
each believes the other gone):

- :meth:`EmulatedHosts.cut`: drop every packet between a host and some or all
  others, silently, in both directions (``iptables ... -j DROP`` in the host's
  namespace, so TCP connections hang and connects time out, as on a real
  partition; nothing is refused);
- :meth:`EmulatedHosts.heal`: remove a host's cuts;
- :meth:`EmulatedHosts.cap`: change a host's link rate (a slow peer).

Processes run on a host with :meth:`EmulatedHosts.cmd` (``ip netns exec NS``,
which execs: the pid is the command's own, so it is stopped by pid as
always). The caller, outside every host, reaches a port of a host through
:meth:`EmulatedHosts.forward`: a loopback port of its own whose connections a
thread of this process opens from inside that host's namespace (the observer
does not become a host, and a cut never cuts it off).

Needs root, iproute2 (``ip``, ``tc``) and iptables; :func:`unavailable` says
why not where they are missing. :meth:`EmulatedHosts.close` deletes the
namespaces (and with them every interface and rule) and SIGKILLs any process
still running inside them: every such process was started there by the caller.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from laminar_common.launch.local_etcd import LocalEtcd

__all__ = ["EmulatedHosts", "Host", "SUBNET", "start_etcd", "unavailable", "wait_port"]

log = logging.getLogger(__name__)

SUBNET = ipaddress.ip_network("198.18.0.0/24")
"""Where the hosts' addresses come from: the benchmarking range (RFC 2544), used inside
the hosts' namespaces only."""
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/var/run/netns"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def unavailable() -> str | None:
    """Why hosts cannot be emulated here (not root, a tool missing, namespaces
    refused), or None when they can. A test skips with this reason."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth, tc, iptables)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"emulated hosts need `{tool}` (Debian: iproute2, iptables)"
    probe = f"lmprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces are not allowed here: {exc}"
    try:
        _run("ip", "netns", "exec", probe, "iptables", "-w", "-L", "OUTPUT", "-n")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"iptables does not work in a network namespace here: {exc}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One emulated host: its name, namespace and address."""

    name: str
    netns: str
    address: str
    port: str
    """The bridge's port for this host (in the switch namespace): its download side."""


def _tbf(rate_mbit: float) -> list[str]:
    """A token bucket at ``rate_mbit``: the bucket holds 10 ms of the rate (at least 64
    KiB, so a 64 KiB GSO segment passes), packets wait at most 200 ms in the queue."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes / 100))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms"]


class EmulatedHosts:
    """N hosts in network namespaces, joined by a bridge, each link capped.

    Args:
        names: the hosts' names (each gets ``SUBNET`` address .1, .2, ... in order).
        rate_mbit: every link's rate each way, Mbit/s; None: uncapped.
        tag: a short unique tag in the namespaces' names (default: random).
    """

    def __init__(self, names: Sequence[str], rate_mbit: float | None = 1000.0,
                 tag: str | None = None) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be unique and not empty: {list(names)}")
        if len(names) > 250:
            raise ValueError("at most 250 hosts")
        self.tag = tag or uuid.uuid4().hex[:6]
        self.rate_mbit = rate_mbit
        self.switch = f"lm-{self.tag}-sw"
        self.hosts = {name: Host(name, f"lm-{self.tag}-{i}", str(SUBNET[i + 1]), f"p{i}")
                      for i, name in enumerate(names)}
        self._created: list[str] = []
        self._rates: dict[str, float | None] = {}
        self._cuts: dict[str, set[str] | None] = {}
        self._listeners: list[socket.socket] = []
        self._closed = threading.Event()

    # -- building and tearing down ------------------------------------------------

    def start(self) -> EmulatedHosts:
        try:
            self._netns_add(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts.values():
                self._netns_add(host.netns)
                _run("ip", "-n", self.switch, "link", "add", host.port, "type", "veth",
                     "peer", "name", "eth0", "netns", host.netns)
                _run("ip", "-n", self.switch, "link", "set", host.port, "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", host.port, "up")
                _run("ip", "-n", host.netns, "addr", "add",
                     f"{host.address}/{SUBNET.prefixlen}", "dev", "eth0")
                _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
                _run("ip", "-n", host.netns, "link", "set", "lo", "up")
                self.cap(host.name, self.rate_mbit)
        except BaseException:
            self.close()
            raise
        return self

    def _netns_add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def close(self) -> None:
        """SIGKILL what still runs on the hosts, then delete every namespace made here."""
        self._closed.set()
        for sock in self._listeners:
            try:
                sock.close()
            except OSError:
                pass
        for ns in self._created:
            self.kill_all(ns)
        for ns in reversed(self._created):
            _run("ip", "netns", "del", ns, check=False)
        self._created.clear()

    @staticmethod
    def kill_all(netns: str) -> list[int]:
        """SIGKILL every process in ``netns`` (one this object made: only the caller's
        processes run there); returns their pids."""
        out = _run("ip", "netns", "pids", netns, check=False).stdout.split()
        pids = [int(p) for p in out if p.isdigit()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def __enter__(self) -> EmulatedHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- where things are -----------------------------------------------------------

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def cmd(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``name`` (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *argv]

    def run(self, name: str, argv: Sequence[str], check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        return _run(*self.cmd(name, argv), check=check)

    # -- link faults ------------------------------------------------------------------

    def cap(self, name: str, rate_mbit: float | None) -> None:
        """Set host ``name``'s link rate, each way (None: uncapped)."""
        host = self.hosts[name]
        for ns, dev in ((host.netns, "eth0"), (self.switch, host.port)):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root",
                 check=False)
            if rate_mbit is not None:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                     *_tbf(rate_mbit))
        self._rates[name] = rate_mbit

    def rate(self, name: str) -> float | None:
        return self._rates.get(name)

    def cut(self, name: str, peers: Sequence[str] | None = None) -> None:
        """Drop every packet between host ``name`` and ``peers`` (None: every other
        host), both ways, silently. Adds to the host's earlier cuts."""
        host = self.hosts[name]
        if peers is None:
            rules = [["INPUT", "-i", "eth0"], ["OUTPUT", "-o", "eth0"]]
            self._cuts[name] = None
        else:
            unknown = [p for p in peers if p not in self.hosts or p == name]
            if unknown:
                raise ValueError(f"cut {name}: not another host: {unknown}")
            rules = []
            for peer in peers:
                addr = self.hosts[peer].address
                rules += [["INPUT", "-s", addr], ["OUTPUT", "-d", addr]]
            if self._cuts.get(name, set()) is not None:
                self._cuts[name] = self._cuts.get(name, set()) | set(peers)  # type: ignore[operator]
        for rule in rules:
            _run("ip", "netns", "exec", host.netns, "iptables", "-w", "-I", *rule, "-j", "DROP")

    def heal(self, name: str) -> None:
        """Remove every cut of host ``name``."""
        host = self.hosts[name]
        for chain in ("INPUT", "OUTPUT"):
            _run("ip", "netns", "exec", host.netns, "iptables", "-w", "-F", chain)
        self._cuts.pop(name, None)

    def cuts(self) -> dict[str, set[str] | None]:
        """Host -> the peers it is cut from (None: every host), for hosts with cuts."""
        return dict(self._cuts)

    # -- the observer ------------------------------------------------------------------

    def forward(self, name: str, port: int, address: str | None = None) -> int:
        """A port on 127.0.0.1, in the caller's network, whose connections go to
        ``address:port`` (default: host ``name``'s own address) as opened from inside
        host ``name``. Lives until :meth:`close`."""
        target = (address or self.hosts[name].address, port)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._listeners.append(listener)
        netns_path = os.path.join(_NETNS_DIR, self.hosts[name].netns)
        started = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                _enter_netns(netns_path)
            except OSError as exc:
                errors.append(exc)
                started.set()
                return
            started.set()
            while not self._closed.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                # The outbound socket is made on this thread: inside host ``name``.
                threading.Thread(target=_splice, args=(conn, target), daemon=True).start()

        threading.Thread(target=serve, name=f"forward-{name}-{port}", daemon=True).start()
        started.wait(10)
        if errors:
            raise RuntimeError(f"forward to {name}: cannot enter {netns_path}: {errors[0]}")
        return listener.getsockname()[1]


def _enter_netns(path: str) -> None:
    """Move the calling thread (only it) into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _splice(conn: socket.socket, target: tuple[str, int]) -> None:
    """Pipe ``conn`` to a new connection to ``target`` until either side closes."""
    try:
        out = socket.create_connection(target, timeout=10)
    except OSError as exc:
        log.debug("forward to %s:%d: %s", target[0], target[1], exc)
        conn.close()
        return
    out.settimeout(None)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass  # either side went away: the connection ends, as it would without us
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    t = threading.Thread(target=pump, args=(out, conn), daemon=True)
    t.start()
    pump(conn, out)
    t.join(timeout=30)
    conn.close()
    out.close()


def wait_port(hosts: EmulatedHosts, name: str, port: int, timeout_s: float = 20.0) -> None:
    """Until something listens on host ``name``'s ``port`` (probed from inside it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        probe = hosts.run(name, ["python3", "-c",
                                 "import socket,sys; socket.create_connection("
                                 f"({hosts.address(name)!r}, {port}), timeout=1)"], check=False)
        if probe.returncode == 0:
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {name} ({hosts.address(name)}:{port}) "
                       f"after {timeout_s}s")


def start_etcd(hosts: EmulatedHosts, name: str, data_dir: str, port: int = 2379
               ) -> tuple[LocalEtcd, str]:
    """A real etcd on host ``name`` listening on its address; returns it and the
    endpoint the caller (outside every host) reaches it at (a :meth:`forward`)."""
    os.makedirs(data_dir, exist_ok=True)
    local = f"127.0.0.1:{hosts.forward(name, port)}"
    etcd = LocalEtcd(data_dir=data_dir, port=port, peer_port=port + 1,
                     host=hosts.address(name), wrap=hosts.cmd(name, []), probe=local)
    return etcd.start(), local
