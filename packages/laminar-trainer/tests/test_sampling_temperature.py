"""Log-probs at each trajectory's own temperature, and several EOS ids in decoding."""

from __future__ import annotations

import torch

from laminar_examples.demo_model import EOS_ID, PAD_ID, build_tiny_model, build_tokenizer
from laminar_trainer.decoding import decode_completion, generate_completions
from laminar_trainer.logprobs import compute_token_logprobs, encode_prompts

SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def test_a_temperature_per_row_equals_each_row_at_its_own():
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_tiny_model(len(tok), **SMALL)
    ids = torch.tensor(encode_prompts(tok, ["sort 321=", "sort 213="]))
    attn = torch.ones_like(ids)
    temps = torch.tensor([0.5, 1.3])
    both = compute_token_logprobs(model, ids, attn, temps)
    for row, t in enumerate(temps.tolist()):
        alone = compute_token_logprobs(model, ids[row:row + 1], attn[row:row + 1], t)
        torch.testing.assert_close(both[row], alone[0])
    # And it differs from computing every row at 1.0 (the old behaviour).
    assert not torch.allclose(both, compute_token_logprobs(model, ids, attn, 1.0))


def test_decoding_stops_on_any_of_several_eos_ids():
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_tiny_model(len(tok), **SMALL)
    prompts = encode_prompts(tok, ["sort 321=", "sort 213="])
    free = generate_completions(model, prompts, 6, eos_id=EOS_ID, pad_id=PAD_ID)
    first = free.token_ids[0][0]
    stopped = generate_completions(model, prompts, 6, eos_id=[EOS_ID, first], pad_id=PAD_ID)
    assert stopped.token_ids[0] == [first] and stopped.finished[0]
    assert decode_completion(tok, stopped.token_ids[0], eos_ids=[EOS_ID, first]) == ""
