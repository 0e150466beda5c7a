"""Hostile input to the relay's config loader: arbitrary files, mappings and ``--set`` strings.

``load_config(RelayConfig, ...)`` must return a complete, frozen config or raise
:class:`ConfigError` naming the file, the ``--set`` item or every bad field path;
no other exception may escape.
"""

from __future__ import annotations

import pytest

from laminar_common.config import load_config
from laminar_common.errors import ConfigError
from laminar_common.testing import assert_bad_field_named, assert_bad_file_named, make_loader_tests
from laminar_relay.config import RelayConfig

globals().update(make_loader_tests(RelayConfig, max_examples=150))


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-config")


@pytest.mark.parametrize(("items", "field"), [
    (["store.max_bytes=0"], "store.max_bytes"),
    (["store.max_bytes=-5"], "store.max_bytes"),
    (["store.max_tensors=zero"], "store.max_tensors"),
    (["store.max_bytes=10", "store.max_version_bytes=11"], "store"),
    (["data.verify_threads=65"], "data.verify_threads"),
    (["chain.commit_timeout_s=0"], "chain.commit_timeout_s"),
    (["etcd.ttl_s=1"], "etcd.ttl_s"),
    (["grpc_port=70000"], "grpc_port"),
    (["metrics.port=-1"], "metrics.port"),
    (["logging.level=LOUD"], "logging.level"),
    (["store.max_bytes.x=1"], "store.max_bytes"),
])
def test_a_bad_field_names_its_full_path(items, field):
    assert_bad_field_named(RelayConfig, items, field)


def test_a_bad_field_in_a_file_names_the_file_and_the_path(cfg_dir):
    assert_bad_file_named(RelayConfig, cfg_dir / "bad.yaml",
                          "store:\n  max_bytes: -1\n  kep_versions: 3\n",
                          ["store.max_bytes: ", "store.kep_versions: unknown field"])


def test_an_odd_key_is_quoted_not_shown_as_the_root(cfg_dir):
    path = cfg_dir / "odd.yaml"
    path.write_text("'': 1\nstore: {'a.b': 2}\n")
    with pytest.raises(ConfigError) as info:
        load_config(RelayConfig, path, env={})
    assert "\n  '': unknown field" in str(info.value)
    assert "\n  store.'a.b': unknown field" in str(info.value)


def test_an_unreadable_auth_dir_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"auth\.dir 'd{300}' cannot be read"):
        load_config(RelayConfig, None, ["auth.dir=" + "d" * 300], env={})
