"""The rollout tier's preflight (``--print-config``): data files parse to the last row,
code specs import with a signature Laminar can call, and a weak sandbox is said."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from laminar_common.config import PREFLIGHT_WARNING_PREFIX
from laminar_common.testing import clear_laminar_env
from laminar_rollout.cli import main


@pytest.fixture(autouse=True)
def _here(monkeypatch, tmp_path):
    clear_laminar_env(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mypkg_rewards", "mypkg_rewards_bad"):
        sys.modules.pop(name, None)


def _serve(*sets: str) -> list[str]:
    return ["serve", "--set", "engine.type=simulated", *[a for s in sets for a in ("--set", s)],
            "--print-config"]


def test_a_reward_module_that_does_not_import_is_refused_naming_it(capsys):
    assert main(_serve("reward=mypkg.rewards:score")) == 2
    err = capsys.readouterr().err
    assert "reward 'mypkg.rewards:score'" in err and "cannot import 'mypkg.rewards'" in err


def test_a_reward_that_cannot_take_laminars_arguments_is_refused(tmp_path, capsys):
    (tmp_path / "mypkg_rewards_bad.py").write_text("def score(completion):\n    return 1.0\n")
    assert main(_serve("reward=mypkg_rewards_bad:score")) == 2
    err = capsys.readouterr().err
    assert "cannot be called as any reward Laminar knows" in err
    assert "fn(prompt, completion, metadata) -> float (Laminar's)" in err
    assert "fn(prompts, completions, **kwargs) -> list[float] (TRL's)" in err


def test_trl_and_verl_style_rewards_pass_as_they_are(tmp_path, capsys):
    (tmp_path / "mypkg_rewards.py").write_text(
        "def trl(completions, **kwargs):\n    return [1.0 for _ in completions]\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str == ground_truth)\n")
    assert main(_serve("reward=mypkg_rewards:trl")) == 0
    assert main(_serve("reward=mypkg_rewards:compute_score")) == 0


def test_a_good_reward_passes(tmp_path, capsys):
    (tmp_path / "mypkg_rewards.py").write_text(
        "def score(prompt, completion, metadata):\n    return 1.0\n")
    assert main(_serve("reward=mypkg_rewards:score")) == 0
    assert PREFLIGHT_WARNING_PREFIX not in capsys.readouterr().err


def test_a_custom_environment_that_does_not_load_is_refused(capsys):
    assert main(_serve("environment.type=nosuchpkg.envs:Env")) == 2
    assert "environment.type" in capsys.readouterr().err


def test_a_custom_engine_factory_that_does_not_import_is_refused(capsys):
    assert main(["serve", "--set", "engine.type=custom", "--set",
                 "engine.factory=nosuchpkg.engines:make", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "engine.factory 'nosuchpkg.engines:make'" in err


def test_a_python_tool_on_rlimit_isolation_is_warned(capsys):
    assert main(_serve("environment.type=tools", "environment.sandbox.isolation=rlimit")) == 0
    err = capsys.readouterr().err
    assert f"{PREFLIGHT_WARNING_PREFIX}the python tool's sandbox runs with rlimit isolation" \
        in err


def test_a_bad_row_of_the_prompt_file_is_refused_naming_file_and_row(tmp_path, capsys):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    rows[3] = {"question": "no prompt key here", "answer": "3"}
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["manage", "--set", "prompts=train.jsonl", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "prompts (train.jsonl)" in err and "train.jsonl:4" in err, err


def test_a_bad_parquet_row_is_refused_naming_it(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["a", "b", None, "d"], "answer": ["1", "2", "3", "4"]})
    pq.write_table(table, tmp_path / "train.parquet")
    assert main(["manage", "--set", "prompts=train.parquet", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "train.parquet" in err and "row" in err, err


def test_an_answer_key_no_record_has_is_refused_or_warned(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text(textwrap.dedent("""\
        {"prompt": "a", "solution": "1"}
        {"prompt": "b", "solution": "2"}
        """))
    assert main(["manage", "--set", "prompts=train.jsonl", "--set",
                 "data.answer_key=reward_model.ground_truth", "--print-config"]) == 2
    assert "answer_key 'reward_model.ground_truth'" in capsys.readouterr().err
    # the default key, absent from every record: the job may not need answers, so a warning
    assert main(["manage", "--set", "prompts=train.jsonl", "--print-config"]) == 0
    err = capsys.readouterr().err
    assert f"{PREFLIGHT_WARNING_PREFIX}prompts (train.jsonl): no record has an answer" in err


def test_a_refusal_is_the_error_alone_so_laminar_up_can_defer_it_past_the_set_up(
        tmp_path, capsys):
    from laminar_common.launch.preflight import is_deferred

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.jsonl").write_text('{"question": "no prompt"}\n')
    assert main(["manage", "--set", "prompts=run/train.jsonl", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no config dump around the error
    assert is_deferred(err, ["run/train.jsonl"])  # a set-up that writes it: checked after


def test_a_prompt_file_not_there_yet_is_left_to_the_managers_start(capsys):
    # a set-up step may write it; the manager refuses a missing file when it starts
    assert main(["manage", "--set", "prompts=run/later.jsonl", "--print-config"]) == 0
    assert "prompts: run/later.jsonl" in capsys.readouterr().out
