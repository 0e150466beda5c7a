"""CURVE on ZeroMQ sockets: authorized peers get through, others are refused and counted."""

from __future__ import annotations

import pytest

from laminar_common import codec
from laminar_common.auth import REFUSED, CurveAuth, create_keys
from laminar_common.config import AuthConfig
from laminar_common.errors import ConfigError, ProtocolError, TransportError
from laminar_common.transport import ZmqClient, ZmqPullReceiver, ZmqPushSender, ZmqServer

ACK = codec.Ack(trajectory_ids=("t",), trainer_step=1, trainer_version=1)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    job = CurveAuth.from_dir(create_keys(tmp_path_factory.mktemp("job")))
    other = CurveAuth.from_dir(create_keys(tmp_path_factory.mktemp("other")))
    # A client that knows the job's server key but holds a key nobody authorized.
    intruder = CurveAuth(job.server_public, None, other.client_public, other.client_secret,
                         frozenset())
    return job, intruder


def test_authorized_push_is_received(keys):
    job, _ = keys
    rx = ZmqPullReceiver(auth=job)
    tx = ZmqPushSender(rx.endpoint, auth=job)
    tx.send(ACK)
    assert rx.recv(timeout_s=5) == ACK
    tx.close()
    rx.close()


def test_unauthorized_and_plain_pushes_are_refused_and_counted(keys):
    job, intruder = keys
    rx = ZmqPullReceiver(auth=job)
    before = sum(REFUSED.values())
    bad = ZmqPushSender(rx.endpoint, auth=intruder, send_timeout_s=0.5)
    plain = ZmqPushSender(rx.endpoint, send_timeout_s=0.5)
    for tx in (bad, plain):
        try:
            tx.send(ACK)
        except TransportError:
            pass
    assert rx.recv(timeout_s=1.5) is None
    assert sum(REFUSED.values()) > before
    assert any(k.startswith(intruder.client_public.decode()[:10]) for k in REFUSED)
    for tx in (bad, plain):
        tx.close(linger_s=0)
    rx.close()


def test_handshakes_without_curve_or_with_another_server_key_are_counted_and_exported(keys):
    """A plain peer, and one holding another job's server key, never reach ZAP: the
    server socket's monitor counts them, and every tier's /metrics exports the count."""
    import time
    import urllib.request

    from laminar_common.auth import HANDSHAKE_FAILURES, refusals
    from laminar_common.metrics import MetricsServer

    job, intruder = keys
    stranger = CurveAuth(intruder.client_public, None, job.client_public, job.client_secret,
                         frozenset())  # the right client keys, a wrong server key
    rx = ZmqPullReceiver(auth=job)
    before = sum(HANDSHAKE_FAILURES.values())
    senders = [ZmqPushSender(rx.endpoint, send_timeout_s=0.3),
               ZmqPushSender(rx.endpoint, auth=stranger, send_timeout_s=0.3)]
    for tx in senders:
        try:
            tx.send(ACK)
        except TransportError:
            pass
    deadline = time.monotonic() + 10
    while sum(HANDSHAKE_FAILURES.values()) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(HANDSHAKE_FAILURES.values()) >= before + 2, dict(HANDSHAKE_FAILURES)
    assert rx.recv(timeout_s=0.2) is None
    server = MetricsServer("relay", "j", "r0", lambda: [])
    try:
        text = urllib.request.urlopen(server.start(), timeout=5).read().decode()
    finally:
        server.stop()
    # Each kind is named; the peers keep retrying, so the scrape may have counted more.
    assert HANDSHAKE_FAILURES["mechanism-mismatch"] >= 1 and \
        HANDSHAKE_FAILURES["cryptographic"] >= 1, dict(HANDSHAKE_FAILURES)
    scraped = {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("laminar_relay_auth_refused_total")}
    assert scraped["handshake-mechanism-mismatch"] >= 1 and scraped["handshake-cryptographic"] >= 1
    assert scraped["unauthorized-key"] == refusals()["unauthorized-key"]
    for tx in senders:
        tx.close(linger_s=0)
    rx.close()


def test_router_dealer_handshake_needs_the_key(keys):
    job, intruder = keys
    server = ZmqServer(member_id="mgr", auth=job)
    import threading

    def serve():
        for _ in range(20):
            server.recv(timeout_s=0.1)

    t = threading.Thread(target=serve)
    t.start()
    good = ZmqClient(server.endpoint, codec.Hello(member_id="w-good", role="worker",
                                                  protocol_version=codec.PROTOCOL_VERSION),
                     auth=job)
    assert good.connect(timeout_s=5).member_id == "mgr"
    bad = ZmqClient(server.endpoint, codec.Hello(member_id="w-bad", role="worker",
                                                 protocol_version=codec.PROTOCOL_VERSION),
                    auth=intruder)
    with pytest.raises((TransportError, ProtocolError)):
        bad.connect(timeout_s=1)
    t.join()
    assert "w-bad" not in server.peers and "w-good" in server.peers
    for c in (good, bad):
        c.close()
    server.close()


def test_missing_key_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="laminar keys"):
        AuthConfig(dir=str(tmp_path / "none")).curve()
    assert AuthConfig().curve() is None


def test_the_handshake_watcher_sleeps_once_every_watched_socket_closed(keys):
    """With CURVE on, one thread reads every server socket's handshake events. Once all of
    those sockets closed it used to poll an empty set in a loop: a core spent for the rest
    of the process (the common suite ran ~3x slower after this file)."""
    import time

    from laminar_common import auth

    job, _ = keys
    rx = ZmqPullReceiver(auth=job)
    rx.close()
    deadline = time.monotonic() + 5
    while auth._watcher._new and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the monitor's stop event is read
    cpu = time.process_time()
    time.sleep(1.0)  # this thread sleeps: whatever CPU the process spends is another's
    assert time.process_time() - cpu < 0.3
