"""VllmEngine where it needs GPUs: tensor parallelism (several workers, NCCL).

Skipped on machines with fewer than two CUDA GPUs; every other vLLM engine test is in
``test_engine_vllm.py`` and runs on vLLM's CPU build.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from laminar_rollout.engines import GenerationRequest, SamplingParams, make_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or not torch.cuda.is_available()
        or torch.cuda.device_count() < 2,
        reason="needs vLLM and at least two CUDA GPUs"),
]


def _model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.3,
                         tie_word_embeddings=False, eos_token_id=None)
    return Qwen2ForCausalLM(config).eval()


def test_tensor_parallel_update_in_place_equals_the_torch_engine(tmp_path):
    _model(0).save_pretrained(tmp_path)
    engine = make_engine("vllm", model=str(tmp_path), max_batch=8, context_length=512,
                         dtype="float32", eos_token_ids=(), tensor_parallel_size=2,
                         kv_cache_tokens=4096, engine_kwargs={"skip_tokenizer_init": True})
    try:
        engine.load_weights(1, _model(1).state_dict().items())
        reqs = [GenerationRequest(f"t{i}", [3 + i, 5, 7], SamplingParams(temperature=0.0,
                                                                         max_tokens=12))
                for i in range(4)]
        reference = make_engine("torch", model=_model(1), eos_token_ids=())
        want = {o.request_id: o.token_ids for o in reference.run_until_done(reqs)}
        assert {o.request_id: o.token_ids for o in engine.run_until_done(reqs)} == want
    finally:
        engine.close()
