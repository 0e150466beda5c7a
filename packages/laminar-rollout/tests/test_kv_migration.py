"""Repack's KV transfer: a migrated trajectory's attention cache on the wire
(``PromptTask.kv``), checked where it lands, and used by the destination worker
instead of a re-prefill (or refused, and re-prefilled, when it does not fit)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from laminar_common import codec
from laminar_common.codec import KvCache, PromptTask, SamplingSpec
from laminar_common.errors import ProtocolError
from laminar_common.membership import InMemoryCoordinator, InMemoryEtcd
from laminar_rollout.config import WorkerConfig
from laminar_rollout.engines import GenerationRequest, SamplingParams, TorchEngine
from laminar_rollout.engines.kv_wire import kv_from_wire, kv_to_wire
from laminar_rollout.tokenizer import ByteTokenizer
from laminar_rollout.worker import FetchedVersion, WorkerService

VOCAB = 300


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _build(dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, initializer_range=0.3,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    return _build()


def _partial(model, prompt, steps, max_tokens=24):
    """Start ``prompt`` greedily on one engine, decode ``steps`` steps, export it with KV."""
    source = TorchEngine(model, max_batch=2, eos_token_ids=())
    source.add_request(GenerationRequest("p0#0", prompt,
                                         SamplingParams(temperature=0, max_tokens=max_tokens)))
    source.add_request(GenerationRequest("other", [5, 6], SamplingParams(max_tokens=40)))
    for _ in range(steps):
        source.step()
    (moved,) = source.export_with_kv(["p0#0"])
    return moved


def _task(moved, kv):
    return PromptTask(trajectory_id="p0#0", prompt_id="p0", group_size=1, sample_index=0,
                      prompt="", prompt_token_ids=tuple(moved.prompt_token_ids),
                      sampling=SamplingSpec(max_tokens=24, temperature=0.0,
                                            stop_token_ids=(299,)),
                      resume_token_ids=tuple(moved.resume_token_ids),
                      resume_logprobs=tuple(moved.resume_logprobs),
                      policy_version=0, kv=kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_crosses_the_wire_bit_for_bit(model, dtype):
    moved = _partial(model.to(dtype), [7, 8, 9, 10], steps=5)
    model.to(torch.float32)
    blob = kv_to_wire(moved.kv)
    assert blob.dtype == str(dtype).removeprefix("torch.") and blob.num_tokens == 4 + 5 - 1
    frame = codec.encode(_task(moved, blob))
    back = kv_from_wire(codec.decode(frame).kv)
    assert back.num_tokens == moved.kv.num_tokens
    for a, b in zip((*moved.kv.keys, *moved.kv.values), (*back.keys, *back.values)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_wrong_cache_bytes_are_refused_where_the_frame_lands(model):
    moved = _partial(model, [7, 8, 9], steps=3)
    blob = kv_to_wire(moved.kv)
    assert codec.decode(codec.encode(_task(moved, None))).kv is None  # no cache: fine
    # Well-formed msgpack, wrong sizes: the decoder refuses the frame, naming the field.
    bad = msgspec_replace(blob, data=blob.data[:-4])
    with pytest.raises(ProtocolError, match=r"kv data holds \d+ bytes; 2 layers x 2 x "
                                            r"\[2, 5, 16\] float32 take \d+.*\$\.kv"):
        codec.decode(_raw_frame(_task(moved, None), kv=bad))
    with pytest.raises(ProtocolError, match="kv dtype 'int8' is not one of"):
        codec.decode(_raw_frame(_task(moved, None), kv=msgspec_replace(blob, dtype="int8")))
    with pytest.raises(ProtocolError, match="kv num_tokens must be >= 1"):
        codec.decode(_raw_frame(_task(moved, None),
                                kv=msgspec_replace(blob, num_tokens=0, data=b"")))


def msgspec_replace(blob: KvCache, **changes) -> dict:
    """The blob as a plain mapping with ``changes`` (so no constructor check runs)."""
    out = {f: getattr(blob, f) for f in blob.__struct_fields__}
    out.update(changes)
    return out


def _raw_frame(task: PromptTask, kv: dict) -> bytes:
    import msgspec

    body = msgspec.to_builtins(task)
    body["kv"] = {"kind": "kv", **kv}
    return codec.encode(task)[:6] + msgspec.msgpack.encode(body)


def _worker(engine) -> WorkerService:
    store = InMemoryEtcd()
    # (the config's engine section is not used: the service is handed the engine)
    cfg = WorkerConfig(job="unit", worker_id="w-dest", engine={"type": "simulated"})
    return WorkerService(cfg, engine, ByteTokenizer(),
                         fetch_weights=lambda v: FetchedVersion(v, None),
                         reward_fn=lambda prompt, text, meta: 1.0,
                         coordinator=InMemoryCoordinator(store, "unit"))


def test_the_destination_worker_continues_from_the_cache_without_a_prefill(model):
    prompt = [11, 12, 13, 14, 15]
    uninterrupted = TorchEngine(model, eos_token_ids=()).run_until_done(
        [GenerationRequest("u", prompt, SamplingParams(temperature=0, max_tokens=24))])[0]
    moved = _partial(model, prompt, steps=9)
    task = codec.decode(codec.encode(_task(moved, kv_to_wire(moved.kv))))

    engine = TorchEngine(model, max_batch=4, eos_token_ids=(299,))
    worker = _worker(engine)
    worker._handle(task)
    (out,) = engine.run_until_done([])
    assert worker.counters["kv_migrated_in"] == 1 and worker.counters["kv_refused"] == 0
    assert engine.prefilled_tokens == 0, "the migrated trajectory was prefilled again"
    assert engine.kv_reused_tokens == len(prompt) + 9 - 1
    assert out.token_ids == uninterrupted.token_ids and out.num_resumed == 9
    assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(uninterrupted.logprobs),
                          atol=1e-5)


def test_a_cache_of_another_model_shape_is_refused_and_the_trajectory_re_prefilled(model):
    prompt = [21, 22, 23]
    moved = _partial(model, prompt, steps=6)
    task = codec.decode(codec.encode(_task(moved, kv_to_wire(moved.kv))))
    other = _build(torch.float64)  # same layers and heads, float64 caches
    engine = TorchEngine(other, max_batch=2, eos_token_ids=(299,))
    worker = _worker(engine)
    worker._handle(task)
    (out,) = engine.run_until_done([])
    assert worker.counters["kv_refused"] == 1 and worker.counters["kv_migrated_in"] == 0
    assert engine.prefilled_tokens == len(prompt) + 6 and engine.kv_reused_tokens == 0
    assert out.token_ids[:6] == list(moved.resume_token_ids) and out.finish_reason == "length"


def test_a_cache_over_the_limit_is_never_copied_and_the_trajectory_still_moves(model):
    source = TorchEngine(model, max_batch=2, eos_token_ids=())
    source.add_request(GenerationRequest("a", [7, 8, 9], SamplingParams(temperature=0,
                                                                        max_tokens=20)))
    source.add_request(GenerationRequest("b", [7, 8], SamplingParams(temperature=0,
                                                                     max_tokens=20)))
    for _ in range(4):
        source.step()
    # 2 layers x keys and values x 2 KV heads x 16 x 4 bytes = 512 bytes a position.
    small, big = source.export_with_kv(["a", "b"], max_bytes=512 * 5)
    assert small.request_id == "a" and small.kv is None  # 6 positions: over the limit
    assert big.request_id == "b" and big.kv is not None and big.kv.num_tokens == 5
    assert big.kv.keys[0].device.type == "cpu"
    assert len(small.resume_token_ids) == 4 and small.policy_version == 0
