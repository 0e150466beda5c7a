"""Per-token log-probs of a causal LM on packed ``prompt + completion`` rows.

Generic over any Hugging Face causal LM (nothing here knows the demo model):
tokenizing prompts, right-padding rows into one batch with a completion mask,
and the log-prob of each completion token at a temperature. The loss and the
trainer's step use it; decoding for evaluation is in ``laminar_trainer.decoding``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # annotations only: importing transformers costs seconds a start
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["compute_token_logprobs", "compute_token_logprobs_and_entropy", "encode_prompts",
           "model_device", "pack_sequences"]


def encode_prompts(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str]) -> list[list[int]]:
    """Tokenize prompts (each starts with ``<bos>``)."""
    return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]


def pack_sequences(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int = 0,
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
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Log-probability of each token given its prefix, for right-padded rows.

    ``temperature`` divides the logits first, matching the rollout engines'
    behaviour log-probs at the sampling temperature: one float for every row, or
    a ``[B]`` tensor (each trajectory's own temperature).

    Returns:
        ``[B, T]``: entry ``t`` is ``log p(input_ids[:, t] | input_ids[:, :t])``;
        column 0 (no prefix) is 0. Align with ``completion_mask`` from
        ``pack_sequences`` to select completion tokens.
    """
    return _logprobs(model, input_ids, attention_mask, temperature, entropy=False)[0]


def compute_token_logprobs_and_entropy(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_token_logprobs` and the entropy of each position's next-token
    distribution at the same temperature (``[B, T]`` each, aligned alike: entry ``t``
    is the entropy of the distribution token ``t`` was drawn from; column 0 is 0).

    ``entropy_grad=False`` computes the entropy without a graph (a metric only).
    """
    return _logprobs(model, input_ids, attention_mask, temperature, entropy=True,
                     entropy_grad=entropy_grad)


def _logprobs(model, input_ids, attention_mask, temperature, *, entropy: bool,
              entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(logits.device, torch.float32).view(-1, 1, 1)
    logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = F.pad(-(logprobs.exp() * logprobs).sum(-1), (1, 0), value=0.0)
    return F.pad(picked, (1, 0), value=0.0), ent


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s parameters (of the local shard for an FSDP model)."""
    return next(model.parameters()).device
