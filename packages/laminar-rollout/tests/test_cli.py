"""``laminar-rollout``: options, env vars, ``--set``, shell completion, a slim ``--help``."""

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
    assert_help_lists_options(cli, main, "laminar-rollout", "LAMINAR_ROLLOUT", command, capsys)


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
    assert_completion(cli, main, "laminar-rollout", monkeypatch, {
        "laminar-rollout ": ["plain,manage", "plain,serve"],
        "laminar-rollout manage --re": ["plain,--resume"],
    }, shell="fish")


def test_help_and_a_config_error_import_nothing_heavy():
    codes, heavy = run_fresh("""
        from laminar_rollout.cli import cli, main
        codes = [main([c, '--help']) for c in cli.commands] + [main(['--help'])]
        codes.append(main(['serve', '--set', 'engine.type=torch', '--print-config']))
        result = codes
    """, ('torch', 'transformers', 'vllm', 'tokenizers', 'zmq'))
    assert codes == [0] * (len(cli.commands) + 1) + [2] and heavy == []


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
