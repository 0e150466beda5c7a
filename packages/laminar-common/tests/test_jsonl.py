import pytest

from laminar_common.errors import ConfigError
from laminar_common.jsonl import iter_jsonl, read_jsonl


def test_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:3: expected a JSON object, got list"):
        read_jsonl(path)
    path.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl(path)


def test_bad_utf8_is_named_on_its_own_line(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"bytes.jsonl:2: not valid UTF-8 \(column 8\)"):
        read_jsonl(path)


def test_where_and_missing_file(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert [(w.rsplit(":", 1)[1], r["a"]) for w, r in iter_jsonl(path)] == [("1", 1), ("3", 2)]
    with pytest.raises(ConfigError, match="cannot be read"):
        read_jsonl(tmp_path / "absent.jsonl")
