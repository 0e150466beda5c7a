"""``laminar-trainer``: options, env vars, ``--set``, shell completion, a slim ``--help``."""

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
from laminar_trainer.cli import cli, main
from laminar_trainer.config import TrainerConfig

SIMULATE = ["--set", "simulate.step_s=0"]  # run needs model_dir or simulate


@pytest.fixture(autouse=True)
def _no_laminar_env(monkeypatch):
    clear_laminar_env(monkeypatch)


def _option_envvars(command_name: str) -> dict[str, str]:
    return option_envvars(cli, "laminar-trainer", "LAMINAR_TRAINER", command_name)


def test_the_commands_and_their_options_are_those_of_before():
    # the warm starts are `laminar-examples warmstart` / `warmstart-chat` now
    assert sorted(cli.commands) == ["export", "replay", "run"]
    assert set(_option_envvars("replay")) == {"--step"}
    assert set(_option_envvars("export")) == {"--out", "--dtype", "--force"}
    assert set(_option_envvars("run")) == {"--config", "--resume", "--print-config"}
    assert _option_envvars("run")["--resume"] == "LAMINAR_TRAINER_RUN_RESUME"


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_of_every_command_lists_its_options_and_env_vars(command, capsys):
    assert_help_lists_options(cli, main, "laminar-trainer", "LAMINAR_TRAINER", command, capsys)


def test_a_laminar_env_var_reaches_the_config_and_set_wins(monkeypatch, capsys):
    monkeypatch.setenv("LAMINAR_BATCH_GROUPS", "3")
    monkeypatch.setenv("LAMINAR_CHECKPOINT__EVERY_STEPS", "9")
    monkeypatch.setenv("LAMINAR_TOTAL_STEPS", "100")
    assert main(["run", *SIMULATE, "--set", "total_steps=7", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "batch_groups: 3" in out and "every_steps: 9" in out and "total_steps: 7" in out


def test_options_come_from_their_env_vars(monkeypatch, tmp_path, capsys):
    path = tmp_path / "trainer.yaml"
    path.write_text("job: from-file\nsimulate: {step_s: 0}\n")
    monkeypatch.setenv("LAMINAR_TRAINER_RUN_CONFIG", str(path))
    monkeypatch.setenv("LAMINAR_TRAINER_RUN_PRINT_CONFIG", "yes")
    assert main(["run"]) == 0  # --print-config from the env: prints, starts nothing
    assert "job: from-file" in capsys.readouterr().out


def test_a_bad_field_path_fails_naming_it(capsys):
    assert main(["run", *SIMULATE, "--set", "optim.lr_warmup=3", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laminar-trainer run: invalid TrainerConfig")
    assert "optim.lr_warmup: unknown field" in err
    assert main(["run", "--print-config"]) == 2
    assert "set model_dir (or simulate, for benchmarks)" in capsys.readouterr().err


def test_a_missing_model_dir_fails_at_load_naming_the_field(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["run", "--set", f"model_dir={missing}", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert f"\n  model_dir: Value error, model directory '{missing}' does not exist" in err
    assert main(["run", "--set", f"model_dir={tmp_path}", "--print-config"]) == 2
    assert f"model directory '{tmp_path}' holds no config.json" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert main(["export", "ckpt"]) == 2  # --out is required
    assert "Missing option '--out'" in capsys.readouterr().err
    assert main(["export", "ckpt", "--out", "x", "--dtype", "int3"]) == 2
    assert main(["warmstart", "--out", "x"]) == 2  # laminar-examples warmstart now
    assert main(["run", "--no-such-option"]) == 2
    assert main([]) == 2


def test_no_option_env_var_is_read_as_a_config_field():
    base = load_config(TrainerConfig, env={})
    for command in cli.commands:
        for envvar in _option_envvars(command).values():
            assert load_config(TrainerConfig, env={envvar: "1"}) == base, envvar


def test_completion_script_and_completions(monkeypatch):
    assert_completion(cli, main, "laminar-trainer", monkeypatch, {
        "laminar-trainer export --d": ["plain,--dtype"],
    }, shell="bash")


def test_help_and_print_config_import_no_torch():
    codes, heavy = run_fresh("""
        from laminar_trainer.cli import cli, main
        codes = [main([c, '--help']) for c in cli.commands] + [main(['--help'])]
        codes.append(main(['run', '--set', 'simulate.step_s=0', '--print-config']))
        result = codes
    """, ('torch', 'transformers', 'tokenizers'))
    assert codes == [0] * (len(cli.commands) + 2) and heavy == []


def test_every_config_field_is_known_to_common_so_no_other_tier_warns_of_it():
    """One environment serves every tier: a LAMINAR_* variable for this tier's field must
    not read as a typo to another tier (laminar_common.config.TIER_FIELD_NAMES)."""
    from laminar_common.config import TIER_FIELD_NAMES

    for model in (TrainerConfig,):
        assert set(model.model_fields) <= TIER_FIELD_NAMES, set(model.model_fields) - TIER_FIELD_NAMES
