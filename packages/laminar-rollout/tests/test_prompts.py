import pytest

from laminar_common.errors import ConfigError
from laminar_rollout.prompts import PromptCursor, load_prompt_file
from laminar_rollout.rewards import exact_answer, load_reward_fn, score, synthetic_task


def test_jsonl_records_and_metadata(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "sort 21=", "task": "sort", "answer": "12"}\n\n'
                 '{"id": "b", "prompt": "x", "n": 3}\n')
    recs = load_prompt_file(p)
    assert [r.prompt_id for r in recs] == ["a", "b"]
    assert recs[0].metadata == {"task": "sort", "answer": "12"}
    assert recs[1].metadata == {"n": "3"}


@pytest.mark.parametrize("line,match", [
    ("not json", r"p.jsonl:2: not valid JSON"),
    ('{"prompt": "x"}', r"p.jsonl:2: field 'id'"),
    ('{"id": "b"}', r"p.jsonl:2: field 'prompt'"),
    ('[1, 2]', r"p.jsonl:2: expected a JSON object"),
    ('{"id": "b", "prompt": "x", "m": [1]}', r"p.jsonl:2: field 'm'"),
    ('{"id": "a", "prompt": "x"}', r"duplicate id 'a'"),
])
def test_malformed_records_name_the_line(tmp_path, line, match):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=match):
        load_prompt_file(p)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompt_file(tmp_path / "none.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no records"):
        load_prompt_file(tmp_path / "e.jsonl")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ConfigError, match=".jsonl or .parquet"):
        load_prompt_file(tmp_path / "x.csv")


def test_parquet_records_rows_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    good = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["sort 21=", "sort 3="],
                             "task": ["sort", "sort"], "answer": ["12", "3"]}), good)
    recs = load_prompt_file(good)
    assert [(r.prompt_id, r.prompt) for r in recs] == [("a", "sort 21="), ("b", "sort 3=")]
    assert recs[1].metadata == {"task": "sort", "answer": "3"}
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["a", None], "prompt": ["x", "y"]}), bad)
    with pytest.raises(ConfigError, match=r"bad.parquet: row 1: field 'id'"):
        load_prompt_file(bad)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(good.read_bytes()[:40])
    with pytest.raises(ConfigError, match="not a readable parquet file"):
        load_prompt_file(broken)


def test_cursor_epochs_limits_and_resume(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(f'{{"id": "p{i}", "prompt": "x"}}\n' for i in range(3)))
    recs = load_prompt_file(p)
    cur = PromptCursor(recs, epochs=2)
    ids = []
    while (r := cur.next()) is not None:
        ids.append(r.prompt_id)
    assert ids == ["p0", "p1", "p2", "p0@e1", "p1@e1", "p2@e1"]
    cur = PromptCursor(recs, epochs=2, max_prompts=4)
    assert len([cur.next() for _ in range(6) if not cur.exhausted()]) == 4
    resumed = PromptCursor(recs, epochs=2, epoch=1, position=2)
    assert resumed.next().prompt_id == "p2@e1" and resumed.next() is None


def test_reward_builtins_and_errors():
    meta = {"task": "sort", "answer": "123"}
    assert synthetic_task(meta, "123") == 1.0
    assert synthetic_task(meta, "132") == 0.0
    assert exact_answer({"answer": "0.5"}, "so \\boxed{1/2}") == 1.0
    fn = load_reward_fn("laminar_rollout.rewards:synthetic_task")
    assert score(fn, meta, "123") == (1.0, None)
    reward, err = score(fn, {"task": "nope", "answer": "1"}, "1")
    assert reward == 0.0 and "ValueError" in err
    reward, err = score(lambda m, c: float("nan"), meta, "x")
    assert reward == 0.0 and "nan" in err
    for bad in ("nocolon", "no.such.module:f", "laminar_rollout.rewards:missing"):
        with pytest.raises(ConfigError):
            load_reward_fn(bad)


def test_cursor_lookup_finds_records_by_their_dispatched_id(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\n{"id": "b@e9", "prompt": "y"}\n')
    cursor = PromptCursor(load_prompt_file(p), epochs=2)
    dispatched = [cursor.next().prompt_id for _ in range(4)]
    assert dispatched == ["a", "b@e9", "a@e1", "b@e9@e1"]
    for pid in dispatched:
        rec = cursor.lookup(pid)
        assert rec is not None and rec.prompt_id == pid
    assert cursor.lookup("b@e9").prompt == "y" and cursor.lookup("a@e1").prompt == "x"
    assert cursor.lookup("c") is None and cursor.lookup("c@e1") is None
