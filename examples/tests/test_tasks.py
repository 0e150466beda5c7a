"""Tests for laminar_examples.tasks: generation, splits, scoring, JSONL."""

import json
import subprocess
import sys

import pytest

from laminar_common.jsonl import read_jsonl
from laminar_examples import tasks
from laminar_examples.tasks import (
    ANSWER_END,
    TASK_ALPHABET,
    TASKS,
    extract_answer,
    find_overlap,
    make_task_records,
    parse_difficulty,
    plausible_mistake,
    score_completion,
    score_exact_answer,
    split_of,
    write_jsonl,
)


def test_records_have_the_documented_fields_and_round_trip_json():
    for task in TASKS:
        records = make_task_records(task, 20, seed=3)
        assert len(records) == 20
        for record in records:
            assert set(record) == {"id", "task", "prompt", "answer"}
            assert record["task"] == task
            assert json.loads(json.dumps(record)) == record


def test_generation_is_deterministic_and_seed_dependent():
    a = make_task_records("sort", 50, seed=1)
    assert a == make_task_records("sort", 50, seed=1)
    assert [r["prompt"] for r in a] != [r["prompt"] for r in make_task_records("sort", 50, seed=2)]


def test_ids_are_unique_across_tasks_seeds_and_splits():
    ids = [
        r["id"]
        for task in TASKS
        for seed in (0, 1)
        for split in ("train", "eval")
        for r in make_task_records(task, 30, seed, split)
    ]
    assert len(ids) == len(set(ids))


def test_sort_answers_are_sorted_digits_with_varying_length():
    records = make_task_records("sort", 400, seed=0, min_len=2, max_len=6)
    lengths = set()
    for r in records:
        digits = r["prompt"].removeprefix("sort ").removesuffix("=")
        assert r["prompt"] == f"sort {digits}="
        assert r["answer"] == "".join(sorted(digits))
        lengths.add(len(digits))
    assert lengths == {2, 3, 4, 5, 6}


def test_reverse_and_add_answers_are_right():
    for r in make_task_records("reverse", 100, seed=0):
        digits = r["prompt"].removeprefix("reverse ").removesuffix("=")
        assert r["answer"] == digits[::-1]
    for r in make_task_records("add", 200, seed=0, max_digits=4):
        a, b = r["prompt"].removeprefix("add ").removesuffix("=").split("+")
        assert r["answer"] == str(int(a) + int(b))
        assert 1 <= len(a) <= 4 and 1 <= len(b) <= 4
        assert a == str(int(a))  # no leading zeros


def test_every_character_is_in_the_alphabet():
    assert len(set(TASK_ALPHABET)) == len(TASK_ALPHABET)
    for task in TASKS:
        for r in make_task_records(task, 200, seed=5) + make_task_records(task, 50, 5, "eval"):
            assert set(r["prompt"] + r["answer"] + ANSWER_END) <= set(TASK_ALPHABET)


def test_train_and_eval_splits_are_disjoint_across_seeds():
    for task in TASKS:
        train = [r for seed in range(3) for r in make_task_records(task, 300, seed, "train")]
        held_out = [r for seed in range(3) for r in make_task_records(task, 100, seed, "eval")]
        assert find_overlap(train, held_out) == set()
        assert all(split_of(r["prompt"]) == "train" for r in train)
        assert all(split_of(r["prompt"]) == "eval" for r in held_out)


def test_split_of_is_stable_and_roughly_one_in_ten():
    assert split_of("sort 3142=") == split_of("sort 3142=")
    prompts = [f"add {a}+{b}=" for a in range(100) for b in range(100)]
    fraction = sum(split_of(p) == "eval" for p in prompts) / len(prompts)
    assert 0.08 < fraction < 0.12


def test_find_overlap_reports_shared_prompts():
    a = [{"prompt": "x"}, {"prompt": "y"}]
    assert find_overlap(a, [{"prompt": "y"}, {"prompt": "z"}]) == {"y"}


def test_bad_requests_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown task 'sorting'"):
        make_task_records("sorting", 1, 0)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        make_task_records("sort", 1, 0, "test")
    with pytest.raises(ValueError, match=r"no difficulty setting\(s\) \['max_digits'\]"):
        make_task_records("sort", 1, 0, max_digits=3)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        make_task_records("sort", 1, 0, min_len=5, max_len=3)
    with pytest.raises(ValueError, match="n must be >= 0"):
        make_task_records("sort", -1, 0)


def test_a_split_with_no_problems_raises_instead_of_looping(monkeypatch):
    monkeypatch.setattr(tasks, "split_of", lambda prompt: "train")
    with pytest.raises(ValueError, match="problem space is too small"):
        make_task_records("sort", 1, 0, "eval")


def test_score_completion_is_exact_on_the_extracted_answer():
    record = {"id": "r", "task": "sort", "prompt": "sort 310=", "answer": "013"}
    assert score_completion(record, "013") == 1.0
    assert score_completion(record, " 013 \ngarbage after the end marker") == 1.0
    assert score_completion(record, "13") == 0.0  # leading zero matters
    assert score_completion(record, "0133") == 0.0
    assert score_completion(record, "01 3") == 0.0
    assert score_completion(record, "") == 0.0
    assert extract_answer("42\n43") == "42"


def test_score_completion_rejects_bad_records():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        score_completion({"task": "nope", "answer": "1"}, "1")
    with pytest.raises(ValueError, match="no 'answer'"):
        score_completion({"id": "r", "task": "add"}, "1")


def test_score_exact_answer_for_math():
    assert score_exact_answer("42", "so the answer is \\boxed{42}.") == 1.0
    assert score_exact_answer("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}") == 1.0
    assert score_exact_answer("1/2", "first \\boxed{3}, finally \\boxed{0.50}") == 1.0
    assert score_exact_answer("1234", "work...\n#### 1,234\nbye") == 1.0
    assert score_exact_answer("7", "$7$.") == 1.0
    assert score_exact_answer("7", "\\boxed{8}") == 0.0
    assert score_exact_answer("7", "") == 0.0
    assert score_exact_answer("7", "\\boxed{7") == 0.0  # unclosed box: nothing extracted


def test_jsonl_round_trip(tmp_path):
    records = make_task_records("add", 5, seed=0)
    path = tmp_path / "nested" / "prompts.jsonl"
    assert write_jsonl(path, records) == 5
    assert read_jsonl(path) == records  # the one reader reads what tasks writes
    assert len(path.read_text().splitlines()) == 5


def test_tasks_module_imports_no_heavy_dependency():
    code = (
        "import sys, laminar_examples.tasks as t; t.make_task_records('sort', 3, 0); "
        "bad = {'torch', 'transformers', 'tokenizers', 'numpy'} & set(sys.modules); "
        "print(sorted(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plausible_mistakes_are_the_documented_wrong_answers():
    assert plausible_mistake({"task": "sort", "prompt": "sort 3142="}) == "3142"
    assert plausible_mistake({"task": "reverse", "prompt": "reverse 305="}) == "305"
    assert plausible_mistake({"task": "add", "prompt": "add 57+68="}) == "15"  # 5+6, 7+8 mod 10
    assert plausible_mistake({"task": "add", "prompt": "add 0+0="}) == "0"
    records = make_task_records("sort", 300, seed=4)
    wrong = [r for r in records if plausible_mistake(r) != r["answer"]]
    # An already sorted list is the only case where the mistake is right.
    assert all(plausible_mistake(r) == r["answer"] for r in records
               if list(r["prompt"][5:-1]) == sorted(r["prompt"][5:-1]))
    assert len(wrong) > 0.7 * len(records)


def test_plausible_mistake_refuses_a_prompt_of_another_task():
    with pytest.raises(ValueError, match="is not a 'sort' prompt"):
        plausible_mistake({"task": "sort", "prompt": "reverse 12="})
    with pytest.raises(ValueError, match="is not a 'add' prompt"):
        plausible_mistake({"task": "add", "prompt": "add 1-2="})
    with pytest.raises(ValueError, match="unknown task"):
        plausible_mistake({"task": "mul", "prompt": "mul 1*2="})


def test_parse_difficulty_names_the_bad_item():
    assert parse_difficulty("sort", ["max_len=4", "min_len=3"]) == {"max_len": 4, "min_len": 3}
    with pytest.raises(ValueError, match=r"'len=4'.*accepts \['max_digit', 'max_len', 'min_len'\]"):
        parse_difficulty("sort", ["len=4"])
    with pytest.raises(ValueError, match="'max_len=x'.*not an integer"):
        parse_difficulty("sort", ["max_len=x"])
    with pytest.raises(ValueError, match="expected KEY=INT"):
        parse_difficulty("add", ["max_digits"])


def test_prompts_cli_applies_difficulty_and_refuses_bad_keys(tmp_path):
    out = tmp_path / "p.jsonl"
    ok = subprocess.run([sys.executable, "-m", "laminar_examples.cli", "prompts", "--n", "50",
                         "--difficulty", "max_len=3", "--out", str(out)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert max(len(r["answer"]) for r in read_jsonl(out)) == 3
    bad = subprocess.run([sys.executable, "-m", "laminar_examples.cli", "prompts", "--n", "5",
                          "--difficulty", "maxlen=3", "--out", str(tmp_path / "q.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'maxlen=3'" in bad.stderr
    assert not (tmp_path / "q.jsonl").exists()


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_repeat_answers_repeat_the_unit_count_times():
    records = make_task_records("repeat", 500, seed=0)
    units, counts = set(), set()
    for r in records:
        unit, count = r["prompt"].removeprefix("repeat ").removesuffix("=").split("*")
        assert r["prompt"] == f"repeat {unit}*{count}="
        assert unit.isalpha() and unit.islower() and 1 <= len(unit) <= 2
        assert count == str(int(count)) and int(count) >= 1
        assert r["answer"] == unit * int(count)
        assert len(r["answer"]) <= 48
        units.add(len(unit))
        counts.add(int(count))
    assert units == {1, 2}
    assert {1, 2, 3} <= counts and max(counts) > 10


def test_repeat_is_deterministic_with_its_seed():
    a = make_task_records("repeat", 200, seed=7)
    assert a == make_task_records("repeat", 200, seed=7)
    assert [r["prompt"] for r in a] != [r["prompt"] for r in make_task_records("repeat", 200, 8)]
    train = make_task_records("repeat", 2000, seed=1)
    held_out = make_task_records("repeat", 500, seed=2, split="eval")
    assert find_overlap(train, held_out) == set()


def test_repeat_answer_lengths_are_long_tailed():
    # One character is one token of the demo's tokenizer, so these are token counts.
    lengths = [len(r["answer"]) for r in make_task_records("repeat", 4000, seed=1)]
    median, p99 = _quantile(lengths, 0.5), _quantile(lengths, 0.99)
    assert 3 <= median <= 6
    assert 30 <= p99 <= 48 and max(lengths) <= 48
    assert 8 <= p99 / median <= 13
    # The difficulty keywords move the distribution: a longer cap lets the tail grow.
    longer = [len(r["answer"]) for r in make_task_records("repeat", 4000, 1, max_len=200)]
    assert _quantile(longer, 0.99) > p99 and max(longer) > 48


def test_repeat_scoring_and_mistake_by_hand():
    record = {"id": "r", "task": "repeat", "prompt": "repeat ab*3=", "answer": "ababab"}
    assert score_completion(record, "ababab") == 1.0
    assert score_completion(record, "ababab\nabab") == 1.0  # after the end marker: ignored
    assert score_completion(record, "abababab") == 0.0  # one unit too many
    assert score_completion(record, "abab") == 0.0  # one too few: the plausible mistake
    assert score_completion(record, "ababa") == 0.0
    assert score_completion(record, "bababa") == 0.0
    assert plausible_mistake(record) == "abab"
    assert plausible_mistake({"task": "repeat", "prompt": "repeat z*1="}) == ""
    for r in make_task_records("repeat", 300, seed=4):
        unit, count = r["prompt"].removeprefix("repeat ").removesuffix("=").split("*")
        assert plausible_mistake(r) == unit * (int(count) - 1) != r["answer"]
    with pytest.raises(ValueError, match="is not a 'repeat' prompt"):
        plausible_mistake({"task": "repeat", "prompt": "repeat ab3="})


def test_repeat_refuses_bad_difficulty():
    with pytest.raises(ValueError, match="min_unit <= max_unit"):
        make_task_records("repeat", 1, 0, min_unit=3, max_unit=2)
    with pytest.raises(ValueError, match="max_unit <= max_len"):
        make_task_records("repeat", 1, 0, max_unit=4, max_len=3)
    with pytest.raises(ValueError, match="median_count must be >= 1"):
        make_task_records("repeat", 1, 0, median_count=0)


def test_the_synthetic_builtin_reward_is_this_modules():
    from laminar_common.data.rewards import load_reward_fn, score
    from laminar_examples.tasks import synthetic_reward

    assert load_reward_fn("synthetic") is synthetic_reward
    fn = load_reward_fn("synthetic")
    assert fn("sort 321=", "123", {"task": "sort", "answer": "123"}) == 1.0
    assert fn("sort 321=", "132", {"task": "sort", "answer": "123"}) == 0.0
    reward, err = score(synthetic_reward, "p", "1", {"task": "nope", "answer": "1"})
    assert reward == 0.0 and "unknown task" in err
