"""``laminar-relay``: options, env vars, ``--set``, shell completion, a slim ``--help``."""

from __future__ import annotations

import pytest

from laminar_common.config import load_config
from laminar_common.testing import (
    assert_completion,
    assert_help_lists_options,
    clear_laminar_env,
    option_envvars,
    run_fresh,
)
from laminar_relay.cli import cli, main
from laminar_relay.config import RelayConfig


@pytest.fixture(autouse=True)
def _no_laminar_env(monkeypatch):
    clear_laminar_env(monkeypatch)


def _option_envvars(command_name: str) -> dict[str, str]:
    return option_envvars(cli, "laminar-relay", "LAMINAR_RELAY", command_name)


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_of_every_command_lists_its_options_and_env_vars(command, capsys):
    assert_help_lists_options(cli, main, "laminar-relay", "LAMINAR_RELAY", command, capsys)


def test_serve_has_the_options_of_before():
    assert _option_envvars("serve") == {"--config": "LAMINAR_RELAY_SERVE_CONFIG",
                                        "--check": "LAMINAR_RELAY_SERVE_CHECK"}
    assert {opt for p in cli.commands["serve"].params for opt in p.opts} >= {
        "--config", "-c", "--set", "--check"}


def test_a_laminar_env_var_reaches_the_config_and_set_wins(monkeypatch, capsys):
    monkeypatch.setenv("LAMINAR_STORE__KEEP_VERSIONS", "7")
    monkeypatch.setenv("LAMINAR_JOB", "from-env")
    assert main(["serve", "--check", "--set", "job=from-set"]) == 0
    out = capsys.readouterr().out
    assert "keep_versions: 7" in out and "job: from-set" in out


def test_options_come_from_their_env_vars(monkeypatch, tmp_path, capsys):
    path = tmp_path / "relay.yaml"
    path.write_text("job: from-file\n")
    monkeypatch.setenv("LAMINAR_RELAY_SERVE_CONFIG", str(path))
    monkeypatch.setenv("LAMINAR_RELAY_SERVE_CHECK", "1")
    assert main(["serve"]) == 0  # --check from the env: prints, starts nothing
    assert "job: from-file" in capsys.readouterr().out


def test_set_is_repeatable_and_a_bad_field_path_fails_naming_it(capsys):
    assert main(["serve", "--check", "--set", "grpc_port=5555",
                 "--set", "store.keep_versions=5"]) == 0
    out = capsys.readouterr().out
    assert "grpc_port: 5555" in out and "keep_versions: 5" in out
    assert main(["serve", "--check", "--set", "store.keep_vershons=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laminar-relay: invalid RelayConfig")
    assert "store.keep_vershons: unknown field; did you mean 'keep_versions'?" in err


def test_usage_errors_exit_2():
    assert main(["serve", "--no-such-option"]) == 2
    assert main(["no-such-command"]) == 2
    assert main([]) == 2


def test_no_option_env_var_is_read_as_a_config_field():
    base = load_config(RelayConfig, env={})
    for envvar in _option_envvars("serve").values():
        assert load_config(RelayConfig, env={envvar: "1"}) == base, envvar


def test_completion_script_and_completions(monkeypatch):
    assert_completion(cli, main, "laminar-relay", monkeypatch, {
        "laminar-relay serve --ch": ["plain,--check"],
    }, shell="zsh")


def test_help_of_every_command_imports_nothing_heavy():
    codes, heavy = run_fresh("""
        from laminar_relay.cli import cli, main
        codes = [main([c, '--help']) for c in cli.commands] + [main(['--help'])]
        result = codes
    """, ('grpc', 'zmq', 'torch', 'numpy', 'pydantic', 'yaml'))
    assert codes == [0] * (len(cli.commands) + 1) and heavy == []


def test_every_config_field_is_known_to_common_so_no_other_tier_warns_of_it():
    """One environment serves every tier: a LAMINAR_* variable for this tier's field must
    not read as a typo to another tier (laminar_common.config.TIER_FIELD_NAMES)."""
    from laminar_common.config import TIER_FIELD_NAMES

    for model in (RelayConfig,):
        assert set(model.model_fields) <= TIER_FIELD_NAMES, set(model.model_fields) - TIER_FIELD_NAMES
