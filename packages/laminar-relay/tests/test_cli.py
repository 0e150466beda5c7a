"""``laminar-relay``: options, env vars, ``--set``, shell completion, a slim ``--help``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from laminar_common.config import load_config
from laminar_common.testing import clear_laminar_env, option_envvars
from laminar_relay.cli import cli, main
from laminar_relay.config import RelayConfig


@pytest.fixture(autouse=True)
def _no_laminar_env(monkeypatch):
    clear_laminar_env(monkeypatch)


def _option_envvars(command_name: str) -> dict[str, str]:
    return option_envvars(cli, "laminar-relay", "LAMINAR_RELAY", command_name)


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_of_every_command_lists_its_options_and_env_vars(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: laminar-relay {command} [OPTIONS]")
    for param in cli.commands[command].params:
        for opt in param.opts:
            assert opt in out, (opt, out)
    for envvar in _option_envvars(command).values():
        assert envvar in out.replace("\n", "").replace(" ", ""), (envvar, out)


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
    runner = CliRunner()
    script = runner.invoke(cli, [], prog_name="laminar-relay",
                           env={"_LAMINAR_RELAY_COMPLETE": "bash_source"})
    assert script.exit_code == 0
    assert "_laminar_relay_completion()" in script.output
    assert "complete -o nosort -F _laminar_relay_completion laminar-relay" in script.output
    words = runner.invoke(cli, [], prog_name="laminar-relay",
                          env={"_LAMINAR_RELAY_COMPLETE": "bash_complete",
                               "COMP_WORDS": "laminar-relay serve --ch", "COMP_CWORD": "2"})
    assert words.output.split() == ["plain,--check"]
    # The console script's main() prints the same script and exits 0.
    monkeypatch.setenv("_LAMINAR_RELAY_COMPLETE", "zsh_source")
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 0


def test_help_of_every_command_imports_nothing_heavy():
    code = (
        "import contextlib, io, json, sys\n"
        "from laminar_relay.cli import cli, main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    codes = [main([c, '--help']) for c in cli.commands] + [main(['--help'])]\n"
        "print(json.dumps([codes, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'zmq', 'torch', 'numpy', 'pydantic', 'yaml'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    codes, heavy = json.loads(out.stdout)
    assert set(codes) == {0} and heavy == []


def test_every_config_field_is_known_to_common_so_no_other_tier_warns_of_it():
    """One environment serves every tier: a LAMINAR_* variable for this tier's field must
    not read as a typo to another tier (laminar_common.config.TIER_FIELD_NAMES)."""
    from laminar_common.config import TIER_FIELD_NAMES

    for model in (RelayConfig,):
        assert set(model.model_fields) <= TIER_FIELD_NAMES, set(model.model_fields) - TIER_FIELD_NAMES
