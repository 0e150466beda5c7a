"""RelayConfig and the ``laminar-relay`` CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from laminar_common.config import load_config
from laminar_common.errors import ConfigError
from laminar_relay.cli import main
from laminar_relay.config import RelayConfig


def test_defaults_validate_and_version_limit_defaults_to_half_the_cap():
    config = RelayConfig()
    assert config.store.version_limit == config.store.max_bytes // 2
    assert (
        load_config(
            RelayConfig, overrides=["store.max_version_bytes=10"], env={}
        ).store.version_limit
        == 10
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("store.kep_versions=3", "did you mean 'keep_versions'"),
        ("store.keep_versions=0", "store.keep_versions"),
        ("store.backend=disk", "store.backend"),
        ("job=bad/name", "not a valid name"),
        ("data.max_chunk_bytes=999999999", "data.max_chunk_bytes"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RelayConfig, overrides=[override], env={})


def test_version_larger_than_the_cap_is_a_config_error():
    with pytest.raises(ConfigError, match="max_version_bytes .* exceeds max_bytes"):
        load_config(
            RelayConfig, overrides=["store.max_bytes=10", "store.max_version_bytes=11"], env={}
        )


def test_cli_check_prints_the_resolved_config(tmp_path, capsys):
    path = tmp_path / "relay.yaml"
    path.write_text("job: itest\nstore:\n  keep_versions: 4\n")
    assert main(["serve", "--config", str(path), "--set", "grpc_port=5555", "--check"]) == 0
    out = capsys.readouterr().out
    assert "job: itest" in out and "keep_versions: 4" in out and "grpc_port: 5555" in out


def test_cli_refuses_a_bad_config_with_exit_code_2(capsys):
    assert main(["serve", "--set", "store.max_bytes=-1", "--check"]) == 2
    assert "store.max_bytes" in capsys.readouterr().err


def test_help_is_instant_and_imports_nothing_heavy():
    code = (
        "import contextlib, io, json, sys\n"
        "from laminar_relay.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['serve', '--help'])\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'zmq', 'torch', 'numpy', 'pydantic'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_relay_modules_import_no_torch():
    code = (
        "import sys, laminar_relay.service, laminar_relay.cli, laminar_common.relay.client\n"
        "heavy = ('torch', 'transformers', 'vllm')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
