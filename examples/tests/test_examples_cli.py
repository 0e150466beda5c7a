"""``laminar-examples``: its commands and options, env vars, exit codes, completion, a
slim ``--help`` (the prompts command from ``laminar``, the warm starts from
``laminar-trainer``, as they were there)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from laminar_common.jsonl import read_jsonl
from laminar_common.testing import (
    assert_completion,
    assert_help_lists_options,
    clear_laminar_env,
    option_envvars,
    run_fresh,
)
from laminar_examples.cli import cli, main


@pytest.fixture(autouse=True)
def _no_laminar_env(monkeypatch):
    clear_laminar_env(monkeypatch)


def _option_envvars(command_name: str) -> dict[str, str]:
    return option_envvars(cli, "laminar-examples", "LAMINAR_EXAMPLES", command_name)


def test_the_commands_and_their_options_are_those_of_before():
    assert sorted(cli.commands) == ["prompts", "warmstart", "warmstart-chat"]
    assert set(_option_envvars("prompts")) == {
        "--task", "--n", "--split", "--seed", "--out", "--difficulty"}
    assert set(_option_envvars("warmstart-chat")) == {
        "--out", "--steps", "--difficulty", "--demo-error-rate", "--seed", "--force"}
    assert set(_option_envvars("warmstart")) == {
        "--out", "--task", "--steps", "--difficulty", "--demo-error-rate", "--target-accuracy",
        "--seed", "--force"}
    assert _option_envvars("prompts")["--n"] == "LAMINAR_EXAMPLES_PROMPTS_N"
    defaults = {p.name: p.default for p in cli.commands["warmstart"].params}
    assert defaults["task"] == "sort" and defaults["seed"] == 0
    assert defaults["demo_error_rate"] == 0.0 and defaults["steps"] is None
    defaults = {p.name: p.default for p in cli.commands["prompts"].params}
    assert (defaults["task"], defaults["n"], defaults["split"], defaults["seed"]) == (
        "sort", 1000, "train", 0)


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_of_every_command_lists_its_options_and_env_vars(command, capsys):
    assert_help_lists_options(cli, main, "laminar-examples", "LAMINAR_EXAMPLES", command, capsys)


def test_options_come_from_their_env_vars(monkeypatch, tmp_path):
    out = tmp_path / "p.jsonl"
    monkeypatch.setenv("LAMINAR_EXAMPLES_PROMPTS_N", "7")
    monkeypatch.setenv("LAMINAR_EXAMPLES_PROMPTS_TASK", "add")
    monkeypatch.setenv("LAMINAR_EXAMPLES_PROMPTS_OUT", str(out))
    assert main(["prompts", "--seed", "3"]) == 0
    records = read_jsonl(out)
    assert len(records) == 7 and {r["task"] for r in records} == {"add"}


def test_prompts_writes_once_and_leaves_an_existing_file(tmp_path, capsys):
    out = tmp_path / "d" / "p.jsonl"
    assert main(["prompts", "--task", "sort", "--n", "5", "--split", "eval", "--out",
                 str(out)]) == 0
    assert capsys.readouterr().out == f"wrote 5 sort records (eval) to {out}\n"
    first = out.read_text()
    assert main(["prompts", "--task", "sort", "--n", "9", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"{out} exists; leaving it\n"
    assert out.read_text() == first


def test_usage_errors_exit_2(capsys):
    assert main(["prompts", "--out", "x.jsonl", "--split", "test"]) == 2
    assert "Invalid value for '--split'" in capsys.readouterr().err
    assert main(["prompts", "--task", "mul", "--out", "x.jsonl"]) == 2
    assert capsys.readouterr().err.startswith("laminar-examples prompts: unknown task 'mul'")
    assert main(["warmstart"]) == 2  # --out is required
    assert "Missing option '--out'" in capsys.readouterr().err
    assert main(["warmstart", "--out", "x", "--steps", "many"]) == 2
    assert main(["warmstart-chat", "--out", "x", "--seed", "s"]) == 2
    assert main(["no-such-command"]) == 2
    assert main([]) == 2


def test_a_bad_difficulty_of_a_warm_start_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep this process's
    assert main(["warmstart", "--out", str(tmp_path / "m"), "--difficulty", "maxlen=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laminar-examples warmstart: difficulty 'maxlen=3'")
    assert not (tmp_path / "m").exists()


def test_a_warm_start_without_the_train_extra_says_what_to_install(monkeypatch, tmp_path,
                                                                   capsys):
    monkeypatch.setitem(sys.modules, "laminar_trainer", None)  # as if not installed
    assert main(["warmstart", "--out", str(tmp_path / "m")]) == 2
    assert "pip install 'laminar-examples[train]'" in capsys.readouterr().err
    assert main(["warmstart-chat", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laminar-examples warmstart-chat: ")
    assert not (tmp_path / "m").exists()


def test_completion_script_and_completions(monkeypatch):
    assert_completion(cli, main, "laminar-examples", monkeypatch, {
        "laminar-examples prompts --split ": ["plain,train", "plain,eval"],
        "laminar-examples warmstart --t": ["plain,--task", "plain,--target-accuracy"],
    }, shell="bash")


def test_help_and_prompts_import_nothing_heavy(tmp_path):
    """--help of every command and writing task prompts import no torch (the warm starts
    import it when they run)."""
    out = str(tmp_path / 'p.jsonl')
    codes, heavy = run_fresh(f"""
        from laminar_examples.cli import cli, main
        codes = [main([c, '--help']) for c in cli.commands] + [main(['--help'])]
        codes.append(main(['prompts', '--n', '3', '--out', {out!r}]))
        result = codes
    """, ('torch', 'transformers', 'tokenizers', 'vllm'))
    assert codes == [0] * (len(cli.commands) + 2) and heavy == []


def test_the_module_runs_as_a_script(tmp_path):
    out = tmp_path / "p.jsonl"
    done = subprocess.run([sys.executable, "-m", "laminar_examples.cli", "prompts", "--n", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(read_jsonl(out)) == 4
