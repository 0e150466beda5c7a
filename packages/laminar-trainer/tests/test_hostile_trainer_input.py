"""Hostile input to the trainer's decoders: STEP payloads and checkpoint files.

``decode_groups`` turns any bytes into complete groups or a ``LaminarError``;
the checkpoint reader turns a corrupted ``trainer.json`` / ``optimizer.json`` /
``optimizer.safetensors`` / ``LATEST`` into a ``LaminarError`` naming the file,
never a KeyError, JSONDecodeError or a TrainerState with fields of the wrong type.
"""

from __future__ import annotations

import copy
import json
import operator
import shutil
from functools import reduce

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_common.codec import Trajectory
from laminar_common.errors import LaminarError
from laminar_common.testing import json_values
from laminar_trainer.buffer import Group
from laminar_trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    read_optimizer_state,
    save_checkpoint,
)
from laminar_trainer.distributed import decode_groups, encode_groups

SETTINGS = settings(max_examples=200, deadline=None)
FILE_SETTINGS = settings(max_examples=100, deadline=None)



# -- STEP payloads --------------------------------------------------------------


@st.composite
def complete_groups(draw) -> list[Group]:
    out = []
    for g in range(draw(st.integers(0, 3))):
        size, prompt_id = draw(st.integers(1, 3)), f"p{g}"
        members = {}
        for i in range(size):
            n = draw(st.integers(0, 4))
            members[i] = Trajectory(
                trajectory_id=f"{prompt_id}#{i}", prompt_id=prompt_id, group_size=size,
                sample_index=i, worker_id="w", policy_version=draw(st.integers(-1, 5)),
                prompt_token_ids=(1, 2), response_token_ids=tuple(range(n)),
                behaviour_logprobs=(-1.0,) * n, reward=draw(st.floats(-1, 1)),
                finish_reason="stop")
        out.append(Group(prompt_id, size, members, draw(st.floats(0, 1))))
    return out


def _paths(node, prefix=()):
    yield prefix
    children = enumerate(node) if isinstance(node, list) else (
        node.items() if isinstance(node, dict) else ())
    for key, child in children:
        yield from _paths(child, (*prefix, key))


@st.composite
def mutated(draw, obj):
    """``obj`` (lists, dicts, scalars) with 1-3 nodes replaced, deleted or repeated."""
    obj = copy.deepcopy(obj)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(obj) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = reduce(operator.getitem, path[:-1], obj), path[-1]
        op = draw(st.sampled_from(["replace", "delete", "repeat"]))
        if op == "replace":
            parent[key] = draw(json_values | st.integers(-2, 5) | st.text(max_size=3))
        elif op == "delete":
            del parent[key]
        elif isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
    return obj


plausible_payloads = complete_groups().flatmap(
    lambda gs: mutated(msgspec.msgpack.decode(encode_groups(gs)))).map(msgspec.msgpack.encode)


def check_groups(payload: bytes) -> None:
    try:
        groups = decode_groups(payload)
    except LaminarError as exc:
        assert "STEP payload from rank 0" in str(exc)
        return
    for group in groups:
        assert len(group.members) == group.group_size and group.complete
        assert all(t.prompt_id == group.prompt_id and t.sample_index == i
                   for i, t in group.members.items())
    assert encode_groups(decode_groups(encode_groups(groups))) == encode_groups(groups)


@SETTINGS
@given(st.binary(max_size=300))
def test_step_payload_from_any_bytes(payload):
    check_groups(payload)


@SETTINGS
@given(plausible_payloads)
def test_step_payload_with_parts_changed(payload):
    check_groups(payload)


@SETTINGS
@given(complete_groups())
def test_complete_groups_round_trip(groups):
    got = decode_groups(encode_groups(groups))
    assert [(g.prompt_id, g.group_size) for g in got] == [
        (g.prompt_id, g.group_size) for g in groups]
    assert encode_groups(got) == encode_groups(groups)


def test_a_group_missing_a_sample_is_refused():
    (group,) = _one_group()
    del group.members[1]
    with pytest.raises(LaminarError, match="group 'p0' of size 2 carries 1 trajectories"):
        decode_groups(encode_groups([group]))


def _one_group() -> list[Group]:
    members = {i: Trajectory(
        trajectory_id=f"p0#{i}", prompt_id="p0", group_size=2, sample_index=i, worker_id="w",
        policy_version=0, prompt_token_ids=(1,), response_token_ids=(2,),
        behaviour_logprobs=(-1.0,), reward=0.0, finish_reason="stop") for i in range(2)}
    return [Group("p0", 2, members)]


# -- checkpoints ----------------------------------------------------------------


def _optimizer() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    optimizer = _optimizer()
    optimizer.param_groups[0]["params"][0].grad = torch.ones(2, 3)
    optimizer.param_groups[0]["params"][1].grad = torch.ones(2)
    optimizer.step()
    root = tmp_path_factory.mktemp("ckpt")
    return save_checkpoint(root, None, None, optimizer, TrainerState(3, 2, ["a", "b"], 7))


@pytest.fixture(scope="module")
def ckpt(pristine, tmp_path_factory):
    """A working copy; each test restores what it corrupts."""
    copy_dir = tmp_path_factory.mktemp("ckpt-copy") / pristine.name
    shutil.copytree(pristine, copy_dir)
    return copy_dir


STATE = "trainer_state"  # where a checkpoint keeps trainer.json and the optimizer files


def _restore(ckpt, pristine, name):
    shutil.copyfile(pristine / STATE / name, ckpt / STATE / name)


def check_trainer_json(ckpt, raw: bytes) -> None:
    (ckpt / STATE / "trainer.json").write_bytes(raw)
    try:
        state = load_checkpoint(ckpt, None)
    except LaminarError as exc:
        assert "trainer.json" in str(exc)
        return
    assert all(type(v) is int for v in (state.step, state.version, state.seed))
    assert type(state.consumed) is list and all(type(i) is str for i in state.consumed)


def _encode(obj) -> bytes:
    return json.dumps(obj).encode()


@FILE_SETTINGS
@given(st.binary(max_size=120) | json_values.map(_encode))
def test_trainer_json_from_anything(ckpt, pristine, raw):
    try:
        check_trainer_json(ckpt, raw)
    finally:
        _restore(ckpt, pristine, "trainer.json")


@FILE_SETTINGS
@given(st.data())
def test_trainer_json_with_parts_changed(ckpt, pristine, data):
    original = json.loads((pristine / STATE / "trainer.json").read_text())
    try:
        check_trainer_json(ckpt, _encode(data.draw(mutated(original))))
    finally:
        _restore(ckpt, pristine, "trainer.json")


def check_optimizer_file(ckpt, name: str, raw: bytes) -> None:
    (ckpt / STATE / name).write_bytes(raw)
    try:
        saved = read_optimizer_state(ckpt)
    except LaminarError as exc:
        assert name in str(exc)
        saved = None
    optimizer = _optimizer()
    try:
        state = load_checkpoint(ckpt, optimizer)
    except LaminarError as exc:
        assert name in str(exc)
        return
    assert saved is not None and state.step == 3
    assert len(optimizer.state_dict()["param_groups"]) == 1


@FILE_SETTINGS
@given(st.binary(max_size=120) | json_values.map(_encode))
def test_optimizer_json_from_anything(ckpt, pristine, raw):
    try:
        check_optimizer_file(ckpt, "optimizer.json", raw)
    finally:
        _restore(ckpt, pristine, "optimizer.json")


@FILE_SETTINGS
@given(st.data())
def test_optimizer_json_with_parts_changed(ckpt, pristine, data):
    original = json.loads((pristine / STATE / "optimizer.json").read_text())
    try:
        check_optimizer_file(ckpt, "optimizer.json", _encode(data.draw(mutated(original))))
    finally:
        _restore(ckpt, pristine, "optimizer.json")


@FILE_SETTINGS
@given(st.data())
def test_optimizer_tensors_corrupted(ckpt, pristine, data):
    good = (pristine / STATE / "optimizer.safetensors").read_bytes()
    cut = data.draw(st.integers(0, len(good)))
    raw = data.draw(st.sampled_from([good[:cut], good[:cut] + data.draw(st.binary(max_size=40)),
                                     data.draw(st.binary(max_size=200))]))
    try:
        check_optimizer_file(ckpt, "optimizer.safetensors", raw)
    finally:
        _restore(ckpt, pristine, "optimizer.safetensors")


def test_a_pristine_checkpoint_loads(ckpt):
    optimizer = _optimizer()
    state = load_checkpoint(ckpt, optimizer)
    assert (state.step, state.version, state.consumed, state.seed) == (3, 2, ["a", "b"], 7)
    assert optimizer.state_dict()["state"][0]["exp_avg"].shape == (2, 3)


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("trainer.json", b'{"step": 1, "version": 2}', "expected an object with step, version"),
    ("trainer.json", b'{"step": "3", "version": 2, "consumed": []}', "step must be int"),
    ("trainer.json", b'{"step": 3, "version": 2, "consumed": [1]}', "consumed must list"),
    ("trainer.json", b"\xff", "cannot be read"),
    ("optimizer.json", b"[]", "expected an object with param_groups"),
    ("optimizer.json", b'{"param_groups": [], "scalars": {"0": 1}}', "expected an object"),
    ("optimizer.json", b'{"param_groups": [{}], "scalars": {}}', "does not fit this optimizer"),
    ("optimizer.json", b'{"param_groups": [], "scalars": {}, "int_keys": true}',
     "does not fit this optimizer"),
    ("optimizer.safetensors", b"\x00" * 8, "optimizer.safetensors cannot be read"),
])
def test_corrupted_files_are_named(ckpt, pristine, name, raw, message):
    (ckpt / STATE / name).write_bytes(raw)
    try:
        with pytest.raises(LaminarError, match=message) as info:
            load_checkpoint(ckpt, _optimizer())
        text = str(info.value)
        assert name in text or "optimizer.json / optimizer.safetensors" in text
    finally:
        _restore(ckpt, pristine, name)


@SETTINGS
@given(st.binary(max_size=40))
def test_latest_marker_from_any_bytes(pristine, raw):
    root = pristine.parent
    marker = root / "LATEST"
    good = marker.read_bytes()
    marker.write_bytes(raw)
    try:
        found = latest_checkpoint(root)
    except LaminarError as exc:
        assert "LATEST" in str(exc) or "incomplete" in str(exc)
        return
    finally:
        marker.write_bytes(good)
    assert (found / STATE / "trainer.json").is_file()
