"""``laminar-rollout``: options, env vars, ``--set``, shell completion, a slim ``--help``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from laminar_common.config import load_config
from laminar_common.testing import clear_laminar_env, option_envvars
from laminar_rollout.cli import cli, main
from laminar_rollout.config import ManagerConfig, WorkerConfig

MODELS = {"serve": (WorkerConfig, ["engine.type=simulated"]),
          "manage": (ManagerConfig, ["prompts=p.jsonl"])}


@pytest.fixture(autouse=True)
def _no_laminar_env(monkeypatch, tmp_path):
    clear_laminar_env(monkeypatch)
    # --print-config also reads the prompt file (the preflight): give the tests one
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)


def _option_envvars(command_name: str) -> dict[str, str]:
    return option_envvars(cli, "laminar-rollout", "LAMINAR_ROLLOUT", command_name)


def test_the_commands_and_their_options_are_those_of_before():
    assert sorted(cli.commands) == ["manage", "serve"]
    assert _option_envvars("serve") == {"--config": "LAMINAR_ROLLOUT_SERVE_CONFIG",
                                        "--print-config": "LAMINAR_ROLLOUT_SERVE_PRINT_CONFIG"}
    assert _option_envvars("manage") == {"--config": "LAMINAR_ROLLOUT_MANAGE_CONFIG",
                                         "--print-config": "LAMINAR_ROLLOUT_MANAGE_PRINT_CONFIG",
                                         "--resume": "LAMINAR_ROLLOUT_MANAGE_RESUME"}


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_of_every_command_lists_its_options_and_env_vars(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: laminar-rollout {command} [OPTIONS]")
    for param in cli.commands[command].params:
        for opt in param.opts:
            assert opt in out, (opt, out)
    flat = out.replace("\n", "").replace(" ", "")
    for envvar in _option_envvars(command).values():
        assert envvar in flat, (envvar, out)
    assert "LAMINAR_A__B=c" in out  # the config env vars are documented too


def test_a_laminar_env_var_reaches_the_config_and_set_wins(monkeypatch, capsys):
    monkeypatch.setenv("LAMINAR_GROUP_SIZE", "5")
    monkeypatch.setenv("LAMINAR_SAMPLING__MAX_TOKENS", "17")
    monkeypatch.setenv("LAMINAR_JOB", "from-env")
    assert main(["manage", "--set", "prompts=p.jsonl", "--set", "job=from-set",
                 "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "group_size: 5" in out and "max_tokens: 17" in out and "job: from-set" in out


def test_options_come_from_their_env_vars(monkeypatch, tmp_path, capsys):
    path = tmp_path / "worker.yaml"
    path.write_text("job: from-file\nengine: {type: simulated}\n")
    monkeypatch.setenv("LAMINAR_ROLLOUT_SERVE_CONFIG", str(path))
    monkeypatch.setenv("LAMINAR_ROLLOUT_SERVE_PRINT_CONFIG", "true")
    assert main(["serve"]) == 0  # --print-config from the env: prints, starts nothing
    out = capsys.readouterr().out
    assert "job: from-file" in out and "type: simulated" in out


def test_the_invocation_of_the_integration_tests_parses(tmp_path, capsys):
    path = tmp_path / "manager.yaml"
    path.write_text(f"prompts: {tmp_path / 'p.jsonl'}\n")
    assert main(["manage", "--config", str(path), "--set", "group_size=3", "--resume",
                 "--set", "repack.enabled=false", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "group_size: 3" in out and "enabled: false" in out


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_a_bad_field_path_fails_naming_it(command, capsys):
    _, required = MODELS[command]
    args = [a for r in required for a in ("--set", r)]
    assert main([command, *args, "--set", "logging.levle=DEBUG", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"laminar-rollout {command}: invalid ")
    assert "logging.levle: unknown field; did you mean 'level'?" in err
    assert main([command, "--set", "nodot", "--print-config"]) == 2
    assert "--set 'nodot': expected a.b=value" in capsys.readouterr().err


def test_usage_errors_exit_2():
    assert main(["serve", "--resume"]) == 2  # --resume belongs to manage
    assert main(["no-such-command"]) == 2
    assert main([]) == 2


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_no_option_env_var_is_read_as_a_config_field(command):
    model, required = MODELS[command]
    base = load_config(model, overrides=required, env={})
    for envvar in _option_envvars(command).values():
        assert load_config(model, overrides=required, env={envvar: "1"}) == base, envvar


def test_completion_script_and_completions(monkeypatch):
    runner = CliRunner()
    script = runner.invoke(cli, [], prog_name="laminar-rollout",
                           env={"_LAMINAR_ROLLOUT_COMPLETE": "bash_source"})
    assert script.exit_code == 0
    assert "complete -o nosort -F _laminar_rollout_completion laminar-rollout" in script.output
    words = runner.invoke(cli, [], prog_name="laminar-rollout",
                          env={"_LAMINAR_ROLLOUT_COMPLETE": "bash_complete",
                               "COMP_WORDS": "laminar-rollout ", "COMP_CWORD": "1"})
    assert words.output.split() == ["plain,manage", "plain,serve"]
    words = runner.invoke(cli, [], prog_name="laminar-rollout",
                          env={"_LAMINAR_ROLLOUT_COMPLETE": "bash_complete",
                               "COMP_WORDS": "laminar-rollout manage --re", "COMP_CWORD": "2"})
    assert words.output.split() == ["plain,--resume"]
    monkeypatch.setenv("_LAMINAR_ROLLOUT_COMPLETE", "fish_source")
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 0


def test_help_and_a_config_error_import_nothing_heavy():
    code = (
        "import contextlib, io, json, sys\n"
        "from laminar_rollout.cli import cli, main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    codes = [main([c, '--help']) for c in cli.commands] + [main(['--help'])]\n"
        "    codes.append(main(['serve', '--set', 'engine.type=torch', '--print-config']))\n"
        "print(json.dumps([codes, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'vllm', 'tokenizers', 'zmq'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    codes, heavy = json.loads(out.stdout)
    assert codes == [0, 0, 0, 2] and heavy == []


def test_replicas_of_one_config_draw_different_random_streams():
    from laminar_rollout.cli import engine_config_for
    from laminar_rollout.config import SimulatedEngineConfig

    eng = SimulatedEngineConfig()
    assert eng.seed is None
    seeds = {engine_config_for(eng, f"worker-{i}").seed for i in range(4)}
    assert len(seeds) == 4 and None not in seeds
    assert engine_config_for(eng, "worker-0").seed == engine_config_for(eng, "worker-0").seed
    assert engine_config_for(SimulatedEngineConfig(seed=7), "worker-0").seed == 7  # kept


def test_every_config_field_is_known_to_common_so_no_other_tier_warns_of_it():
    """One environment serves every tier: a LAMINAR_* variable for this tier's field must
    not read as a typo to another tier (laminar_common.config.TIER_FIELD_NAMES)."""
    from laminar_common.config import TIER_FIELD_NAMES

    for model in (ManagerConfig, WorkerConfig,):
        assert set(model.model_fields) <= TIER_FIELD_NAMES, set(model.model_fields) - TIER_FIELD_NAMES
