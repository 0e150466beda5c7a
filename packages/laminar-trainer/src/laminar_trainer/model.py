"""The demo's tiny policy: a character-level tokenizer, a small Llama model, decoding.

This module owns everything needed to produce, offline and in code, a model
directory that the rest of Laminar loads like any Hugging Face checkpoint:

- ``build_tokenizer``: a character-level ``PreTrainedTokenizerFast`` over
  ``laminar_common.launch.tasks.TASK_ALPHABET`` plus ``<pad>``, ``<bos>``, ``<eos>``
  and ``<unk>``. Encoding a text prepends ``<bos>``; there are no merges, so
  ``encode(prompt + answer) == encode(prompt) + chars(answer)``.
- ``build_tiny_model``: a randomly initialised (seeded) ``LlamaForCausalLM``.
  Llama rather than Qwen2 because transformers 5 ignores a checkpoint's own
  tokenizer class for ``model_type: qwen2`` and rebuilds a byte-level Qwen2
  tokenizer, which would re-tokenize our character vocabulary differently.
- ``generate_completions`` / ``evaluate_accuracy``: plain batched decoding
  with a KV cache (greedy or sampled, recording per-token log-probs), used to
  measure accuracy and by ``tools/rl_feasibility.py``.

The supervised warm start that makes a saved model directory from these
lives in ``laminar_trainer.warmstart``. The default model size is the one the
feasibility experiment picked for the demo run; see ``tools/rl_feasibility.py``.

Invariants: everything is deterministic for fixed seeds on one machine and
thread count (CPU matmuls may differ in the last bits across thread counts);
special-token ids are fixed (``PAD_ID=0, BOS_ID=1, EOS_ID=2, UNK_ID=3``) and
the character ids follow ``TASK_ALPHABET`` order.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from laminar_common.launch.tasks import (
    TASK_ALPHABET,
    score_completion,
)

__all__ = [
    "BOS_ID",
    "DEFAULT_MODEL_SIZES",
    "EOS_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "Completions",
    "build_tiny_model",
    "build_tokenizer",
    "compute_token_logprobs",
    "decode_completion",
    "encode_prompts",
    "evaluate_accuracy",
    "generate_completions",
    "model_device",
    "pack_sequences",
]

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))

DEFAULT_MODEL_SIZES: dict[str, int] = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 64,
}
"""Model size used by the demo (about 0.8M parameters)."""

# transformers 5 renamed the forward's ``past_key_values`` argument to ``cache``.
_CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
    else "past_key_values"
)



def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer over ``TASK_ALPHABET`` plus special tokens."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *TASK_ALPHABET])}
    if len(vocab) != len(SPECIAL_TOKENS) + len(TASK_ALPHABET):
        raise ValueError("TASK_ALPHABET repeats a character or clashes with a special token")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=DEFAULT_MODEL_SIZES["max_position_embeddings"],
    )


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = DEFAULT_MODEL_SIZES["hidden_size"],
    num_layers: int = DEFAULT_MODEL_SIZES["num_layers"],
    num_heads: int = DEFAULT_MODEL_SIZES["num_heads"],
    intermediate_size: int = DEFAULT_MODEL_SIZES["intermediate_size"],
    max_position_embeddings: int = DEFAULT_MODEL_SIZES["max_position_embeddings"],
    seed: int = 0,
) -> LlamaForCausalLM:
    """Build a randomly initialised (seeded) float32 Llama causal LM.

    Raises:
        ValueError: ``hidden_size`` is not divisible by ``num_heads``.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        # Untied input/output embeddings: in the feasibility runs the warm start
        # left less probability on non-answer characters than with tied ones.
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    return model


def encode_prompts(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str]) -> list[list[int]]:
    """Tokenize prompts (each starts with ``<bos>``)."""
    return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]


def pack_sequences(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int = PAD_ID,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ``prompt + completion`` rows into one batch.

    Returns:
        ``(input_ids, attention_mask, completion_mask)``, each ``[B, T]``;
        ``completion_mask`` is True at the positions holding completion tokens.

    Raises:
        ValueError: the two lists differ in length or a prompt is empty.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"got {len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (its <bos>)")
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    batch = len(prompt_ids)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    completion_mask = torch.zeros((batch, width), dtype=torch.bool)
    for row, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        n_p, n = len(p), len(p) + len(c)
        input_ids[row, :n] = torch.tensor([*p, *c], dtype=torch.long)
        attention_mask[row, :n] = 1
        completion_mask[row, n_p:n] = True
    return input_ids, attention_mask, completion_mask


def compute_token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probability of each token given its prefix, for right-padded rows.

    ``temperature`` divides the logits first, matching the rollout engines'
    behaviour log-probs at the sampling temperature.

    Returns:
        ``[B, T]``: entry ``t`` is ``log p(input_ids[:, t] | input_ids[:, :t])``;
        column 0 (no prefix) is 0. Align with ``completion_mask`` from
        ``pack_sequences`` to select completion tokens.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked, (1, 0), value=0.0)


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


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s parameters (of the local shard for an FSDP model)."""
    return next(model.parameters()).device


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_id: int = EOS_ID,
    pad_id: int = PAD_ID,
) -> Completions:
    """Decode a batch with a KV cache: greedy when ``temperature == 0``, else sampled.

    Prompts are left-padded; position ids count real tokens only, so the
    result matches ``compute_token_logprobs`` on the right-padded batch.

    Raises:
        ValueError: ``max_new_tokens < 1`` or ``temperature < 0``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    was_training = model.training
    model.eval()
    device = model_device(model)
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
        done = done | (next_token == eos_id)
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
    for row_tokens, row_logprobs in zip(token_matrix, logprob_matrix):
        n = row_tokens.index(eos_id) + 1 if eos_id in row_tokens else len(row_tokens)
        result.token_ids.append(row_tokens[:n])
        result.logprobs.append(row_logprobs[:n])
        result.finished.append(eos_id in row_tokens)
    return result


def decode_completion(tokenizer: PreTrainedTokenizerFast, token_ids: Sequence[int]) -> str:
    """Decode completion ids for scoring: a trailing ``<eos>`` is dropped, other
    special tokens are kept as text (so a stray ``<pad>`` or ``<bos>`` inside an
    answer makes it wrong instead of vanishing)."""
    ids = list(token_ids)
    if ids and ids[-1] == tokenizer.eos_token_id:
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
