"""Hostile prompt files: any bytes, any lines, records of any shape.

``load_prompt_file`` returns one validated record per non-blank line, or raises
:class:`ConfigError` naming the file and, for a bad line, the first bad line's
number (a whole-file error, such as a duplicate id, names no line); no other
exception escapes, whatever the file holds.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_common.errors import ConfigError
from laminar_rollout.prompts import load_prompt_file

SETTINGS = settings(max_examples=200, deadline=None)

# Integers past 2**64 on purpose (JSON has no bound; the loader must name the line).
json_scalars = (st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats()
                | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: (
    st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
metadata = st.text(max_size=6) | st.integers() | st.floats() | st.booleans()
good_records = st.fixed_dictionaries(
    {"id": st.text(min_size=1, max_size=6), "prompt": st.text(min_size=1, max_size=8)},
    optional={"task": metadata, "answer": metadata})
any_records = st.fixed_dictionaries(
    {},
    optional={"id": st.text(max_size=4) | json_values, "prompt": st.text(max_size=8) | json_values,
              "task": st.text(max_size=6) | json_values, "answer": st.integers() | json_values},
)


def as_line(records: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    return st.builds(lambda obj, ascii_only: json.dumps(obj, ensure_ascii=ascii_only).encode(),
                     records, st.booleans())


odd_lines = st.sampled_from([
    b"", b"   ", b"\t", b"\x00", b"\xff\xfe", b'{"id": "a", "prompt": "\xc3"}', b"[" * 5000,
    b'{"id": "n", "prompt": "p", "big": ' + b"9" * 5000 + b"}", b"NaN", b'"just a string"',
    b'{"id": "a", "prompt": "x"}', b'{"id": "b", "prompt": "y", "m": {"k": 1}}',
])
# Lines never hold \n or \r, so line numbers here match the loader's.
raw_lines = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
bad_lines = as_line(any_records | json_values) | odd_lines | raw_lines
# Mostly good lines, so that whole files load too; a bad one about once in six.
good_lines = as_line(good_records)
lines = st.lists(st.integers(1, 6).flatmap(lambda i: bad_lines if i == 1 else good_lines),
                 max_size=6)


@pytest.fixture(scope="module")
def prompt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-prompts")


def load(path):
    """(records, None) or (None, message): nothing but ConfigError may escape."""
    try:
        return load_prompt_file(path), None
    except ConfigError as exc:
        return None, str(exc)


@SETTINGS
@given(lines, st.booleans())
def test_any_lines(prompt_dir, body, trailing_newline):
    path = prompt_dir / "prompts.jsonl"
    path.write_bytes(b"\n".join(body) + (b"\n" if trailing_newline else b""))
    got, error = load(path)
    if got is not None:
        texts = [line.decode("utf-8") for line in body]
        assert len(got) == sum(1 for t in texts if t.strip())
        assert len({r.record_id for r in got}) == len(got)
        for rec in got:
            assert isinstance(rec.record_id, str) and rec.record_id
            assert "#" not in rec.record_id and "@e" not in rec.record_id
            assert isinstance(rec.prompt, (str, tuple)) and rec.prompt
            json.dumps(rec.metadata, allow_nan=False)  # JSON values only
            assert "answer" not in rec.metadata or isinstance(rec.metadata["answer"], str)
        return
    assert str(path) in error
    named = re.match(re.escape(str(path)) + r":(\d+): ", error)
    if named is None:
        assert any(whole_file in error for whole_file in (
            "duplicate id", "holds no records", "records disagree on ids")), error
        return
    n = int(named.group(1))
    assert 1 <= n <= len(body)
    # The line named is bad on its own ...
    alone = prompt_dir / "alone.jsonl"
    alone.write_bytes(body[n - 1] + b"\n")
    _, error_alone = load(alone)
    assert error_alone is not None and error_alone.startswith(f"{alone}:1: "), error_alone
    # ... and it is the first bad one: the lines before it are fine.
    before = prompt_dir / "before.jsonl"
    before.write_bytes(b"\n".join(body[: n - 1]) + b"\n")
    _, error_before = load(before)
    assert error_before is None or not error_before.startswith(f"{before}:"), error_before


@SETTINGS
@given(st.binary(max_size=300))
def test_any_bytes(prompt_dir, raw):
    path = prompt_dir / "raw.jsonl"
    path.write_bytes(raw)
    got, error = load(path)
    assert (got is None) != (error is None)
    if error is not None:
        assert str(path) in error


@pytest.mark.parametrize(("body", "message"), [
    (b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "\xff"}\n',
     r":2: not valid UTF-8 \(column 24\)"),
    (b'{"id": "a", "prompt": "ok"}\n' + b"[" * 5000 + b"\n",
     r":2: not valid JSON: maximum recursion"),
    (b'{"id": "a", "prompt": "p", "n": ' + b"9" * 5000 + b"}\n",
     r":1: not valid JSON: Exceeds the limit"),
])
def test_undecodable_lines_are_named(prompt_dir, body, message):
    path = prompt_dir / "bad.jsonl"
    path.write_bytes(body)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + message):
        load_prompt_file(path)


def test_bad_bytes_far_into_a_file_name_their_own_line(prompt_dir):
    good = b"".join(b'{"id": "%d", "prompt": "p"}\n' % i for i in range(2000))
    path = prompt_dir / "long.jsonl"
    path.write_bytes(good + b'{"id": "x", "prompt": "\xc3("}\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2001: not valid UTF-8")):
        load_prompt_file(path)
