"""Batched decoding with a KV cache, and held-out accuracy on task records.

``generate_completions`` decodes greedily or by sampling (recording per-token
log-probs); ``evaluate_accuracy`` scores greedy completions of task records
(``laminar_common.launch.tasks.score_completion``). Used by the trainer's
held-out eval, the warm start and ``tools/rl_feasibility.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from laminar_common.launch.tasks import score_completion

from .demo_model import EOS_ID, PAD_ID
from .logprobs import encode_prompts, model_device

__all__ = ["Completions", "decode_completion", "evaluate_accuracy", "generate_completions"]


# transformers 5 renamed the forward's ``past_key_values`` argument to ``cache``.
_CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    else "past_key_values"
)


@dataclass
class Completions:
    """Output of ``generate_completions``, one entry per prompt row.

    ``token_ids[i]`` ends with ``EOS_ID`` if the row finished, and
    ``logprobs[i][j]`` is the sampling distribution's log-probability of
    ``token_ids[i][j]`` (at the temperature used; 0.0 everywhere for greedy).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_id: int | Sequence[int] = EOS_ID,
    pad_id: int = PAD_ID,
) -> Completions:
    """Decode a batch with a KV cache: greedy when ``temperature == 0``, else sampled.

    A row stops at the first of the ``eos_id`` ids (one id or several: a chat
    model's ``<|im_end|>`` and ``<|endoftext|>``), which is kept in its tokens.

    Prompts are left-padded; position ids count real tokens only, so the
    result matches ``compute_token_logprobs`` on the right-padded batch.

    Raises:
        ValueError: ``max_new_tokens < 1`` or ``temperature < 0``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    eos_ids = [eos_id] if isinstance(eos_id, int) else [int(i) for i in eos_id]
    was_training = model.training
    model.eval()
    device = model_device(model)
    eos_tensor = torch.tensor(eos_ids, dtype=torch.long, device=device)
    batch = len(prompt_ids)
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for row, p in enumerate(prompt_ids):
        input_ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attention_mask[row, width - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    past = None
    step_input, step_positions = input_ids, position_ids
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens, token_logprobs = [], []
    for _ in range(max_new_tokens):
        out = model(
            input_ids=step_input,
            attention_mask=attention_mask,
            position_ids=step_positions,
            use_cache=True,
            **{_CACHE_KWARG: past},
        )
        past = out.get(_CACHE_KWARG)
        logits = out.logits[:, -1].float()
        if temperature == 0.0:
            next_token = logits.argmax(-1)
            next_logprob = torch.zeros(batch, device=device)
        else:
            logprobs = torch.log_softmax(logits / temperature, dim=-1)
            next_token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
            next_logprob = logprobs.gather(-1, next_token.unsqueeze(-1)).squeeze(-1)
        next_token = torch.where(done, torch.full_like(next_token, pad_id), next_token)
        tokens.append(next_token)
        token_logprobs.append(next_logprob)
        done = done | torch.isin(next_token, eos_tensor)
        if bool(done.all()):
            break
        step_input = next_token.unsqueeze(-1)
        step_positions = step_positions[:, -1:] + 1
        attention_mask = torch.cat(
            [attention_mask, torch.ones((batch, 1), dtype=torch.long, device=device)], 1
        )
    model.train(was_training)
    token_matrix = torch.stack(tokens, 1).tolist()
    logprob_matrix = torch.stack(token_logprobs, 1).tolist()
    result = Completions(token_ids=[], logprobs=[], finished=[])
    stops = set(eos_ids)
    for row_tokens, row_logprobs in zip(token_matrix, logprob_matrix):
        n = next((i + 1 for i, tok in enumerate(row_tokens) if tok in stops), len(row_tokens))
        result.token_ids.append(row_tokens[:n])
        result.logprobs.append(row_logprobs[:n])
        result.finished.append(n <= len(row_tokens) and row_tokens[n - 1] in stops)
    return result


def decode_completion(tokenizer: PreTrainedTokenizerFast, token_ids: Sequence[int],
                      eos_ids: Sequence[int] | None = None) -> str:
    """Decode completion ids for scoring: a trailing EOS (the tokenizer's, or any of
    ``eos_ids``) is dropped, other special tokens are kept as text (so a stray
    ``<pad>`` or ``<bos>`` inside an answer makes it wrong instead of vanishing)."""
    ids = list(token_ids)
    stops = set(eos_ids) if eos_ids is not None else {tokenizer.eos_token_id}
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def _answer_budget(records: Sequence[Mapping[str, Any]]) -> int:
    # Room for the longest answer, <eos>, and a few extra tokens so that a
    # model which never stops is not cut off exactly at a right answer.
    return max(len(r["answer"]) for r in records) + 4


def evaluate_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    records: Sequence[Mapping[str, Any]],
    max_new_tokens: int | None = None,
    *,
    batch_size: int = 256,
) -> float:
    """Greedy-decode each record's prompt and return the mean ``score_completion``.

    ``max_new_tokens`` defaults to the longest answer plus 4.

    Raises:
        ValueError: ``records`` is empty.
    """
    if not records:
        raise ValueError("evaluate_accuracy needs at least one record")
    budget = max_new_tokens or _answer_budget(records)
    total = 0.0
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in chunk])
        completions = generate_completions(model, prompt_ids, budget)
        for record, ids in zip(chunk, completions.token_ids):
            total += score_completion(record, decode_completion(tokenizer, ids))
    return total / len(records)
