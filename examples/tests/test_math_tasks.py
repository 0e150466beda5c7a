"""Tests for laminar_examples.math_tasks: problems, worked answers, verl parquet."""

import re

import pytest

from laminar_examples.math_tasks import (
    DATA_SOURCE,
    MATH_INSTRUCTION,
    make_math_problems,
    math_rows,
    parse_math_difficulty,
    write_math_prompts,
)
from laminar_examples.tasks import split_of

pq = pytest.importorskip("pyarrow.parquet")

_STEP = re.compile(r"^(\d+)([+*-])(\d+)=(\d+)\.$")


def _check_worked(answer: str, ground_truth: str) -> list[tuple[int, str, int, int]]:
    body, sep, final = answer.rpartition(" #### ")
    assert sep and final == ground_truth
    steps = []
    for i, text in enumerate(body.split(" ")):
        a, op, b, r = _STEP.match(text).groups()
        a, b, r = int(a), int(b), int(r)
        assert r == {"+": a + b, "-": a - b, "*": a * b}[op], answer
        if i:
            assert a == steps[-1][3], answer  # a second step continues from the first
        steps.append((a, op, b, r))
    assert str(steps[-1][3]) == ground_truth
    return steps


def test_parquet_has_verl_schema_and_no_id_column(tmp_path):
    path = tmp_path / "train.parquet"
    assert write_math_prompts(path, 40, "train", seed=1) == 40
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model",
                                  "extra_info"]
    for i, row in enumerate(table.to_pylist()):
        assert row["data_source"] == DATA_SOURCE
        assert row["ability"] == "math"
        [message] = row["prompt"]
        assert message["role"] == "user" and message["content"].endswith(MATH_INSTRUCTION)
        assert row["reward_model"]["style"] == "rule"
        extra = row["extra_info"]
        assert extra["split"] == "train" and extra["index"] == i
        assert message["content"] == f"{extra['question']} {MATH_INSTRUCTION}"
        _check_worked(extra["answer"], row["reward_model"]["ground_truth"])


def test_ground_truth_is_the_worked_answers_number_and_the_right_arithmetic():
    problems = make_math_problems(500, seed=0)
    lengths = set()
    for p in problems:
        steps = _check_worked(p.answer, p.ground_truth)
        assert tuple(steps) == p.steps
        assert all(0 <= n <= 99 for step in steps for n in (step[0], step[2], step[3]))
        numbers = [int(n) for n in re.findall(r"\d+", p.question)]
        assert steps[0][0] in numbers and all(s[2] in numbers for s in steps)
        lengths.add(len(steps))
        mistake = _check_worked(p.mistake, p.mistake.rpartition(" ")[2])
        # 2*2 == 2+2 is the one problem whose mistake still gets the number right.
        right = p.mistake.rpartition(" ")[2] == p.ground_truth
        assert right == (p.steps == ((2, "*", 2, 4),))
        assert len(mistake) == 1
    assert lengths == {1, 2}


def test_generation_is_deterministic_and_seed_dependent(tmp_path):
    a = make_math_problems(100, seed=3)
    assert a == make_math_problems(100, seed=3)
    assert [p.question for p in a] != [p.question for p in make_math_problems(100, seed=4)]
    write_math_prompts(tmp_path / "a.parquet", 30, "eval", seed=5)
    write_math_prompts(tmp_path / "b.parquet", 30, "eval", seed=5)
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))


def test_splits_are_disjoint_and_questions_unique():
    train = {p.question for seed in (0, 1) for p in make_math_problems(1500, seed, "train")}
    evals = [p.question for p in make_math_problems(300, 2, "eval")]
    assert len(evals) == len(set(evals))
    assert not train & set(evals)
    assert all(split_of(q) == "eval" for q in evals)


def test_difficulty_knob_bounds_the_numbers_and_steps():
    for p in make_math_problems(200, seed=0, max_value=4, max_factor=2, max_steps=1):
        assert len(p.steps) == 1
        a, op, b, _ = p.steps[0]
        assert a <= 4 and b <= 4 and (op != "*" or a == 2)
    assert parse_math_difficulty(["max_value=5", "max_steps=1"]) == {"max_value": 5,
                                                                     "max_steps": 1}
    for bad in (["max_len=3"], ["max_value"], ["max_value=x"]):
        with pytest.raises(ValueError):
            parse_math_difficulty(bad)
    with pytest.raises(ValueError, match="max_steps"):
        make_math_problems(1, 0, max_steps=3)
    with pytest.raises(ValueError, match="split"):
        make_math_problems(1, 0, "test")


def test_rows_and_paths_are_checked(tmp_path, monkeypatch):
    from laminar_examples import math_tasks

    assert math_rows([], "eval") == []
    with pytest.raises(ValueError, match="parquet"):
        write_math_prompts(tmp_path / "x.jsonl", 3, "train", 0)
    # A space too small for n distinct problems: refused once the draws run out (with the
    # real budget, 1,000 draws a problem, that takes ~5 s to find ~1,000 of them).
    monkeypatch.setattr(math_tasks, "_MAX_DRAWS_PER_PROBLEM", 20)
    with pytest.raises(ValueError, match=r"found only \d+ distinct 'eval' math problems"):
        make_math_problems(10_000, 0, "eval", max_value=2, max_steps=1)
