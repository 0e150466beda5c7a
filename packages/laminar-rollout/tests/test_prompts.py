import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_common.data.records import DataConfig
from laminar_common.errors import ConfigError
from laminar_rollout.prompts import (
    PromptCursor,
    PromptRecord,
    check_resume,
    epoch_order,
    load_prompt_file,
)


def test_jsonl_records_and_metadata(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "sort 21=", "task": "sort", "answer": "12"}\n\n'
                 '{"id": "b", "prompt": "x", "n": 3}\n')
    recs = load_prompt_file(p)
    assert [r.record_id for r in recs] == ["a", "b"]
    assert recs[0].metadata == {"task": "sort", "answer": "12"}
    assert recs[1].metadata == {"n": 3}


@pytest.mark.parametrize("line,match", [
    ("not json", r"p.jsonl:2: not valid JSON"),
    ('{"prompt": "x"}', r"p.jsonl: records disagree on ids: line 1 has an 'id' field"),
    ('{"id": "b#0", "prompt": "x"}', r"p.jsonl:2: field 'id' 'b#0' contains '#'"),
    ('{"id": "b"}', r"p.jsonl:2: field 'prompt'"),
    ('[1, 2]', r"p.jsonl:2: expected a JSON object"),
    ('{"id": "b", "prompt": "x", "m": [1, NaN]}', r"p.jsonl:2: field 'm\[1\]' is nan"),
    ('{"id": "a", "prompt": "x"}', r"duplicate id 'a' \(line 1 and line 2\)"),
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
    with pytest.raises(ConfigError, match="use .jsonl or .json"):
        load_prompt_file(tmp_path / "x.csv")


def test_parquet_records_rows_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    good = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["sort 21=", "sort 3="],
                             "task": ["sort", "sort"], "answer": ["12", "3"]}), good)
    recs = load_prompt_file(good)
    assert [(r.record_id, r.prompt) for r in recs] == [("a", "sort 21="), ("b", "sort 3=")]
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
        ids.append(r.record_id)
    assert ids == ["p0", "p1", "p2", "p0@e1", "p1@e1", "p2@e1"]
    cur = PromptCursor(recs, epochs=2, max_prompts=4)
    assert len([cur.next() for _ in range(6) if not cur.exhausted()]) == 4
    resumed = PromptCursor(recs, epochs=2, epoch=1, position=2)
    assert resumed.next().record_id == "p2@e1" and resumed.next() is None


def test_cursor_lookup_finds_records_by_their_dispatched_id(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    cursor = PromptCursor(load_prompt_file(p), epochs=3, shuffle=True, seed=5)
    dispatched = [cursor.next().record_id for _ in range(6)]
    assert sorted(dispatched) == ["a", "a@e1", "a@e2", "b", "b@e1", "b@e2"]
    for pid in dispatched:
        rec = cursor.lookup(pid)
        assert rec is not None and rec.record_id == pid
    assert cursor.lookup("b@e2").prompt == "y" and cursor.lookup("a@e1").prompt == "x"
    assert cursor.lookup("c") is None and cursor.lookup("c@e1") is None


def _records(tmp_path, n):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(f'{{"id": "p{i}", "prompt": "x{i}"}}\n' for i in range(n)))
    return load_prompt_file(p)


def _walk(cursor):
    out = []
    while (r := cursor.next()) is not None:
        out.append(r.record_id)
    return out


def test_shuffled_epochs_are_permutations_drawn_from_seed_and_epoch(tmp_path):
    recs = _records(tmp_path, 12)
    ids = _walk(PromptCursor(recs, epochs=3, shuffle=True, seed=7))
    epochs = [ids[:12], [i.removesuffix("@e1") for i in ids[12:24]],
              [i.removesuffix("@e2") for i in ids[24:]]]
    assert all(i.endswith("@e1") for i in ids[12:24]) and all(i.endswith("@e2") for i in ids[24:])
    for e, order in enumerate(epochs):
        assert sorted(order) == sorted(r.record_id for r in recs)
        assert order == [recs[i].record_id for i in epoch_order(12, e, 7)]
    assert len({tuple(o) for o in epochs}) == 3 and epochs[0] != [r.record_id for r in recs]
    assert _walk(PromptCursor(recs, epochs=3, shuffle=True, seed=7)) == ids
    assert _walk(PromptCursor(recs, epochs=3, shuffle=True, seed=8)) != ids
    assert _walk(PromptCursor(recs, epochs=1)) == [r.record_id for r in recs]
    # max_prompts takes the first prompts of the shuffled order: a random subset.
    assert _walk(PromptCursor(recs, epochs=3, max_prompts=5, shuffle=True, seed=7)) == ids[:5]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), epochs=st.integers(1, 3), seed=st.integers(0, 2**32),
       stop=st.integers(0, 27))
def test_a_resumed_cursor_continues_the_same_order(n, epochs, seed, stop):
    recs = [PromptRecord(f"r{i}", "x", {}) for i in range(n)]
    whole = _walk(PromptCursor(recs, epochs, shuffle=True, seed=seed))
    first = PromptCursor(recs, epochs, shuffle=True, seed=seed)
    taken = [first.next().record_id for _ in range(min(stop, n * epochs))]
    state = first.state()
    check_resume(state, n, True, seed)
    resumed = PromptCursor(recs, epochs, epoch=state["epoch"], position=state["position"],
                           shuffle=state["shuffle"], seed=state["seed"])
    assert taken + _walk(resumed) == whole


def test_resume_under_another_order_is_refused():
    saved = {"epoch": 0, "position": 3, "shuffle": True, "seed": 1, "records": 10}
    check_resume(saved, 10, True, 1)
    with pytest.raises(ValueError, match=r"saved run used data.shuffle=True, data.seed=1; this "
                                         r"config has data.shuffle=True, data.seed=2"):
        check_resume(saved, 10, True, 2)
    with pytest.raises(ValueError, match="data.shuffle=False"):
        check_resume(saved, 10, False, 1)
    with pytest.raises(ValueError, match="saved run had 10 prompts, the prompt file now holds 11"):
        check_resume(saved, 11, True, 1)
    # A state saved before shuffling existed: file order, seed 0, any size.
    check_resume({"epoch": 0, "position": 3}, 7, False, 5)
    with pytest.raises(ValueError, match="outside the 2 records"):
        PromptCursor([PromptRecord("a", "x", {}), PromptRecord("b", "y", {})], position=2)


def test_chat_prompts_and_nested_metadata_reach_the_cursor(tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text('{"prompt": [{"role": "user", "content": "2+2?"}], '
                 '"reward_model": {"ground_truth": 4}, "extra_info": {"i": [1, 2]}}\n')
    (rec,) = load_prompt_file(p, DataConfig(answer_key="reward_model.ground_truth",
                                            system_prompt="Think."))
    assert rec.record_id == "chat:1"
    assert rec.prompt == ({"role": "system", "content": "Think."},
                          {"role": "user", "content": "2+2?"})
    assert rec.metadata == {"reward_model": {"ground_truth": 4}, "extra_info": {"i": [1, 2]},
                            "answer": "4"}
    again = PromptCursor([rec], epochs=2)
    assert again.next() is rec and again.next().metadata is rec.metadata
