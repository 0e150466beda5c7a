"""Held-out accuracy of the demo's model on synthetic task records.

``evaluate_accuracy`` greedy-decodes each record's prompt with the trainer's
``laminar_trainer.decoding.generate_completions`` (stopping on the demo
tokenizer's ``<eos>``) and scores it with :func:`laminar_examples.tasks.score_completion`.
Used by the warm start and ``tools/rl_feasibility.py``; the trainer's own held-out
eval (``laminar_trainer.evaluation``) scores any dataset with the job's reward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from laminar_trainer.decoding import decode_completion, generate_completions
from laminar_trainer.logprobs import encode_prompts

from .demo_model import EOS_ID, PAD_ID
from .tasks import score_completion

__all__ = ["evaluate_accuracy"]


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

    ``max_new_tokens`` defaults to the longest answer plus 4. Decoding stops on the
    demo model's ``EOS_ID`` and pads with its ``PAD_ID``.

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
        completions = generate_completions(model, prompt_ids, budget, eos_id=EOS_ID,
                                           pad_id=PAD_ID)
        for record, ids in zip(chunk, completions.token_ids):
            total += score_completion(record, decode_completion(tokenizer, ids))
    return total / len(records)
