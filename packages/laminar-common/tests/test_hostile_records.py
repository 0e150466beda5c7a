"""Hostile etcd values: member records, version records and election owners.

Whatever bytes sit under a key, decoding gives a fully typed record (that
re-encodes to an equal one) or a :class:`CoordinationError` naming the key —
never another exception, never a record with a field of the wrong type.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_common.errors import CoordinationError
from laminar_common.membership import (
    InMemoryCoordinator,
    InMemoryEtcd,
    MemberRecord,
    VersionRecord,
    decode_leader,
    decode_member,
    decode_version,
    encode_record,
)

SETTINGS = settings(max_examples=200, deadline=None)
KEY = "/laminar/job/members/worker/w1"

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
                | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: (
    st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
FIELD_VALUES = {str: st.text(max_size=12), int: st.integers(-(2**63), 2**63),
                float: st.floats(allow_nan=False), dict[str, str]: st.dictionaries(
                    st.text(max_size=6), st.text(max_size=6), max_size=3)}


def record_dicts(cls: type[msgspec.Struct]) -> st.SearchStrategy[dict]:
    """Objects with ``cls``'s field names (the required ones always), each value usually
    of the field's type and sometimes any JSON-like value; now and then a stray key."""
    fields = msgspec.structs.fields(cls)
    values = {f.name: st.integers(1, 6).flatmap(
        lambda i, t=f.type: json_values if i == 1 else FIELD_VALUES[t]) for f in fields}
    required = {f.name: values.pop(f.name) for f in fields if f.required}
    shaped = st.fixed_dictionaries(required, optional=values)
    return shaped | st.builds(lambda d, k, v: {**d, k: v}, shaped, st.text(max_size=6), json_values)


def encoded(objects: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    return st.builds(lambda obj, ascii_only: json.dumps(obj, ensure_ascii=ascii_only).encode(),
                     objects, st.booleans())


def check(decode, cls, raw: bytes) -> None:
    try:
        record = decode(raw, KEY)
    except CoordinationError as exc:
        assert repr(KEY) in str(exc) and "malformed" in str(exc)
        return
    assert type(record) is cls
    for field in msgspec.structs.fields(cls):
        value = getattr(record, field.name)
        kind = dict if field.type == dict[str, str] else field.type
        assert isinstance(value, kind), (field.name, value)
        if kind is int:
            assert not isinstance(value, bool)
    assert decode(encode_record(record), KEY) == record


@SETTINGS
@given(encoded(record_dicts(MemberRecord) | json_values) | st.binary(max_size=120))
def test_member_records_from_any_value(raw):
    check(decode_member, MemberRecord, raw)


@SETTINGS
@given(encoded(record_dicts(VersionRecord) | json_values) | st.binary(max_size=120))
def test_version_records_from_any_value(raw):
    check(decode_version, VersionRecord, raw)


@SETTINGS
@given(st.binary(max_size=60))
def test_election_owner_from_any_value(raw):
    try:
        owner = decode_leader(raw, "/laminar/job/election/relay-master")
    except CoordinationError as exc:
        assert "'/laminar/job/election/relay-master'" in str(exc)
        return
    assert owner.encode() == raw


def test_a_corrupt_member_record_is_left_out_and_named(caplog):
    store = InMemoryEtcd()
    coord = InMemoryCoordinator(store, "job", ttl_s=5, keepalive=False)
    coord.register(MemberRecord(member_id="w0", role="worker"))
    key = coord.keys.member("worker", "w1")
    store.put(key, b'{"member_id": "w1", "role": "worker", "capacity": "many"}')
    assert list(coord.members()) == ["w0"]
    assert f"member record at '{key}' is malformed" in caplog.text
    store.put(coord.keys.weights_latest(), b"\x00\xff")
    with pytest.raises(CoordinationError, match="version record at .* is malformed"):
        coord.latest_version()


def test_a_non_utf8_election_owner_is_a_coordination_error():
    store = InMemoryEtcd()
    coord = InMemoryCoordinator(store, "job", ttl_s=5, keepalive=False)
    key = coord.keys.election("relay-master")
    store.put(key, b"relay-\xff")
    with pytest.raises(CoordinationError, match=f"election value at '{key}' is not UTF-8"):
        coord.leader("relay-master")
