"""WeightPublisher waiting for a relay master: it says so periodically and a stop ends it.

The master is looked up the trainer's way (``RelayClient.master`` over the job's
coordinator), here over the in-memory etcd twin; no relay or etcd process runs.
"""

from __future__ import annotations

import logging
import threading
import time

from laminar_common.membership import InMemoryCoordinator, InMemoryEtcd, MemberRecord
from laminar_common.relay.client import RelayClient
from laminar_common.relay.wire import MASTER_ELECTION, RELAY_ROLE
from laminar_trainer.publisher import Snapshot, WeightPublisher

WAITING = "waiting for a relay master in job 'j' (etcd 127.0.0.1:1)"


def _snapshot(version: int = 0) -> Snapshot:
    blob = memoryview(bytes(8))
    return Snapshot(version, 0, [("w", "uint8", (8,), blob)], 8, 0.0)


def _wait_until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


def _publisher(store: InMemoryEtcd, sent: list, stop: threading.Event):
    client = RelayClient(InMemoryCoordinator(store, "j"), client_id="trainer")
    publisher = WeightPublisher(lambda version, tensors, step: sent.append(version),
                                find_master=client.master, stop=stop,
                                waiting_for="job 'j' (etcd 127.0.0.1:1)",
                                log_every_s=0.05, poll_s=0.01)
    return client, publisher


def _elect_relay(store: InMemoryEtcd) -> InMemoryCoordinator:
    relay = InMemoryCoordinator(store, "j")
    relay.register(MemberRecord(member_id="relay-0", role=RELAY_ROLE, address="127.0.0.1:2"))
    assert relay.campaign(MASTER_ELECTION, "relay-0")
    return relay


def test_a_wait_for_a_master_is_logged_periodically_until_one_is_elected(caplog):
    store, sent, stop = InMemoryEtcd(), [], threading.Event()
    client, publisher = _publisher(store, sent, stop)
    caplog.set_level(logging.INFO, logger="laminar_trainer.publisher")
    publisher.submit(_snapshot(0))
    waits = lambda: [r for r in caplog.records if WAITING in r.getMessage()]  # noqa: E731
    assert _wait_until(lambda: len(waits()) >= 3, 10), caplog.text
    assert sent == []
    assert "no relay has won the master election" in waits()[0].getMessage()
    assert waits()[0].levelno == logging.WARNING
    relay = _elect_relay(store)
    assert publisher.wait_idle(timeout_s=10)
    assert sent == [0]
    assert any("relay master found after" in r.getMessage() for r in caplog.records)
    publisher.close(timeout_s=1)
    relay.close()
    client.close()


def test_a_stop_ends_the_wait_for_a_master_at_once():
    store, sent, stop = InMemoryEtcd(), [], threading.Event()
    client, publisher = _publisher(store, sent, stop)
    publisher.submit(_snapshot(0))
    # The trainer's initial publish waits like this (300 s); a signal sets the service's
    # stopping event from another thread.
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    assert publisher.wait_idle(timeout_s=300) is False
    waited = time.monotonic() - t0
    assert stop.is_set() and waited < 30, waited
    publisher.close(timeout_s=300)
    assert not publisher._thread.is_alive()
    assert sent == [] and publisher.stats.failed == 0
    client.close()


def test_without_find_master_a_publisher_sends_at_once():
    sent: list = []
    publisher = WeightPublisher(lambda version, tensors, step: sent.append(version))
    publisher.submit(_snapshot(3))
    assert publisher.wait_idle(timeout_s=10)
    assert sent == [3] and publisher.stats.published == 1
    publisher.close(timeout_s=1)


def test_a_version_that_cannot_reach_the_master_gives_way_to_a_newer_one(caplog):
    import socket

    # A port nothing listens on: the master's process is gone. The socket stays bound
    # (never listening) to the end, so no other socket can take the port meanwhile.
    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{hold.getsockname()[1]}"
    store = InMemoryEtcd()
    relay = InMemoryCoordinator(store, "j")
    relay.register(MemberRecord(member_id="relay-0", role=RELAY_ROLE, address=dead))
    assert relay.campaign(MASTER_ELECTION, "relay-0")
    client = RelayClient(InMemoryCoordinator(store, "j"), client_id="trainer",
                         publish_timeout_s=1.5, failover_wait_s=0.2, rpc_timeout_s=0.5)
    holder: list[WeightPublisher] = []
    publisher = WeightPublisher(
        lambda version, tensors, step: client.publish(
            version, tensors, trainer_step=step, superseded=holder[0].has_newer),
        find_master=client.master, poll_s=0.01)
    holder.append(publisher)
    with caplog.at_level(logging.WARNING, logger="laminar_trainer.publisher"):
        publisher.submit(_snapshot(1))
        assert _wait_until(lambda: publisher._busy, 5)
        time.sleep(0.3)  # v1's first attempts fail: connection refused
        publisher.submit(_snapshot(2))
        assert publisher.wait_idle(timeout_s=20)
    assert publisher.stats.superseded == 1, publisher.stats
    assert publisher.stats.failed == 1 and publisher.stats.published == 0  # v2: no master
    assert any("weights v1 not published, a newer version goes instead" in r.getMessage()
               for r in caplog.records)
    publisher.close(timeout_s=1)
    client.close()
    relay.close()
    hold.close()
