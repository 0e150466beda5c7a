"""Batched decoding with a KV cache.

``generate_completions`` decodes greedily or by sampling (recording per-token
log-probs); ``decode_completion`` turns completion ids into the text a reward
scores. Used by the trainer's held-out eval (:mod:`.evaluation`); the examples'
warm starts and ``tools/rl_feasibility.py`` use them too. The stop and pad ids
come from the caller or from the model's own config, never from a particular model.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from .logprobs import model_device

__all__ = ["Completions", "decode_completion", "generate_completions"]


# transformers 5 renamed the forward's ``past_key_values`` argument to ``cache``.
_CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    else "past_key_values"
)


@dataclass
class Completions:
    """Output of ``generate_completions``, one entry per prompt row.

    ``token_ids[i]`` ends with one of the stop ids if the row finished, and
    ``logprobs[i][j]`` is the sampling distribution's log-probability of
    ``token_ids[i][j]`` (at the temperature used; 0.0 everywhere for greedy).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]


def _ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(i) for i in value]


def _stop_ids(model: PreTrainedModel, eos_id: int | Sequence[int] | None) -> list[int]:
    """``eos_id`` as a list, or the model's EOS ids (generation config first) when None."""
    if eos_id is not None:
        ids = _ids(eos_id)
    else:
        generation = getattr(model, "generation_config", None)
        ids = _ids(getattr(generation, "eos_token_id", None)) or _ids(
            getattr(model.config, "eos_token_id", None))
    if not ids:
        raise ValueError("generate_completions needs eos_id: none given and the model's "
                         "config names no eos_token_id")
    return ids


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int | None = None,
) -> Completions:
    """Decode a batch with a KV cache: greedy when ``temperature == 0``, else sampled.

    A row stops at the first of the ``eos_id`` ids (one id or several: a chat
    model's ``<|im_end|>`` and ``<|endoftext|>``), which is kept in its tokens.
    ``eos_id`` defaults to the model's own (``generation_config.eos_token_id``, else
    ``config.eos_token_id``); ``pad_id`` (what left-pads prompts and fills finished
    rows) to ``config.pad_token_id``, else the first stop id.

    Prompts are left-padded; position ids count real tokens only, so the
    result matches ``compute_token_logprobs`` on the right-padded batch.

    Raises:
        ValueError: ``max_new_tokens < 1``, ``temperature < 0``, or no ``eos_id``
            given and none in the model's config.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    eos_ids = _stop_ids(model, eos_id)
    if pad_id is None:
        pad_id = getattr(model.config, "pad_token_id", None)
        pad_id = eos_ids[0] if pad_id is None else int(pad_id)
    was_training = model.training
    model.eval()
    device = model_device(model)
    eos_tensor = torch.tensor(eos_ids, dtype=torch.long, device=device)
    batch = len(prompt_ids)
    input_ids, attention_mask, position_ids = _left_padded(prompt_ids, pad_id, device)
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
    return _cut_at_stops(torch.stack(tokens, 1).tolist(),
                         torch.stack(token_logprobs, 1).tolist(), set(eos_ids))


def _left_padded(prompt_ids: Sequence[Sequence[int]], pad_id: int, device):
    """``(input_ids, attention_mask, position_ids)`` of the left-padded batch; position
    ids count real tokens only."""
    batch, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for row, p in enumerate(prompt_ids):
        input_ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attention_mask[row, width - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _cut_at_stops(token_matrix: list[list[int]], logprob_matrix: list[list[float]],
                  stops: set[int]) -> Completions:
    """Each row up to and including its first stop id (finished), else whole."""
    result = Completions(token_ids=[], logprobs=[], finished=[])
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
