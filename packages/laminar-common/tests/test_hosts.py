"""launch.hosts: when a job spans hosts, and the authentication rule that follows;
launch.ray_backend.node_env: what a Ray actor tells its tier about its node."""

from __future__ import annotations

import logging

import pytest

from laminar_common.errors import ConfigError
from laminar_common.launch.hosts import check_auth, is_laminar_tier, spanning_reasons
from laminar_common.launch.ray_backend import node_env


def test_laminar_tiers_are_recognised_directly_and_under_a_wrapper():
    assert is_laminar_tier(["laminar-relay", "serve"])
    assert is_laminar_tier(["torchrun", "--nproc-per-node", "2", "-m", "laminar_trainer.cli",
                            "run"])
    assert not is_laminar_tier(["laminar", "keys"])
    assert not is_laminar_tier(["laminar-examples", "prompts"])
    assert not is_laminar_tier(["python", "-m", "my_trainer"])


def test_one_machine_on_loopback_does_not_span_hosts():
    configs = {"relay": {"bind_host": "127.0.0.1"}, "worker-0": {}, "trainer": {"host_id": "h"}}
    assert spanning_reasons(configs, ["127.0.0.1:2379"]) == []
    assert spanning_reasons(configs, ["https://localhost:2379"]) == []


@pytest.mark.parametrize("configs, endpoints, nodes, reason", [
    ({}, ["10.0.0.5:2379"], 1, "etcd is at '10.0.0.5'"),
    ({"a": {"host_id": "x"}, "b": {"host_id": "y"}}, [], 1, "2 host ids (x, y)"),
    ({"relay": {"bind_host": "0.0.0.0"}}, [], 1, "relay has bind_host: '0.0.0.0'"),
    ({"manager": {"advertise_host": "192.0.2.7"}}, [], 1, "manager has advertise_host"),
    ({}, [], 3, "it runs on 3 nodes"),
])
def test_each_way_of_spanning_hosts_is_named(configs, endpoints, nodes, reason):
    reasons = spanning_reasons(configs, endpoints, nodes)
    assert any(reason in r for r in reasons), reasons


def test_spanning_hosts_needs_auth_in_every_tier_or_an_explicit_insecure(caplog):
    reasons = ["it runs on 2 nodes"]
    with pytest.raises(ConfigError, match=r"spans hosts \(it runs on 2 nodes\) but worker-1, "
                                          r"trainer run without authentication"):
        check_auth({"relay": {"auth": {"dir": "/k"}}, "worker-1": {},
                    "trainer": {"auth": {"insecure": False}}}, reasons)
    with caplog.at_level(logging.WARNING):
        insecure = check_auth({"relay": {"auth": {"dir": "/k"}},
                               "worker-1": {"auth": {"insecure": True}}}, reasons)
    assert insecure == ["worker-1"]
    assert "WITHOUT AUTHENTICATION in worker-1" in caplog.text
    assert check_auth({"relay": {"auth": {"dir": "/k"}}}, reasons) == []
    # Not spanning hosts: nothing is required.
    assert check_auth({"worker-1": {}}, []) == []


def test_node_env_names_the_node_unless_the_config_or_environment_does():
    env = node_env({}, {}, "a1b2c3d4e5f6a7b8c9d0", "10.1.2.3")
    assert env == {"LAMINAR_HOST_ID": "ray-a1b2c3d4e5f6a7b8", "LAMINAR_ADVERTISE_HOST": "10.1.2.3"}
    assert node_env({"host_id": "gpu-7", "bind_host": "10.9.9.9"}, {}, "n", "10.1.2.3") == {}
    assert node_env({"advertise_host": "h"}, {}, "n", "ip") == {"LAMINAR_HOST_ID": "ray-n"}
    assert node_env({}, {"LAMINAR_HOST_ID": "mine", "LAMINAR_BIND_HOST": "0.0.0.0"},
                    "n", "ip") == {}
    # One node: the tiers keep to loopback (no address is advertised for them).
    assert node_env({}, {}, "n", None) == {"LAMINAR_HOST_ID": "ray-n"}
