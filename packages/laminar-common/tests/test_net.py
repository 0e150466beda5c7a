"""Bind/advertise resolution and host identity (laminar_common.net)."""

from __future__ import annotations

import pytest

from laminar_common.errors import ConfigError
from laminar_common.net import endpoint_host, host_identity, is_loopback, resolve_listen


def test_a_specific_bind_host_is_advertised_and_bound():
    got = resolve_listen("127.0.0.3", None, ["127.0.0.2:2379"])
    assert (got.bind, got.advertise) == ("127.0.0.3", "127.0.0.3")
    assert got.advertised("tcp://127.0.0.3:5555") == "tcp://127.0.0.3:5555"
    assert got.tcp(0) == "tcp://127.0.0.3:*"


def test_a_wildcard_bind_advertises_the_address_routing_to_etcd():
    got = resolve_listen("0.0.0.0", None, ["http://127.0.0.1:2379"])
    assert got.bind == "0.0.0.0" and is_loopback(got.advertise)
    assert got.advertised("tcp://0.0.0.0:7000").endswith(":7000")
    assert "0.0.0.0" not in got.advertised("tcp://0.0.0.0:7000")


def test_nothing_set_binds_only_the_detected_address():
    got = resolve_listen(None, None, ["127.0.0.1:2379"])
    assert got.bind == got.advertise != "0.0.0.0"


def test_a_loopback_advertisement_with_remote_etcd_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="advertise_host.*loopback.*10.1.2.3"):
        resolve_listen(None, "127.0.0.1", ["10.1.2.3:2379"])
    with pytest.raises(ConfigError, match="bind_host"):
        resolve_listen("127.0.0.1", None, ["https://10.1.2.3:2379"])
    assert resolve_listen(None, "10.0.0.7", ["10.1.2.3:2379"]).bind == "10.0.0.7"


def test_endpoint_hosts_parse_every_form():
    assert endpoint_host("127.0.0.2:2379") == "127.0.0.2"
    assert endpoint_host("https://etcd.example:2379") == "etcd.example"
    assert endpoint_host("[::1]:2379") == "::1"


def test_a_configured_host_id_wins_and_the_default_is_not_the_hostname():
    import socket

    assert host_identity("rack3-node7") == "rack3-node7"
    assert host_identity() != socket.gethostname()


def test_tier_configs_refuse_a_loopback_advertisement_when_etcd_is_remote():
    from laminar_common.config import EtcdConfig, ListenConfig, load_config

    class TierConfig(ListenConfig):
        etcd: EtcdConfig = EtcdConfig()

    assert load_config(TierConfig, overrides=["host_id=h2"], env={}).host == "h2"
    with pytest.raises(ConfigError, match="advertise_host"):
        load_config(TierConfig, overrides=["advertise_host=127.0.0.1",
                                            "etcd.endpoints=[10.9.9.9:2379]"], env={})
