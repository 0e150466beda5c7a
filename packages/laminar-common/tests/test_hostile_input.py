"""Property-based tests of every decoder and config loader in laminar-common.

Each takes arbitrary (or structurally plausible but wrong) input and must
either return a fully valid value or raise the documented Laminar error —
never another exception, never a half-built value.
"""

from __future__ import annotations

import string

import msgspec
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laminar_common import codec
from laminar_common.codec import ChunkSpec, TensorSpec, WeightManifest
from laminar_common.config import EtcdConfig, LaminarModel, LoggingConfig, load_config
from laminar_common.errors import ConfigError, CoordinationError, ProtocolError
from laminar_common.membership import decode_member, decode_version
from laminar_common.relay.dataplane import CHUNK_HEADER, decode_chunk_header
from laminar_common.relay.manifests import validate_manifest

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
FILE_SETTINGS = settings(max_examples=50, deadline=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture])

json_scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(
    allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(string.ascii_lowercase + "_.", max_size=12), inner, max_size=4), max_leaves=20)


class TierConfig(LaminarModel):
    job: str = "j"
    etcd: EtcdConfig = EtcdConfig()
    logging: LoggingConfig = LoggingConfig()


@FILE_SETTINGS
@given(st.dictionaries(st.sampled_from(["job", "etcd", "logging", "other", "etcd.ttl_s"]),
                       json_values, max_size=4))
def test_config_loader_from_any_mapping(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        cfg = load_config(TierConfig, path, env={})
    except ConfigError as exc:
        assert str(exc)
        return
    assert isinstance(cfg, TierConfig)


@FILE_SETTINGS
@given(st.text(max_size=200))
def test_config_loader_from_any_text(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text)
    try:
        load_config(TierConfig, path, env={})
    except ConfigError:
        pass


@SETTINGS
@given(st.lists(st.text(string.printable, max_size=30), max_size=5))
def test_overrides_from_any_strings(overrides):
    try:
        load_config(TierConfig, overrides=overrides, env={})
    except ConfigError:
        pass


@SETTINGS
@given(st.binary(max_size=300))
def test_member_and_version_records_from_any_bytes(raw):
    for decode in (decode_member, decode_version):
        try:
            decode(raw, "/laminar/x/key")
        except CoordinationError:
            pass


@SETTINGS
@given(st.binary(min_size=0, max_size=80))
def test_chunk_header_from_any_bytes(raw):
    try:
        session, index, digest = decode_chunk_header(raw)
    except ProtocolError:
        return
    assert len(raw) == CHUNK_HEADER.size and len(session) + len(digest) < len(raw)


manifests = st.builds(
    WeightManifest,
    version=st.integers(-3, 10),
    total_bytes=st.integers(-5, 5000),
    chunk_bytes=st.integers(-5, 5000),
    tensors=st.lists(st.builds(TensorSpec, name=st.text(max_size=8),
                               dtype=st.sampled_from(["float32", "bfloat16", "uint8", "bogus", ""]),
                               shape=st.lists(st.integers(-2, 64), max_size=3).map(tuple),
                               offset=st.integers(-5, 5000), nbytes=st.integers(-5, 5000)),
                     max_size=4).map(tuple),
    chunks=st.lists(st.builds(ChunkSpec, index=st.integers(-1, 5), offset=st.integers(-5, 5000),
                              nbytes=st.integers(-5, 5000),
                              checksum=st.text("0123456789abcdefxyz", max_size=34)),
                    max_size=4).map(tuple),
)


@SETTINGS
@given(manifests)
def test_manifest_validation_never_lets_garbage_through(manifest):
    try:
        validate_manifest(manifest, max_total_bytes=4096, max_tensors=3)
    except ProtocolError:
        return
    # Accepted: it must be self-consistent.
    assert manifest.version >= 0 and 0 < manifest.total_bytes <= 4096
    assert sum(c.nbytes for c in manifest.chunks) == manifest.total_bytes
    assert len(manifest.tensors) <= 3


@SETTINGS
@given(st.sampled_from([codec.Trajectory, codec.PromptTask, codec.Ack, codec.WorkerReport,
                        codec.WeightManifest, codec.Hello, codec.PullWeights,
                        codec.ExportTrajectories, codec.Acked, codec.GenerationRejected,
                        codec.GroupsFiltered, codec.TrajectoryRejected, codec.KvFetch,
                        codec.KvMissing, codec.KvCache]),
       st.dictionaries(st.text(string.ascii_lowercase + "_", max_size=20), json_values,
                       max_size=8))
def test_structurally_plausible_frames(kind, fields):
    body = dict(fields, kind=kind.__struct_config__.tag)
    try:
        frame = codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + msgspec.msgpack.encode(body)
    except (TypeError, OverflowError):
        return
    try:
        msg = codec.decode(frame)
    except ProtocolError:
        return
    assert isinstance(msg, kind)
    assert codec.decode(codec.encode(msg)) == msg


def test_a_manifest_nested_without_end_is_refused_not_a_crash():
    """``WeightManifest.full`` is a manifest: a frame nesting it 50,000 deep must be a
    ProtocolError like any malformed body (msgspec raises RecursionError there)."""

    def text(s: str) -> bytes:
        return bytes([0xA0 | len(s)]) + s.encode()

    fields = b"".join(text(k) + v for k, v in [
        ("kind", text("manifest")), ("version", b"\x01"), ("total_bytes", b"\x01"),
        ("chunk_bytes", b"\x01"), ("tensors", b"\x90"), ("chunks", b"\x90")])
    # Each level is a 7-field map whose last value is the next level.
    body = (bytes([0x87]) + fields + text("full")) * 50_000 + bytes([0x86]) + fields
    with pytest.raises(ProtocolError, match="nested too deeply"):
        codec.decode(codec._HEADER_PREFIX + body, max_bytes=len(body) + 64)
    # One level, as a delta carries it, decodes.
    one = bytes([0x87]) + fields + text("full") + bytes([0x86]) + fields
    msg = codec.decode(codec._HEADER_PREFIX + one)
    assert isinstance(msg, WeightManifest) and msg.full is not None and msg.full.full is None


@SETTINGS
@given(st.fixed_dictionaries({
    "endpoint": st.sampled_from(["tcp://127.0.0.1:5555", "inproc://kv", "http://x", ""]),
    "trajectory_id": st.text(max_size=8), "token": st.text("0123456789abcdef", max_size=70),
    "engine": st.sampled_from(["TorchEngine", ""]),
    "dtype": st.sampled_from(["float32", "bfloat16", "int8", ""]),
    "layers": st.integers(-1, 3), "kv_heads": st.integers(-1, 3),
    "head_dim": st.integers(-1, 4), "num_tokens": st.integers(-1, 4),
    "nbytes": st.integers(-1, 2000), "digest": st.text("0123456789abcdefX", max_size=34)}))
def test_a_kv_ref_in_a_task_is_accepted_only_when_self_consistent(ref):
    """The ref the manager passes on names a cache on another worker: every field is
    checked where the frame lands, and an accepted one describes a cache exactly."""
    task = msgspec.to_builtins(codec.PromptTask(trajectory_id="t", prompt_id="p",
                                                group_size=1, sample_index=0, prompt=""))
    task["kv"] = dict(ref, kind="kvref")
    frame = codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + msgspec.msgpack.encode(task)
    try:
        got = codec.decode(frame).kv
    except ProtocolError:
        return
    assert isinstance(got, codec.KvRef) and got.endpoint.startswith(("tcp://", "inproc://"))
    assert got.nbytes == 2 * got.layers * got.kv_heads * got.num_tokens * got.head_dim * \
        codec.KV_DTYPES[got.dtype] > 0
    assert len(got.digest) == 32 and 16 <= len(got.token) <= 64
