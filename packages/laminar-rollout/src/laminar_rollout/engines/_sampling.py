"""Next-token sampling for a batch of rows with per-row parameters (torch engine only).

``sample_next_tokens`` takes one logits row per sequence and returns the chosen
token and its behaviour log-prob, following the definition in ``base``:
``log_softmax(logits / T)`` over the full vocabulary, before top-k / top-p
truncation (``T`` taken as 1 for greedy rows).

Reproducibility: a seeded request draws its ``i``-th response token from a
generator seeded by ``(seed, i)`` alone, so the same logits give the same token
whatever the batch composition and whether or not the trajectory was migrated
midway. Unseeded rows share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import SamplingParams

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def token_seed(seed: int, position: int) -> int:
    """Seed for response position ``position`` of a request seeded with ``seed``."""
    x = (seed ^ ((position + 1) * _GOLDEN)) & ((1 << 64) - 1)
    # splitmix64 finaliser: nearby (seed, position) pairs give unrelated streams
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to ``-inf``) the logits outside each row's top-k and nucleus.

    Args:
        logits: ``[B, V]`` (already temperature-scaled).
        top_k: ``[B]`` int64; ``0`` keeps every token.
        top_p: ``[B]`` float; ``1`` keeps every token. A row keeps the smallest
            set of most-likely tokens whose mass reaches ``top_p`` (at least one).
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Choose one token per row.

    Args:
        logits: ``[B, V]`` next-token logits, one row per sequence.
        params: Sampling parameters per row.
        positions: Response index of the token being sampled, per row (seeds
            per-token generators of seeded requests).
        generator: Generator for unseeded rows, on ``logits.device``.

    Returns:
        The chosen token ids and their behaviour log-probs.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(positions):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [B, V] with B == len(params) "
            f"({len(params)}) == len(positions) ({len(positions)})"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    device = logits.device
    temps = torch.tensor(
        [p.temperature if p.temperature > 0 else 1.0 for p in params],
        dtype=logits.dtype,
        device=device,
    )
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)

    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    tokens = torch.argmax(logits, dim=-1)
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=device)
        sub = scaled[rows]
        if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in sampled_rows):
            top_k = torch.tensor([params[i].top_k for i in sampled_rows], device=device)
            top_p = torch.tensor(
                [params[i].top_p for i in sampled_rows], dtype=sub.dtype, device=device
            )
            sub = apply_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        shared = [j for j, i in enumerate(sampled_rows) if params[i].seed is None]
        if shared:
            picks = torch.multinomial(probs[shared], 1, generator=generator)[:, 0]
            tokens[rows[shared]] = picks
        for j, i in enumerate(sampled_rows):
            seed = params[i].seed
            if seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(token_seed(seed, positions[i]))
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
