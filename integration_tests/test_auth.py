"""Issue 8: authentication on every channel, with real processes.

With ``auth.dir`` set (from ``laminar keys``): an authenticated worker joins
the manager over CURVE and an authenticated client reads relay health over
TLS; a ZeroMQ client without an authorized key and a gRPC client without the
CA certificate are refused, and the refusal is logged by the server.
"""

from __future__ import annotations

import re
import time

import pytest

from conftest import wait_ready
from laminar_common import codec
from laminar_common.auth import CurveAuth, TlsFiles, create_keys
from laminar_common.errors import LaminarError
from laminar_common.etcd import EtcdCoordinator
from laminar_common.relay.client import RelayClient
from laminar_common.transport import ZmqClient

JOB = "auth"


def _common(etcd, keys):
    return ["--set", f"job={JOB}", "--set", f"etcd.endpoints=[{etcd.endpoint}]",
            "--set", "etcd.ttl_s=3", "--set", f"auth.dir={keys}"]


def test_authenticated_peers_work_and_others_are_refused(etcd, spawn, tmp_path):
    keys = create_keys(tmp_path / "keys")
    other = CurveAuth.from_dir(create_keys(tmp_path / "other"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "p0", "prompt": "sort 21=", "task": "sort", "answer": "12"}\n')
    relay = spawn("relay", "laminar_relay.cli", "serve", *_common(etcd, keys),
                  "--set", "member_id=relay-0", "--set", "bind_host=127.0.0.1",
                  "--set", "advertise_host=127.0.0.1", "--set", "auth.mutual_tls=true")
    manager = spawn("manager", "laminar_rollout.cli", "manage", *_common(etcd, keys),
                    "--set", f"prompts={prompts}")
    wait_ready(etcd, JOB, manager, "manager")
    worker = spawn("worker", "laminar_rollout.cli", "serve", *_common(etcd, keys),
                   "--set", "worker_id=worker-0", "--set", "engine.type=simulated")
    wait_ready(etcd, JOB, worker, "worker", "worker-0")

    coord = EtcdCoordinator([etcd.endpoint], JOB)
    mgr = coord.members("manager")["manager"].address

    # ZeroMQ: a client whose key is not authorized never gets an answer, and is logged.
    intruder = CurveAuth(CurveAuth.from_dir(keys).server_public, None, other.client_public,
                         other.client_secret, frozenset())
    for auth in (intruder, None):
        client = ZmqClient(mgr, codec.Hello(member_id="intruder", role="worker",
                                            protocol_version=codec.PROTOCOL_VERSION), auth=auth)
        with pytest.raises(LaminarError):
            client.connect(timeout_s=2)
        client.close()
    manager.wait_for_line(re.escape("refused a ZeroMQ peer: CURVE key " + other.client_public.decode()),
                          10)

    # gRPC: with the CA and a client certificate (mTLS) it works; without, it is refused.
    tls_client = RelayClient(coord, client_id="ok", tls=TlsFiles.client_from_dir(keys),
                                  rpc_timeout_s=5)
    health = None
    for _ in range(50):
        try:
            health = tls_client.health("relay-0")
            break
        except LaminarError:
            time.sleep(0.2)
    assert health is not None and health.relay_id == "relay-0"
    insecure = RelayClient(coord, client_id="nokey", rpc_timeout_s=2)
    with pytest.raises(LaminarError):
        insecure.health("relay-0")
    no_client_cert = RelayClient(coord, client_id="nocert", rpc_timeout_s=2,
                                 tls=TlsFiles(ca=(keys / "ca.pem").read_bytes()))
    with pytest.raises(LaminarError):
        no_client_cert.health("relay-0")
    for c in (tls_client, insecure, no_client_cert):
        c.close()
    assert relay.alive() and manager.alive() and worker.alive()
    coord.close()


def test_etcd_user_password_authentication():
    """etcd with auth on: the right user/password works end to end, others are refused."""
    import pyetcd
    from pyetcd import etcdrpc

    from laminar_common.errors import EtcdUnavailableError
    from laminar_common.launch.local_etcd import LocalEtcd
    from laminar_common.membership import MemberRecord

    with LocalEtcd() as server:
        host, port = server.endpoint.split(":")
        admin = pyetcd.client(host, int(port))
        admin.authstub.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="s3cret"))
        admin.authstub.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"))
        admin.authstub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"))
        admin.authstub.AuthEnable(etcdrpc.AuthEnableRequest())
        admin.close()
        coord = EtcdCoordinator([server.endpoint], JOB, user="root", password="s3cret")
        coord.register(MemberRecord(member_id="w", role="worker"))
        assert "w" in coord.members()
        with pytest.raises(EtcdUnavailableError):
            EtcdCoordinator([server.endpoint], JOB, connect_timeout_s=1).members()
        with pytest.raises(EtcdUnavailableError):
            EtcdCoordinator([server.endpoint], JOB, connect_timeout_s=1, user="root",
                            password="wrong")
        coord.close()


def test_etcd_mutual_tls(tmp_path, spawn):
    """etcd over mutual TLS with certificates from `laminar keys --etcd`.

    A member with the CA and a client certificate registers and is seen by a
    prefix watch and a get; a relay process given nothing but ``auth.dir``
    reaches the same etcd over TLS; clients without the client certificate,
    without the CA, or without TLS at all are refused within their connect
    timeout, with an error naming the endpoint.
    """
    from conftest import wait_until
    from laminar_common.errors import EtcdUnavailableError
    from laminar_common.launch.local_etcd import LocalEtcd
    from laminar_common.membership import MemberRecord

    keys = create_keys(tmp_path / "keys", etcd_hosts=[])
    ca, cert, key = (str(keys / n) for n in ("etcd-ca.pem", "etcd-client.pem",
                                             "etcd-client-key.pem"))
    with LocalEtcd(tls_dir=keys) as server:
        assert server.endpoint.startswith("https://127.0.0.1:")
        bare = server.endpoint.removeprefix("https://")

        watcher = EtcdCoordinator([server.endpoint], JOB, ttl_s=3, connect_timeout_s=10,
                                  ca_cert=ca, client_cert=cert, client_key=key)
        seen: list[str] = []
        watcher.watch_members(lambda ev: seen.append(f"{ev.kind} {ev.member_id}"), role="worker")
        # A bare host:port with a CA selects TLS just as https:// does.
        member = EtcdCoordinator([bare], JOB, ttl_s=3, connect_timeout_s=10,
                                 ca_cert=ca, client_cert=cert, client_key=key)
        member.register(MemberRecord(member_id="w-tls", role="worker"))
        assert wait_until(lambda: "put w-tls" in seen, 10), seen
        assert member.registered
        assert "w-tls" in watcher.members("worker")

        # One switch: auth.dir alone gives a tier process etcd mutual TLS.
        spawn("relay", "laminar_relay.cli", "serve", "--set", f"job={JOB}",
              "--set", f"etcd.endpoints=[{bare}]", "--set", "etcd.ttl_s=3",
              "--set", f"auth.dir={keys}", "--set", "member_id=relay-tls",
              "--set", "bind_host=127.0.0.1", "--set", "advertise_host=127.0.0.1")
        assert wait_until(lambda: "relay-tls" in watcher.members("relay"), 60)

        refused = {
            "no client certificate": dict(endpoints=[server.endpoint], ca_cert=ca),
            "no CA (system roots)": dict(endpoints=[server.endpoint], client_cert=cert,
                                         client_key=key),
            "plaintext": dict(endpoints=[bare]),
        }
        for case, kwargs in refused.items():
            endpoint = kwargs["endpoints"][0]
            named = endpoint if "://" in endpoint else f"http://{endpoint}"
            started = time.monotonic()
            with pytest.raises(EtcdUnavailableError, match=re.escape(f"etcd at {named} ")) as info:
                EtcdCoordinator(kwargs.pop("endpoints"), JOB, connect_timeout_s=2, **kwargs)
            assert time.monotonic() - started < 15, case
            hint = "If it serves TLS" if case == "plaintext" else "serving TLS?"
            assert hint in str(info.value), (case, str(info.value))

        member.close()
        assert wait_until(lambda: "delete w-tls" in seen, 10), seen
        watcher.close()
