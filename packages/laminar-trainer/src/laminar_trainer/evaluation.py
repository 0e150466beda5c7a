"""Held-out evaluation on any dataset: the job's own schema, reward and chat template.

The held-out file is read like the rollout's prompt file
(:func:`laminar_common.data.records.load_records` with ``eval.data``), prompts
become token ids with :func:`laminar_common.data.chat.prompt_token_ids` (the
function the rollout worker uses), decoding stops on the tokenizer's and the
``generation_config.json``'s EOS ids, and completions are scored by the
configured reward (``eval.reward``, the worker's contract
``fn(prompt, completion, metadata)``). Reported:

- ``accuracy``: mean reward of the greedy completion;
- ``pass_at_k`` (when ``eval.samples = k > 0``): the fraction of records for
  which at least one of ``k`` completions sampled at ``eval.temperature``
  scores ``>= eval.pass_threshold``.

A reward that fails on a record scores 0.0 and is counted (``reward_errors``).
Every rank of a sharded model must call :func:`evaluate` alike (same records,
same seed): decoding runs collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from laminar_common.data.chat import eos_token_ids, prompt_token_ids
from laminar_common.data.records import load_records
from laminar_common.data.rewards import load_reward_fn, score

from .config import EvalConfig
from .decoding import decode_completion, generate_completions

__all__ = ["EvalResult", "load_eval_records", "evaluate"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    """Mean reward of greedy completions."""
    pass_at_k: float | None
    """Share of records with a passing completion among ``k`` samples (None: not asked)."""
    k: int
    records: int
    reward_errors: int
    mean_length: float
    """Mean greedy completion length in tokens."""
    truncated: float
    """Share of greedy completions that hit ``max_new_tokens`` without an EOS."""

    def metrics(self, prefix: str = "eval_") -> dict[str, float]:
        out = {f"{prefix}accuracy": self.accuracy, f"{prefix}mean_length": self.mean_length,
               f"{prefix}truncated": self.truncated,
               f"{prefix}reward_errors": float(self.reward_errors)}
        if self.pass_at_k is not None:
            out[f"{prefix}pass_at_{self.k}"] = self.pass_at_k
        return out


def load_eval_records(cfg: EvalConfig) -> list[dict[str, Any]]:
    """The first ``cfg.limit`` held-out records as plain dicts (they travel to other ranks).

    Raises:
        ConfigError: the file is missing or malformed (file, row and field named).
    """
    assert cfg.prompts is not None
    records = load_records(cfg.prompts, cfg.data)[: cfg.limit]
    return [{"id": r.record_id,
             "prompt": r.prompt if isinstance(r.prompt, str) else [dict(m) for m in r.prompt],
             "metadata": r.metadata} for r in records]


def evaluate(model, tokenizer, records: Sequence[Mapping[str, Any]], cfg: EvalConfig,
             model_dir: str | None = None, *, batch_size: int = 128) -> EvalResult:
    """Greedy accuracy (and pass@k) of ``model`` on ``records`` (see module docstring).

    Raises:
        ValueError: ``records`` is empty.
        ConfigError: the reward spec does not resolve, or a chat prompt meets a
            tokenizer without a chat template.
    """
    if not records:
        raise ValueError("evaluation needs at least one record")
    reward_fn = load_reward_fn(cfg.reward)
    eos = eos_token_ids(tokenizer, model_dir) or (tokenizer.eos_token_id,)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    errors = 0

    def scored(record: Mapping[str, Any], ids: Sequence[int]) -> float:
        nonlocal errors
        text = decode_completion(tokenizer, ids, eos_ids=eos)
        value, error = score(reward_fn, record["prompt"], text, record["metadata"])
        if error is not None:
            errors += 1
            if errors <= 3:
                log.warning("eval reward failed on record %r: %s", record.get("id"), error)
        return value

    total, lengths, truncated = 0.0, 0, 0
    passed = 0
    generator = torch.Generator().manual_seed(cfg.seed)
    for start in range(0, len(records), batch_size):
        chunk = list(records[start: start + batch_size])
        prompts = [prompt_token_ids(tokenizer, r["prompt"]) for r in chunk]
        greedy = generate_completions(model, prompts, cfg.max_new_tokens, eos_id=eos,
                                      pad_id=pad)
        for record, ids, finished in zip(chunk, greedy.token_ids, greedy.finished):
            total += scored(record, ids)
            lengths += len(ids)
            truncated += 0 if finished else 1
        if cfg.samples:
            best = [0.0] * len(chunk)
            for _ in range(cfg.samples):
                sampled = generate_completions(model, prompts, cfg.max_new_tokens,
                                               temperature=cfg.temperature,
                                               generator=generator, eos_id=eos, pad_id=pad)
                for i, (record, ids) in enumerate(zip(chunk, sampled.token_ids)):
                    best[i] = max(best[i], scored(record, ids))
            passed += sum(1 for b in best if b >= cfg.pass_threshold)
    n = len(records)
    return EvalResult(accuracy=total / n, pass_at_k=passed / n if cfg.samples else None,
                      k=cfg.samples, records=n, reward_errors=errors, mean_length=lengths / n,
                      truncated=truncated / n)
