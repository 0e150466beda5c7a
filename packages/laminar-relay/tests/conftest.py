"""Fixtures for relay unit tests: in-process relays on loopback, in-memory etcd.

Helpers the tests import live in ``relay_helpers.py`` (a conftest module cannot
be imported by name when several test suites run in one pytest session).
"""

from __future__ import annotations

import pytest

from laminar_common.membership import InMemoryCoordinator, InMemoryEtcd
from laminar_common.relay.client import RelayClient
from laminar_relay.config import RelayConfig
from laminar_relay.service import RelayService, make_relay_service

JOB = "unit"


@pytest.fixture
def etcd() -> InMemoryEtcd:
    return InMemoryEtcd()


@pytest.fixture
def make_relay(etcd):
    """Start an in-process relay on loopback; every relay is closed at teardown."""
    started: list[RelayService] = []

    def start(member_id: str, **overrides) -> RelayService:
        fields = {
            "job": JOB,
            "member_id": member_id,
            "bind_host": "127.0.0.1",
            "advertise_host": "127.0.0.1",
            "store": {"max_bytes": 64 * 1024 * 1024},
            "chain": {"control_interval_s": 0.1, "commit_timeout_s": 5.0},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(fields.get(key), dict):
                fields[key] = {**fields[key], **value}
            else:
                fields[key] = value
        config = RelayConfig.model_validate(fields)
        service = make_relay_service(config, coordinator=InMemoryCoordinator(etcd, JOB, ttl_s=3600))
        service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        service.close("test teardown")


@pytest.fixture
def make_client(etcd):
    clients: list[RelayClient] = []

    def create(**kwargs) -> RelayClient:
        kwargs.setdefault("rpc_timeout_s", 5.0)
        kwargs.setdefault("publish_timeout_s", 20.0)
        kwargs.setdefault("failover_wait_s", 2.0)
        if "address" not in kwargs:
            kwargs.setdefault("coordinator", InMemoryCoordinator(etcd, JOB))
        client = RelayClient(**kwargs)
        clients.append(client)
        return client

    yield create
    for client in clients:
        client.close()
