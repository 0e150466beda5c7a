import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_common import codec
from laminar_common.errors import ProtocolError


def _trajectory(**kw):
    base = dict(trajectory_id="p1:0", prompt_id="p1", group_size=4, sample_index=0,
                worker_id="w0", policy_version=3, prompt_token_ids=(1, 2, 3),
                response_token_ids=(4, 5), behaviour_logprobs=(-0.1, -2.5), reward=1.0,
                finish_reason="stop")
    base.update(kw)
    return codec.Trajectory(**base)


def test_round_trip_every_message_kind():
    msgs = [
        codec.Hello(member_id="w", role="worker", protocol_version=codec.PROTOCOL_VERSION),
        codec.Welcome(member_id="m", protocol_version=codec.PROTOCOL_VERSION),
        codec.Refused(reason="no"),
        codec.PromptTask(trajectory_id="p:0", prompt_id="p", group_size=2, sample_index=0,
                         prompt="1+1=", metadata={"answer": "2"},
                         sampling=codec.SamplingSpec(max_tokens=8, temperature=0.7)),
        _trajectory(),
        _trajectory(data_source="openai/gsm8k"),
        codec.PartialProgress(trajectory_id="p:0", worker_id="w", policy_version=1,
                              token_ids=(1,), logprobs=(-0.3,)),
        codec.Ack(trajectory_ids=("a", "b"), trainer_step=2, trainer_version=2),
        codec.WorkerReport(worker_id="w", policy_version=1, active=2, queued=0, max_batch=8,
                           kv_used_tokens=10, kv_capacity_tokens=100),
        codec.ExportTrajectories(trajectory_ids=("x",)),
        codec.GroupsFiltered(prompt_ids=("p", "q"), trainer_step=3),
        codec.WeightManifest(version=1, total_bytes=8, chunk_bytes=8,
                             tensors=(codec.TensorSpec(name="w", dtype="float32", shape=(2,),
                                                       offset=0, nbytes=8),),
                             chunks=(codec.ChunkSpec(index=0, offset=0, nbytes=8,
                                                     checksum="00"),)),
    ]
    for msg in msgs:
        assert codec.decode(codec.encode(msg)) == msg


def test_frame_header_carries_version():
    frame = codec.encode(_trajectory())
    assert frame[:4] == codec.MAGIC
    assert codec.peek_version(frame) == codec.PROTOCOL_VERSION


def test_other_protocol_version_is_refused():
    frame = bytearray(codec.encode(_trajectory()))
    frame[5] = codec.PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match="protocol version"):
        codec.decode(bytes(frame))


def test_oversized_refused_before_parsing():
    frame = codec.encode(_trajectory(response_token_ids=tuple(range(1000))))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.decode(frame, max_bytes=100)


def test_unknown_field_and_wrong_type_refused():
    body = msgspec.msgpack.encode({"kind": "ack", "trajectory_ids": ["a"], "trainer_step": 1,
                                   "trainer_version": 1, "surprise": 1})
    with pytest.raises(ProtocolError, match="malformed"):
        codec.decode(codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + body)
    body = msgspec.msgpack.encode({"kind": "ack", "trajectory_ids": "notalist",
                                   "trainer_step": 1, "trainer_version": 1})
    with pytest.raises(ProtocolError, match="malformed"):
        codec.decode(codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + body)


def test_expect_restricts_kind():
    frame = codec.encode(codec.Refused(reason="x"))
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        codec.decode(frame, expect=codec.Trajectory)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzzed_bytes_never_escape_as_other_errors(data):
    for frame in (data, codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + data):
        try:
            msg = codec.decode(frame)
        except ProtocolError:
            continue
        assert isinstance(msg, msgspec.Struct)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=50),
       st.lists(st.floats(allow_nan=False, width=32), max_size=50),
       st.text(max_size=40))
def test_trajectory_round_trip_property(tokens, logprobs, text):
    msg = _trajectory(response_token_ids=tuple(tokens), behaviour_logprobs=tuple(logprobs),
                      completion=text)
    assert codec.decode(codec.encode(msg)) == msg
