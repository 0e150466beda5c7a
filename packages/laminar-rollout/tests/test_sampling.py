"""Engine data types (validation) and the torch sampler (temperature, top-k/p, seeding)."""

from __future__ import annotations

import pytest
import torch

from laminar_rollout.engines import GenerationRequest, SamplingParams
from laminar_rollout.engines._sampling import apply_top_k_top_p, sample_next_tokens, token_seed


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": "ab"}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_normalises_stop_ids_and_flags_greedy():
    params = SamplingParams(temperature=0, stop_token_ids=[3, 4])
    assert params.stop_token_ids == (3, 4)
    assert params.greedy and not SamplingParams().greedy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"request_id": ""}, "request_id"),
        ({"prompt_token_ids": []}, "prompt_token_ids must not be empty"),
        ({"prompt_token_ids": [1, -1]}, r"prompt_token_ids\[1\]"),
        ({"resume_token_ids": [1], "resume_logprobs": []}, "resume_logprobs has 0 entries"),
        ({"resume_token_ids": [1], "resume_logprobs": [-0.5]}, "policy_version is required"),
        ({"policy_version": -3}, "policy_version"),
    ],
)
def test_generation_request_validation(kwargs, match):
    base = {"request_id": "r", "prompt_token_ids": [1, 2]}
    with pytest.raises(ValueError, match=match):
        GenerationRequest(**{**base, **kwargs})


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    top_k = torch.tensor([2, 0, 0])
    top_p = torch.tensor([1.0, 0.7, 0.81])
    kept = torch.isfinite(apply_top_k_top_p(logits, top_k, top_p))
    assert kept.tolist() == [
        [True, True, False, False],  # top-2
        [True, True, False, False],  # 0.5 + 0.3 reaches 0.7
        [True, True, True, False],  # 0.8 < 0.81 needs the third token
    ]
    always_one = apply_top_k_top_p(logits[:1], torch.tensor([0]), torch.tensor([1e-6]))
    assert torch.isfinite(always_one).sum() == 1


def test_logprobs_are_full_vocab_at_the_sampling_temperature():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, top_k=3, seed=1),
        SamplingParams(temperature=2.0, top_p=0.5, seed=2),
    ]
    tokens, logprobs = sample_next_tokens(logits, params, [0, 0, 0], torch.Generator())
    assert tokens[0] == int(logits[0].argmax())
    for i, t in enumerate((1.0, 0.5, 2.0)):
        expected = torch.log_softmax(logits[i] / t, dim=-1)[tokens[i]]
        assert logprobs[i] == pytest.approx(float(expected), abs=1e-6)
    assert tokens[1] in logits[1].topk(3).indices.tolist()


def test_seeded_rows_ignore_batch_position_and_vary_with_position():
    torch.manual_seed(1)
    row = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, seed=77)
    alone, _ = sample_next_tokens(row, [params], [5], torch.Generator())
    batch = torch.cat([torch.randn(2, 50), row])
    others = [SamplingParams(), SamplingParams(seed=3)]
    mixed, _ = sample_next_tokens(batch, [*others, params], [0, 9, 5], torch.Generator())
    assert mixed[2] == alone[0]
    draws = {sample_next_tokens(row, [params], [p], torch.Generator())[0][0] for p in range(40)}
    assert len(draws) > 5
    assert token_seed(77, 0) != token_seed(77, 1) != token_seed(78, 0)


def test_sampling_follows_the_truncated_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4000
    logits = torch.log(probs).expand(n, 4).contiguous()
    gen = torch.Generator()
    gen.manual_seed(0)
    params = [SamplingParams(top_p=0.75)] * n
    tokens, _ = sample_next_tokens(logits, params, [0] * n, gen)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / n
    expected = torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9
    assert torch.allclose(freq, expected.double(), atol=0.03), freq
    assert freq[3] == 0


def test_sample_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must be"):
        sample_next_tokens(torch.zeros(2, 4), [SamplingParams()], [0], torch.Generator())
