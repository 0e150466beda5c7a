"""Datasets read into records: verl parquet, GSM8K JSONL, Laminar's own lines, refusals."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from laminar_common.data.records import DataConfig, Record, load_records, prompt_text
from laminar_common.errors import ConfigError

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _jsonl(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _verl_rows():
    return [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + {i}? Think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i, "answer": f"{i}+{i}={2 * i} #### {2 * i}",
                       "tags": {"level": i % 3, "kind": "add"}},
    } for i in range(3)]


def test_a_verl_parquet_loads_with_derived_ids_and_nested_metadata(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "gsm8k_train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), path)
    config = DataConfig(answer_key="reward_model.ground_truth")
    records = load_records(path, config)
    assert [r.record_id for r in records] == ["gsm8k_train:0", "gsm8k_train:1", "gsm8k_train:2"]
    assert load_records(path, config) == records  # stable
    rec = records[2]
    assert rec.prompt == ({"role": "user", "content": "What is 2 + 2? Think step by step."},)
    assert rec.metadata == {
        "data_source": "openai/gsm8k", "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"split": "train", "index": 2, "answer": "2+2=4 #### 4",
                       "tags": {"level": 2, "kind": "add"}},
        "answer": "4",
    }
    assert prompt_text(rec.prompt) == "What is 2 + 2? Think step by step."


def test_a_verl_file_answers_from_its_ground_truth_without_an_answer_key(tmp_path):
    """The default answer_key ("answer") on a verl file, which has no answer column: the
    answer comes from reward_model.ground_truth, not silently from nowhere."""
    records = load_records(_jsonl(tmp_path, _verl_rows()), DataConfig())
    assert [r.metadata["answer"] for r in records] == ["0", "2", "4"]
    # a file's own answer column wins; answer_key null takes none
    rows = [dict(_verl_rows()[1], answer="two")]
    assert load_records(_jsonl(tmp_path, rows, "b.jsonl"))[0].metadata["answer"] == "two"
    none = load_records(_jsonl(tmp_path, _verl_rows(), "c.jsonl"), DataConfig(answer_key=None))
    assert all("answer" not in r.metadata for r in none)


def test_gsm8k_jsonl_with_question_and_answer(tmp_path):
    path = _jsonl(tmp_path, [{"question": "Natalia sold 48 clips ...", "answer": "... #### 72"},
                             {"question": "Weng earns $12 ...", "answer": "... #### 10"}],
                  name="gsm8k.jsonl")
    records = load_records(path, DataConfig(prompt_key="question"))
    assert [(r.record_id, r.prompt, r.metadata) for r in records] == [
        ("gsm8k:1", "Natalia sold 48 clips ...", {"answer": "... #### 72"}),
        ("gsm8k:2", "Weng earns $12 ...", {"answer": "... #### 10"}),
    ]


def test_derived_ids_name_the_line_blank_lines_included(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert [r.record_id for r in load_records(path)] == ["p:1", "p:3"]


def test_integer_ids_numbers_as_answers_and_an_id_key(tmp_path):
    path = _jsonl(tmp_path, [{"id": 7, "prompt": "x", "answer": 72},
                             {"id": 8, "prompt": "y", "answer": 2.5, "n": [1, {"k": None}]}])
    records = load_records(path)
    assert [(r.record_id, r.metadata) for r in records] == [
        ("7", {"answer": "72"}), ("8", {"answer": "2.5", "n": [1, {"k": None}]})]
    path = _jsonl(tmp_path, [{"meta": {"uid": 3}, "id": "other", "prompt": "x"}])
    (rec,) = load_records(path, DataConfig(id_key="meta.uid"))
    assert rec.record_id == "3" and rec.metadata == {"meta": {}, "id": "other"}
    path = _jsonl(tmp_path, [{"id": 1, "prompt": "x"}, {"id": "1", "prompt": "y"}])
    with pytest.raises(ConfigError, match=r"duplicate id '1' \(line 1 and line 2\)"):
        load_records(path)


def test_a_nested_prompt_key_leaves_the_rest_of_its_object(tmp_path):
    path = _jsonl(tmp_path, [{"extra": {"q": "2+2?", "hint": "add"}, "answer": 4}])
    (rec,) = load_records(path, DataConfig(prompt_key="extra.q"))
    assert rec.prompt == "2+2?" and rec.metadata == {"extra": {"hint": "add"}, "answer": "4"}


@pytest.mark.parametrize("row,match", [
    ({"id": "a", "prompt": "y"}, r"d.jsonl: duplicate id 'a' \(line 1 and line 2\)"),
    ({"id": True, "prompt": "y"}, r"d.jsonl:2: field 'id' must be a string or an integer, got bool"),
    ({"id": None, "prompt": "y"}, r"d.jsonl:2: field 'id' must be a string or an integer, got null"),
    ({"id": "", "prompt": "y"}, r"d.jsonl:2: field 'id' is an empty string"),
    ({"id": "b#1", "prompt": "y"}, r"d.jsonl:2: field 'id' 'b#1' contains '#'"),
    ({"id": "b@e1", "prompt": "y"}, r"d.jsonl:2: field 'id' 'b@e1' contains '@e'"),
    ({"id": "b"}, r"d.jsonl:2: field 'prompt' is missing"),
    ({"id": "b", "prompt": ""}, r"d.jsonl:2: field 'prompt' is an empty string"),
    ({"id": "b", "prompt": 3}, r"d.jsonl:2: field 'prompt' must be a string or a list of chat"),
    ({"id": "b", "prompt": []}, r"d.jsonl:2: field 'prompt' is an empty list of messages"),
    ({"id": "b", "prompt": ["hi"]}, r"d.jsonl:2: field 'prompt\[0\]' must be a message"),
    ({"id": "b", "prompt": [{"role": "bot", "content": "x"}]},
     r"d.jsonl:2: field 'prompt\[0\].role' must be one of system, user, assistant, tool, "
     r"got 'bot'"),
    ({"id": "b", "prompt": [{"role": "user", "content": "x"}, {"role": "user"}]},
     r"d.jsonl:2: field 'prompt\[1\].content' must be a string, got null"),
    ({"id": "b", "prompt": [{"role": "user", "content": [{"type": "text"}]}]},
     r"d.jsonl:2: field 'prompt\[0\].content' must be a string, got list"),
    ({"id": "b", "prompt": [{"role": "user", "content": "x", "name": "n"}]},
     r"d.jsonl:2: field 'prompt\[0\]' has 'name' besides 'role' and 'content'"),
    ({"id": "b", "prompt": "y", "m": {"deep": [1, float("nan")]}},
     r"d.jsonl:2: field 'm.deep\[1\]' is nan, not a finite number"),
    ({"id": "b", "prompt": "y", "answer": float("inf")},
     r"d.jsonl:2: field 'answer' is inf, not a finite number"),
    ({"prompt": "y"}, r"d.jsonl: records disagree on ids: line 1 has an 'id' field, line 2 has "
                      r"none"),
])
def test_refusals_name_the_file_line_and_field(tmp_path, row, match):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=match):
        load_records(path)


def test_refusals_of_files(tmp_path):
    with pytest.raises(ConfigError, match="data file .*none.jsonl' does not exist"):
        load_records(tmp_path / "none.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no records"):
        load_records(tmp_path / "e.jsonl")
    (tmp_path / "x.csv").write_text("prompt\nx\n")
    with pytest.raises(ConfigError, match=r"unknown suffix '.csv'; use .jsonl or .json"):
        load_records(tmp_path / "x.csv")
    (tmp_path / "bad#name.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad#name.jsonl:1: the derived id 'bad#name:1' "
                                          r"contains '#'.*rename the file or set id_key"):
        load_records(tmp_path / "bad#name.jsonl")
    (tmp_path / "mixed.jsonl").write_text('{"prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ConfigError, match="line 2 has an 'id' field, line 1 has none"):
        load_records(tmp_path / "mixed.jsonl")


def test_parquet_refusals_name_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["x", "y"], "blob": [b"a", b"b"]}), path)
    with pytest.raises(ConfigError, match=r"t.parquet: row 0: field 'blob' must hold JSON "
                                          r"values .* got bytes"):
        load_records(path)
    pq.write_table(pa.table({"id": ["a", None], "prompt": ["x", "y"]}), path)
    with pytest.raises(ConfigError, match=r"t.parquet: row 1: field 'id' must be a string"):
        load_records(path)
    pq.write_table(pa.table({"id": ["a", "a"], "prompt": ["x", "y"]}), path)
    with pytest.raises(ConfigError, match=r"duplicate id 'a' \(row 0 and row 1\)"):
        load_records(path)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match="not a readable parquet file"):
        load_records(broken)


def test_parquet_message_structs_padded_with_none_are_accepted(tmp_path):
    """A parquet struct column has every field any row used; absent ones read as None."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "system", "content": "s", "name": "sys"}]},
        {"prompt": [{"role": "user", "content": "u"}]}]), path)
    with pytest.raises(ConfigError, match=r"row 0: field 'prompt\[0\]' has 'name'"):
        load_records(path)
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": "u", "tool_call_id": None}]},
        {"prompt": [{"role": "user", "content": "v"}]}]), path)
    assert [r.prompt for r in load_records(path)] == [
        ({"role": "user", "content": "u"},), ({"role": "user", "content": "v"},)]


def test_chat_template_modes_and_system_prompt(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    path = _jsonl(tmp_path, [{"id": "t", "prompt": "text"}, {"id": "m", "prompt": chat},
                             {"id": "s", "prompt": [{"role": "system", "content": "own"}, *chat]}])
    user, system = {"role": "user", "content": "text"}, {"role": "system", "content": "Be brief."}
    auto = load_records(path)
    assert [r.prompt for r in auto] == ["text", tuple(chat),
                                        ({"role": "system", "content": "own"}, *chat)]
    always = load_records(path, DataConfig(chat_template="always"))
    assert always[0].prompt == (user,) and always[1].prompt == tuple(chat)
    with_system = load_records(path, DataConfig(system_prompt="Be brief."))
    assert with_system[0].prompt == (system, user)  # auto + system_prompt: text becomes a chat
    assert with_system[1].prompt == (system, *chat)
    assert with_system[2].prompt == auto[2].prompt  # a prompt with its own system keeps it
    with pytest.raises(ConfigError, match=r"d.jsonl:2: field 'prompt' is a list of chat messages "
                                          r"but chat_template is 'never'"):
        load_records(path, DataConfig(chat_template="never"))
    with pytest.raises(ValidationError, match="system_prompt needs a chat template"):
        DataConfig(chat_template="never", system_prompt="x")
    with pytest.raises(ValidationError, match="not a dot path"):
        DataConfig(answer_key="reward_model..ground_truth")


def test_answer_keys_missing_answers_and_typos(tmp_path, caplog):
    rows = [{"id": "a", "prompt": "x", "reward_model": {"ground_truth": "1"}},
            {"id": "b", "prompt": "y"}]
    path = _jsonl(tmp_path, rows)
    with caplog.at_level(logging.WARNING, logger="laminar_common.data.records"):
        records = load_records(path, DataConfig(answer_key="reward_model.ground_truth"))
    assert records[0].metadata["answer"] == "1" and "answer" not in records[1].metadata
    assert "1 of 2 records have no answer at 'reward_model.ground_truth'" in caplog.text
    with pytest.raises(ConfigError, match=r"d.jsonl: no record has answer_key "
                                          r"'reward_model.groundtruth' \(a typo\?\)"):
        load_records(path, DataConfig(answer_key="reward_model.groundtruth"))
    # The default key falls back to verl's ground truth where a record has it ...
    assert [r.metadata.get("answer") for r in load_records(path)] == ["1", None]
    # ... and may be absent everywhere (a reward that needs no answer) ...
    path = _jsonl(tmp_path, [{"prompt": "x"}, {"prompt": "y"}], "e.jsonl")
    assert all("answer" not in r.metadata for r in load_records(path))
    # ... and answer_key null takes none, leaving an "answer" field as the file has it.
    path = _jsonl(tmp_path, [{"prompt": "x", "answer": {"n": 1}}])
    assert load_records(path, DataConfig(answer_key=None))[0].metadata == {"answer": {"n": 1}}
    assert load_records(path)[0].metadata == {"answer": '{"n": 1}'}  # as a string for rewards


def test_prompt_text():
    assert prompt_text("plain") == "plain"
    assert prompt_text(({"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a"},
                        {"role": "user", "content": "q2"})) == "q2"
    assert prompt_text(({"role": "system", "content": "s"},)) == "s"
    assert prompt_text(()) == ""


json_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: (
    st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10)
ids = st.integers(-10**6, 10**6) | st.text(min_size=1, max_size=8).filter(
    lambda s: "#" not in s and "@e" not in s)


@SETTINGS
@given(st.lists(st.tuples(ids, st.dictionaries(
    st.text(min_size=1, max_size=6).filter(lambda k: k not in ("id", "prompt", "answer")),
    json_values, max_size=3)), max_size=6, unique_by=lambda t: str(t[0])))
def test_any_json_metadata_is_kept_as_is(tmp_path, rows):
    path = _jsonl(tmp_path, [{"id": i, "prompt": "p", **meta} for i, meta in rows] or [{}])
    if not rows:
        with pytest.raises(ConfigError, match="field 'prompt' is missing"):
            load_records(path)
        return
    got = load_records(path)
    assert [Record(str(i), "p", meta) for i, meta in rows] == got


@SETTINGS
@given(st.text(max_size=4), st.sampled_from(["#", "@e"]), st.text(max_size=4))
def test_ids_with_the_rollouts_separators_are_refused(tmp_path, before, reserved, after):
    rid = before + reserved + after
    path = _jsonl(tmp_path, [{"id": rid, "prompt": "p"}])
    with pytest.raises(ConfigError, match=r"field 'id' .* contains '(#|@e)', which ids must not"):
        load_records(path)
