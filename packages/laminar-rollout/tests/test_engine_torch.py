"""TorchEngine: exactness of continuous batching, log-probs, version stamping, migration."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from laminar_rollout.engines import (
    EngineError,
    GenerationRequest,
    SamplingParams,
    TorchEngine,
    make_engine,
)

VOCAB = 48
CONTEXT = 96


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _build(seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        initializer_range=0.3,  # peaky next-token distributions, so greedy has clear winners
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return _build()


@pytest.fixture(scope="module")
def model64() -> Qwen2ForCausalLM:
    return _build(dtype=torch.float64)


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """One sequence at a time, full forward per token, no KV cache."""
    seq = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            tok = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
    return out


def teacher_forced_logprobs(model, prompt, response, temperature) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + response])).logits[0].double()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / t, dim=-1)
    return logp[torch.arange(len(response)), torch.tensor(response)]


def _requests(n: int, seed: int, **params) -> list[GenerationRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        sp = SamplingParams(**{"temperature": 0.0, "max_tokens": rng.randint(1, 24), **params})
        reqs.append(GenerationRequest(f"r{i}", prompt, sp))
    return reqs


def test_continuous_batching_matches_one_at_a_time_greedy(model64):
    engine = TorchEngine(model64, max_batch=4, eos_token_ids=())
    batch_sizes: list[int] = []
    hook = model64.register_forward_pre_hook(
        lambda _m, _a, kw: batch_sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        requests = _requests(13, seed=1)
        for r in requests:
            engine.add_request(r)
        outputs, peak_active, steps = [], 0, 0
        while engine.has_unfinished():
            before = len(batch_sizes)
            outputs.extend(engine.step())
            steps += 1
            assert len(batch_sizes) - before <= 2  # one decode forward + at most one prefill
            peak_active = max(peak_active, engine.load().active)
    finally:
        hook.remove()
    assert peak_active == 4
    assert max(batch_sizes) == 4  # decode really ran the slots together
    assert sorted(o.request_id for o in outputs) == sorted(r.request_id for r in requests)
    by_id = {o.request_id: o for o in outputs}
    for r in requests:
        out = by_id[r.request_id]
        expected = greedy_reference(model64, r.prompt_token_ids, r.params.max_tokens)
        assert out.token_ids == expected, r.request_id
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == r.prompt_token_ids
        assert out.policy_version == 0 and out.simulated is False
    # fewer steps than one-at-a-time decoding would need
    assert steps < sum(r.params.max_tokens for r in requests)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_teacher_forced_forward(model, temperature):
    engine = TorchEngine(model, max_batch=3, eos_token_ids=())
    requests = [
        GenerationRequest(
            r.request_id,
            r.prompt_token_ids,
            SamplingParams(temperature=temperature, max_tokens=r.params.max_tokens + 4, seed=i),
        )
        for i, r in enumerate(_requests(5, seed=2))
    ]
    for out, req in zip(engine.run_until_done(requests), requests):
        assert len(out.logprobs) == len(out.token_ids) == req.params.max_tokens
        ref = teacher_forced_logprobs(model, req.prompt_token_ids, out.token_ids, temperature)
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_a_group_of_one_prompt_is_prefilled_once_and_each_sample_keeps_its_log_probs(model):
    engine = TorchEngine(model, max_batch=8, eos_token_ids=(), seed=5)
    prompt, other = [3, 14, 15, 9, 2, 6], [27, 18]
    group = [GenerationRequest(f"g#{i}", prompt, SamplingParams(temperature=1.0, max_tokens=12))
             for i in range(5)]
    lone = GenerationRequest("o#0", other, SamplingParams(temperature=1.0, max_tokens=12))
    outs = {o.request_id: o for o in engine.run_until_done([*group, lone])}
    assert engine.prefilled_tokens == len(prompt) + len(other)
    assert engine.shared_prefill_tokens == 4 * len(prompt)
    for req in (*group, lone):
        out = outs[req.request_id]
        ref = teacher_forced_logprobs(model, req.prompt_token_ids, out.token_ids, 1.0)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=1e-4)
    # The samples draw on their own (not one sample copied five times).
    assert len({tuple(outs[r.request_id].token_ids) for r in group}) > 1


def test_top_k_one_equals_greedy(model):
    greedy = TorchEngine(model, max_batch=4, eos_token_ids=())
    topk = TorchEngine(model, max_batch=4, eos_token_ids=())
    base = _requests(6, seed=3)
    g = greedy.run_until_done(base)
    k = topk.run_until_done(
        [
            GenerationRequest(
                r.request_id,
                r.prompt_token_ids,
                SamplingParams(temperature=1.3, top_k=1, max_tokens=r.params.max_tokens),
            )
            for r in base
        ]
    )
    assert [o.token_ids for o in g] == [o.token_ids for o in k]


def test_seeded_sampling_is_reproducible_across_batch_compositions(model):
    params = SamplingParams(temperature=1.5, max_tokens=30, seed=1234)
    target = GenerationRequest("target", [3, 1, 4, 1, 5], params)
    alone = TorchEngine(model, max_batch=1, eos_token_ids=()).run_until_done([target])[0]
    crowd = TorchEngine(model, max_batch=4, eos_token_ids=(), seed=99)
    others = _requests(5, seed=4, temperature=1.0)
    mixed = {o.request_id: o for o in crowd.run_until_done([*others, target])}
    assert mixed["target"].token_ids == alone.token_ids
    other_seed = GenerationRequest(
        "other", [3, 1, 4, 1, 5], SamplingParams(temperature=1.5, max_tokens=30, seed=4321)
    )
    differs = TorchEngine(model, max_batch=1, eos_token_ids=()).run_until_done([other_seed])[0]
    assert differs.token_ids != alone.token_ids


def test_unseeded_sampling_follows_engine_seed(model):
    reqs = _requests(3, seed=5, temperature=1.0)
    a = TorchEngine(model, max_batch=3, eos_token_ids=(), seed=7).run_until_done(reqs)
    b = TorchEngine(model, max_batch=3, eos_token_ids=(), seed=7).run_until_done(reqs)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_stop_tokens_end_the_response_and_are_included(model):
    prompt = [5, 6, 7]
    free = greedy_reference(model, prompt, 12)
    stop_at = next(i for i in range(2, 12) if free[i] not in free[:i])
    stop = free[stop_at]
    req = GenerationRequest(
        "s", prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    )
    out = TorchEngine(model, eos_token_ids=()).run_until_done([req])[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: stop_at + 1]
    assert len(out.logprobs) == stop_at + 1
    # the same token as the engine's EOS
    plain = GenerationRequest("e", prompt, SamplingParams(temperature=0, max_tokens=12))
    eos_out = TorchEngine(model, eos_token_ids=[stop]).run_until_done([plain])[0]
    assert eos_out.finish_reason == "stop" and eos_out.token_ids == out.token_ids


def test_max_tokens_and_context_length_cap_the_response(model):
    engine = TorchEngine(model, eos_token_ids=())
    short = GenerationRequest("m", [1, 2], SamplingParams(temperature=0, max_tokens=5))
    near_end = GenerationRequest(
        "c", [i % VOCAB for i in range(CONTEXT - 3)], SamplingParams(temperature=0, max_tokens=50)
    )
    out = {o.request_id: o for o in engine.run_until_done([short, near_end])}
    assert len(out["m"].token_ids) == 5 and out["m"].finish_reason == "length"
    assert len(out["c"].token_ids) == 3 and out["c"].finish_reason == "length"


def test_overlong_prompt_is_refused_with_lengths(model):
    engine = TorchEngine(model, context_length=32)
    with pytest.raises(EngineError) as err:
        engine.add_request(GenerationRequest("too-long", [1] * 32, SamplingParams()))
    msg = str(err.value)
    assert "too-long" in msg and "32 tokens" in msg and "context_length 32" in msg
    engine.add_request(GenerationRequest("fits", [1] * 31, SamplingParams(max_tokens=4)))
    out = engine.run_until_done([])[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_bad_requests_are_refused(model):
    engine = TorchEngine(model)
    engine.add_request(GenerationRequest("dup", [1], SamplingParams(max_tokens=2)))
    with pytest.raises(EngineError, match="already unfinished"):
        engine.add_request(GenerationRequest("dup", [2], SamplingParams()))
    with pytest.raises(EngineError, match=f"token id {VOCAB}.*vocabulary of {VOCAB}"):
        engine.add_request(GenerationRequest("oov", [1, VOCAB], SamplingParams()))
    with pytest.raises(ValueError, match="context_length .* exceeds"):
        TorchEngine(model, context_length=CONTEXT + 1)


def test_load_reports_cached_tokens(model):
    engine = TorchEngine(model, max_batch=2, eos_token_ids=())
    for rid, n in (("a", 5), ("b", 7), ("c", 3)):
        engine.add_request(GenerationRequest(rid, list(range(n)), SamplingParams(max_tokens=10)))
    load = engine.load()
    assert (load.active, load.queued, load.kv_used_tokens) == (0, 3, 0)
    engine.step()  # prefill a and b
    load = engine.load()
    assert (load.active, load.queued, load.kv_used_tokens) == (2, 1, 12)
    assert load.kv_capacity_tokens == 2 * CONTEXT and load.free_slots == 0
    engine.step()  # one decode token each
    assert engine.load().kv_used_tokens == 14
    progress = {p.request_id: p for p in engine.progress()}
    assert len(progress["a"].token_ids) == 2 and progress["c"].token_ids == []
    assert all(p.policy_version == 0 for p in progress.values())


def test_load_weights_is_refused_while_busy_and_versions_increase(model):
    engine = TorchEngine(_build(seed=1), max_batch=2, eos_token_ids=())
    new_weights = {k: v.clone() for k, v in model.state_dict().items()}
    engine.add_request(GenerationRequest("x", [1, 2, 3], SamplingParams(max_tokens=4)))
    engine.step()
    with pytest.raises(EngineError, match="cannot load weights v1 while 1 requests are active"):
        engine.load_weights(1, new_weights.items())
    first = engine.run_until_done([])
    assert first[0].policy_version == 0
    engine.load_weights(1, new_weights.items())
    assert engine.weight_version == 1
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight)
    req = GenerationRequest("y", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6))
    out = engine.run_until_done([req])[0]
    assert out.policy_version == 1
    assert out.token_ids == greedy_reference(model, [1, 2, 3], 6)
    for stale in (1, 0):
        with pytest.raises(EngineError, match="regression"):
            engine.load_weights(stale, new_weights.items())


@pytest.mark.parametrize(
    ("name", "tensor", "match"),
    [
        ("no.such.weight", torch.zeros(1), "'no.such.weight' is not a parameter"),
        ("lm_head.weight", torch.zeros(3, 3), r"'lm_head.weight' has shape \(3, 3\)"),
        ("lm_head.weight", torch.zeros(VOCAB, 64, dtype=torch.int64), "has dtype torch.int64"),
    ],
)
def test_load_weights_rejects_mismatched_tensors(model, name, tensor, match):
    engine = TorchEngine(_build(seed=2))
    with pytest.raises(EngineError, match=match):
        engine.load_weights(1, [(name, tensor)])
    assert engine.weight_version == 0
    with pytest.raises(EngineError, match="last load_weights failed"):
        engine.add_request(GenerationRequest("r", [1], SamplingParams()))
    engine.load_weights(1, model.state_dict().items())
    engine.add_request(GenerationRequest("r", [1], SamplingParams(max_tokens=1)))
    assert engine.run_until_done([])[0].policy_version == 1


def test_exported_request_resumes_on_same_version_engine(model):
    req = GenerationRequest("mig", [9, 8, 7, 6], SamplingParams(temperature=0, max_tokens=20))
    uninterrupted = TorchEngine(model, eos_token_ids=()).run_until_done([req])[0]

    source = TorchEngine(model, max_batch=2, eos_token_ids=())
    source.add_request(req)
    source.add_request(GenerationRequest("other", [2], SamplingParams(max_tokens=50)))
    source.add_request(GenerationRequest("queued", [1], SamplingParams(max_tokens=3)))
    for _ in range(7):
        assert source.step() == []
    exported = {r.request_id: r for r in source.export(["mig", "queued"])}
    assert [p.request_id for p in source.progress()] == ["other"]
    moved = exported["mig"]
    assert moved.policy_version == 0 and len(moved.resume_token_ids) == 7
    assert moved.resume_token_ids == uninterrupted.token_ids[:7]
    assert exported["queued"].resume_token_ids == [] and exported["queued"].policy_version is None

    destination = TorchEngine(model, max_batch=3, eos_token_ids=())
    destination.add_request(GenerationRequest("busy", [4, 4], SamplingParams(max_tokens=9)))
    destination.step()
    resumed = {o.request_id: o for o in destination.run_until_done([moved])}["mig"]
    assert resumed.token_ids == uninterrupted.token_ids
    assert resumed.num_resumed == 7 and resumed.finish_reason == "length"
    assert torch.allclose(
        torch.tensor(resumed.logprobs), torch.tensor(uninterrupted.logprobs), atol=1e-4
    )

    elsewhere = TorchEngine(model, weight_version=1)
    with pytest.raises(EngineError, match="policy v0 but this engine holds v1"):
        elsewhere.add_request(moved)


def test_kv_transfer_resumes_without_prefill_and_matches_uninterrupted(model):
    req = GenerationRequest("mig", [9, 8, 7, 6], SamplingParams(temperature=0, max_tokens=20))
    uninterrupted = TorchEngine(model, eos_token_ids=()).run_until_done([req])[0]

    source = TorchEngine(model, max_batch=2, eos_token_ids=())
    assert source.supports_kv_transfer
    source.add_request(req)
    source.add_request(GenerationRequest("long", [1, 2], SamplingParams(max_tokens=50)))
    source.add_request(GenerationRequest("q2", [1], SamplingParams(max_tokens=3)))
    for _ in range(7):
        source.step()
    exported = {r.request_id: r for r in source.export_with_kv(["mig", "q2"])}
    moved = exported["mig"]
    assert exported["q2"].kv is None  # never admitted: nothing cached
    assert len(moved.resume_token_ids) == 7 and moved.kv is not None
    assert moved.kv.num_tokens == 4 + 7 - 1 and len(moved.kv.keys) == 2
    assert moved.kv.nbytes > 0

    destination = TorchEngine(model, max_batch=3, eos_token_ids=())
    destination.add_request(GenerationRequest("busy", [4, 4, 4], SamplingParams(max_tokens=9)))
    destination.step()
    before = destination.prefilled_tokens
    resumed = {o.request_id: o for o in destination.run_until_done([moved])}["mig"]
    assert destination.prefilled_tokens == before, "the migrated cache was prefilled again"
    assert resumed.token_ids == uninterrupted.token_ids and resumed.num_resumed == 7
    assert torch.allclose(
        torch.tensor(resumed.logprobs), torch.tensor(uninterrupted.logprobs), atol=1e-5
    )
    # The same trajectory resumed by re-prefill pays for prompt + resumed tokens.
    plain = GenerationRequest("mig", moved.prompt_token_ids, moved.params,
                              moved.resume_token_ids, moved.resume_logprobs, 0)
    again = TorchEngine(model, eos_token_ids=())
    assert again.run_until_done([plain])[0].token_ids == uninterrupted.token_ids
    assert again.prefilled_tokens == 4 + 7


def test_kv_that_does_not_fit_is_refused(model, model64):
    source = TorchEngine(model, eos_token_ids=())
    source.add_request(GenerationRequest("a", [3, 4, 5], SamplingParams(max_tokens=8)))
    for _ in range(3):
        source.step()
    moved = source.export_with_kv(["a"])[0]
    fresh = TorchEngine(model64, eos_token_ids=())  # same shapes, float64
    with pytest.raises(EngineError, match=r"kv keys\[0\] is .*float32; this engine caches "
                                          r"\[2, 5, 16\] torch.float64"):
        fresh.add_request(moved)
    assert not fresh.has_unfinished()
    fresh.add_request(GenerationRequest("warm", [1], SamplingParams(max_tokens=2)))
    fresh.run_until_done([])  # with its slot stores allocated: the same refusal
    with pytest.raises(EngineError, match=r"kv keys\[0\] is .*this engine caches"):
        fresh.add_request(moved)
    with pytest.raises(ValueError, match="must cache a prefix of prompt \\+ resumed tokens but the last"):
        GenerationRequest("b", [1, 2], SamplingParams(), [7], [-0.1], 0, kv=moved.kv)


def test_export_unknown_id_exports_nothing(model):
    engine = TorchEngine(model)
    engine.add_request(GenerationRequest("a", [1], SamplingParams(max_tokens=3)))
    with pytest.raises(EngineError, match="'nope'"):
        engine.export(["a", "nope"])
    assert engine.has_unfinished()
    aborted = engine.abort()
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("a", "aborted")]
    assert not engine.has_unfinished()


def test_complete_resumed_request_finishes_without_compute(model):
    engine = TorchEngine(model, eos_token_ids=())
    req = GenerationRequest(
        "done",
        [1, 2],
        SamplingParams(max_tokens=3),
        resume_token_ids=[4, 5, 6],
        resume_logprobs=[-1.0, -2.0, -3.0],
        policy_version=0,
    )
    calls: list[int] = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = engine.run_until_done([req])[0]
    finally:
        hook.remove()
    assert calls == []
    assert out.token_ids == [4, 5, 6] and out.logprobs == [-1.0, -2.0, -3.0]
    assert out.finish_reason == "length" and out.num_resumed == 3


def test_loads_from_a_local_directory(model, tmp_path):
    model.save_pretrained(tmp_path)
    engine = make_engine("torch", model=str(tmp_path), max_batch=2, eos_token_ids=())
    req = GenerationRequest("d", [3, 3, 3], SamplingParams(temperature=0, max_tokens=8))
    assert engine.run_until_done([req])[0].token_ids == greedy_reference(model, [3, 3, 3], 8)
    with pytest.raises(EngineError, match="cannot load a causal LM"):
        TorchEngine(str(tmp_path / "missing"))


def test_weights_in_another_floating_dtype_are_cast_on_load(model):
    """A trainer publishing bfloat16 to a float32 engine (or float32 to a bfloat16 one)."""
    engine = TorchEngine(_build(seed=3), max_batch=2, eos_token_ids=())
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    engine.load_weights(1, bf16.items())
    assert engine.model.lm_head.weight.dtype == torch.float32
    assert torch.equal(engine.model.lm_head.weight, bf16["lm_head.weight"].float())
    low = TorchEngine(_build(seed=3, dtype=torch.bfloat16), max_batch=2, eos_token_ids=())
    low.load_weights(1, model.state_dict().items())
    assert low.model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(low.model.lm_head.weight, bf16["lm_head.weight"])


def test_a_bfloat16_engine_from_a_directory_samples_with_float32_logprobs(model, tmp_path):
    from laminar_rollout.config import TorchEngineConfig
    from laminar_rollout.engines import make_engine_from_config

    model.save_pretrained(tmp_path)
    engine = make_engine_from_config(TorchEngineConfig(model_dir=str(tmp_path), dtype="bfloat16",
                                                       max_batch=2))
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    req = GenerationRequest("b", [3, 3, 3], SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    out = engine.run_until_done([req])[0]
    assert len(out.token_ids) == 6 and all(lp <= 0 for lp in out.logprobs)
    # The behaviour log-probs are those of the bf16 model, computed in float32.
    ids = torch.tensor([[3, 3, 3, *out.token_ids]])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits.float()
    ref = torch.log_softmax(logits[0, 2:-1], dim=-1).gather(
        -1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=0.05)


def test_make_engine_kinds():
    assert make_engine("simulated", max_batch=2).load().max_batch == 2
    with pytest.raises(ValueError, match="unknown engine kind 'tpu'"):
        make_engine("tpu")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(EngineError, match="needs vLLM"):
            make_engine("vllm", model="x")


def test_in_place_slot_cache_matches_the_teacher_forced_forward_to_1e5(model64):
    # Unequal lengths in few slots: sequences finish mid-batch, the last active one
    # moves down into the freed slot (its cache copied), and newcomers prefill into
    # slots above; every token and log-prob must still be what a plain forward over
    # the whole sequence gives (float64, so the bound is the cache's, not rounding's).
    engine = TorchEngine(model64, max_batch=5, eos_token_ids=())
    requests = [
        GenerationRequest(r.request_id, r.prompt_token_ids,
                          SamplingParams(temperature=1.0, max_tokens=r.params.max_tokens, seed=i))
        for i, r in enumerate(_requests(17, seed=5))
    ]
    outputs = engine.run_until_done(requests)
    assert engine.compactions > 0  # the compaction path really ran
    for out, req in zip(outputs, requests):
        assert out.request_id == req.request_id
        assert len(out.token_ids) == req.params.max_tokens
        ref = teacher_forced_logprobs(model64, req.prompt_token_ids, out.token_ids, 1.0)
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (req.request_id,
                                                            (got - ref).abs().max())
    # and greedy decoding through the same path picks exactly the reference tokens
    greedy = [GenerationRequest(f"g{i}", r.prompt_token_ids, r.params)
              for i, r in enumerate(_requests(9, seed=6))]
    engine = TorchEngine(model64, max_batch=3, eos_token_ids=())
    for out, req in zip(engine.run_until_done(greedy), greedy):
        assert out.token_ids == greedy_reference(model64, req.prompt_token_ids,
                                                 req.params.max_tokens)
    assert engine.compactions > 0


def test_a_next_turn_continues_from_its_cache_and_prefills_only_the_new_tokens(model):
    """keep_kv hands the finished sequence's cache back; a request whose cache covers only
    a prefix (the turn so far, not the tool result appended after it) prefills just the
    rest and samples exactly what a full re-prefill samples."""
    params = SamplingParams(max_tokens=6, seed=5)
    first = TorchEngine(model, eos_token_ids=()).run_until_done(
        [GenerationRequest("t", [3, 4, 5], params, keep_kv=True)])[0]
    assert first.kv is not None and first.kv.num_tokens == 3 + 6 - 1
    tool = [11, 12, 13, 14]  # what an environment appends before the next turn
    resume = [*first.token_ids, *tool]
    logprobs = [*first.logprobs, *[0.0] * len(tool)]
    nxt = SamplingParams(max_tokens=len(resume) + 5, seed=9)
    full = TorchEngine(model, eos_token_ids=())
    again = full.run_until_done([GenerationRequest("t", [3, 4, 5], nxt, resume, logprobs, 0)])[0]
    cached = TorchEngine(model, eos_token_ids=())
    reused = cached.run_until_done([GenerationRequest("t", [3, 4, 5], nxt, resume, logprobs, 0,
                                                      kv=first.kv)])[0]
    assert reused.token_ids == again.token_ids
    assert torch.allclose(torch.tensor(reused.logprobs), torch.tensor(again.logprobs),
                          atol=1e-5)
    # Only the stop-less last token of the turn and the tool tokens (but the last) ran.
    assert cached.prefilled_tokens == len(tool) and cached.kv_reused_tokens == 8
    assert full.prefilled_tokens == 3 + len(resume)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_sampled_logprobs_match_a_teacher_forced_forward(dtype):
    # The engine on the GPU (fp32 and bf16 weights), sampling at T=0.8 with slots
    # compacting: each recorded log-prob is the full-vocabulary log-softmax at T of the
    # same weights, teacher forced in float64 on the CPU (bf16: to bf16's precision).
    torch.backends.cuda.matmul.allow_tf32 = False
    weights = _build(dtype=dtype)
    engine = TorchEngine(weights, max_batch=4, eos_token_ids=(), device="cuda", seed=1)
    reqs = [GenerationRequest(f"r{i}", [(5 * i + j) % VOCAB for j in range(2 + i)],
                              SamplingParams(temperature=0.8, max_tokens=6 + 3 * i))
            for i in range(6)]
    outs = {o.request_id: o for o in engine.run_until_done(reqs)}
    ref = weights.to("cpu", torch.float64)
    tol = 1e-4 if dtype == torch.float32 else 1e-1
    for req in reqs:
        out = outs[req.request_id]
        assert len(out.token_ids) == req.params.max_tokens
        want = teacher_forced_logprobs(ref, list(req.prompt_token_ids), list(out.token_ids), 0.8)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=tol)
