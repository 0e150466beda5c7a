"""VllmEngine against TorchEngine on the same tiny weights (GPU + vLLM only)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from laminar_rollout.engines import EngineError, GenerationRequest, SamplingParams, make_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
        reason="needs a CUDA GPU and vLLM",
    ),
]


def _tiny_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    _tiny_model(0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vllm_engine(weights_dir):
    return make_engine(
        "vllm",
        model=str(weights_dir),
        max_batch=8,
        context_length=256,
        dtype="float32",
        eos_token_ids=(),
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        engine_kwargs={"skip_tokenizer_init": True},
    )


def _requests(n: int, **params) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"g{i}", [(7 * i + j) % 256 for j in range(3 + i)], SamplingParams(**params)
        )
        for i in range(n)
    ]


def test_greedy_tokens_and_logprobs_match_torch_engine(vllm_engine, weights_dir):
    reference = make_engine("torch", model=str(weights_dir), max_batch=8, eos_token_ids=())
    reqs = _requests(6, temperature=0.0, max_tokens=12)
    want = {o.request_id: o for o in reference.run_until_done(reqs)}
    got = {o.request_id: o for o in vllm_engine.run_until_done(reqs)}
    for rid, out in got.items():
        assert out.token_ids == want[rid].token_ids
        assert out.finish_reason == "length" and out.policy_version == vllm_engine.weight_version
        assert torch.allclose(
            torch.tensor(out.logprobs), torch.tensor(want[rid].logprobs), atol=2e-3
        )


def test_weights_update_in_place_and_versions_are_guarded(vllm_engine):
    new_model = _tiny_model(1)
    version = vllm_engine.weight_version
    vllm_engine.add_request(_requests(1, max_tokens=50)[0])
    vllm_engine.step()
    with pytest.raises(EngineError, match="cannot load weights"):
        vllm_engine.load_weights(version + 1, new_model.state_dict().items())
    (moved,) = vllm_engine.export()
    assert moved.policy_version == version
    vllm_engine.load_weights(version + 1, new_model.state_dict().items())
    with pytest.raises(EngineError, match=f"policy v{version} but this engine holds"):
        vllm_engine.add_request(moved)
    reference = make_engine("torch", model=new_model, eos_token_ids=())
    req = _requests(1, temperature=0.0, max_tokens=10)[0]
    assert (
        vllm_engine.run_until_done([req])[0].token_ids
        == reference.run_until_done([req])[0].token_ids
    )


def test_sampled_logprobs_are_full_vocabulary_at_the_temperature(vllm_engine):
    # Teacher-force what vLLM sampled at T=0.7 through the same weights: every recorded
    # log-prob is log_softmax(logits / T) over the whole vocabulary (no renormalising).
    # Version v of this module's engine holds _tiny_model(v)'s weights (v0 from the
    # directory, v1 loaded by the weight-update test).
    assert vllm_engine.weight_version in (0, 1)
    model = _tiny_model(vllm_engine.weight_version)
    req = _requests(1, temperature=0.7, max_tokens=16, seed=3)[0]
    out = vllm_engine.run_until_done([req])[0]
    ids = torch.tensor([list(req.prompt_token_ids) + list(out.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(req.prompt_token_ids) - 1:-1].double() / 0.7
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=2e-3)


def test_truncated_sampling_is_refused_with_the_reason(vllm_engine):
    with pytest.raises(EngineError, match="renormalised over the kept tokens"):
        vllm_engine.add_request(_requests(1, temperature=1.0, top_p=0.9)[0])
    assert not vllm_engine.has_unfinished()


def test_weights_load_in_buckets_and_kv_use_comes_from_vllm_stats(vllm_engine):
    # The module's one engine (vLLM's stats registry is process-wide), in 64 KiB buckets.
    engine = vllm_engine
    reqs = _requests(3, max_tokens=40)
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    load = engine.load()
    assert load.active == 3 and 0 < load.kv_used_tokens < load.kv_capacity_tokens
    engine.abort()
    version = engine.weight_version
    engine._bucket_bytes = 64 << 10  # many buckets for this tiny model
    try:
        engine.load_weights(version + 1, _tiny_model(version + 1).state_dict().items())
    finally:
        engine._bucket_bytes = 512 << 20
    assert engine.weight_version == version + 1
    req = _requests(1, temperature=0.0, max_tokens=8)[0]
    reference = make_engine("torch", model=_tiny_model(version + 1), eos_token_ids=())
    assert engine.run_until_done([req])[0].token_ids == reference.run_until_done([req])[0].token_ids
