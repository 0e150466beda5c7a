"""Supervised warm start of the math example's chat policy (``laminar-examples warmstart-chat``).

``warm_start_chat`` trains a BPE tokenizer on the train split's chat turns,
builds the Qwen2-shaped model (``laminar_examples.chat_model``), teacher-forces
``prompt + worked answer + <|im_end|>`` with the loss on the answer only, and
saves the directory. Prompt ids come from
``laminar_common.data.chat.prompt_token_ids``, the function the rollout worker
and the trainer's eval use, so the warm start sees exactly the ids RL samples
from.

Noisy demonstrations (``demo_error_rate``): that share of the worked answers is
replaced by the problem's plausible mistake (the wrong operation on one-step
problems, stopping one step short on two-step ones). Above 0.5 the greedy
policy mostly makes the mistake while sampling at temperature 1 still often
solves the problem: the gap RL with the ``math`` reward closes.

Invariants: deterministic for fixed seeds on one machine and thread count;
nothing here touches the network.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from laminar_common.data.chat import prompt_token_ids, render_chat
from laminar_common.data.rewards import score_exact_answer
from laminar_common.progress import ProgressLines
from laminar_trainer.decoding import generate_completions
from laminar_trainer.logprobs import pack_sequences

from .chat_model import (
    CHAT_MODEL_SIZES,
    DEFAULT_VOCAB_SIZE,
    build_chat_model,
    build_chat_tokenizer,
    save_chat_model,
)
from .math_tasks import MathProblem, make_math_problems, math_messages
from .warmstart import supervised_update

__all__ = [
    "ChatExample",
    "ChatWarmStartResult",
    "chat_examples",
    "math_accuracy",
    "train_chat_supervised",
    "warm_start_chat",
]

logger = logging.getLogger(__name__)

DEFAULT_CHAT_STEPS = 300
DEFAULT_CHAT_LR = 3e-3
DEFAULT_CHAT_BATCH = 64
DEFAULT_DEMO_ERROR_RATE = 0.0
MAX_ANSWER_TOKENS = 24


@dataclass(frozen=True)
class ChatExample:
    """A demonstration: chat messages, the assistant's answer, and the right number."""

    messages: tuple[Mapping[str, str], ...]
    answer: str
    ground_truth: str


def chat_examples(problems: Sequence[MathProblem], demo_error_rate: float = 0.0,
                  seed: int = 0) -> list[ChatExample]:
    """Demonstrations of ``problems``; a ``demo_error_rate`` share answers with the mistake.

    Raises:
        ValueError: ``demo_error_rate`` outside [0, 1).
    """
    if not 0.0 <= demo_error_rate < 1.0:
        raise ValueError(f"demo_error_rate must be in [0, 1), got {demo_error_rate}")
    rng = random.Random(f"math-demo-errors/{seed}")
    return [
        ChatExample(tuple(math_messages(p.question)),
                    p.mistake if rng.random() < demo_error_rate else p.answer,
                    p.ground_truth)
        for p in problems
    ]


def _eos_id(tokenizer: PreTrainedTokenizerFast) -> int:
    return int(tokenizer.eos_token_id)


def _stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> tuple[int, ...]:
    # What the rollout worker and the trainer's eval stop on: the tokenizer's eos
    # and every eos id of the generation config (<|im_end|> and <|endoftext|>).
    listed = getattr(model.generation_config, "eos_token_id", None)
    listed = listed if isinstance(listed, list) else [] if listed is None else [listed]
    return tuple(dict.fromkeys([_eos_id(tokenizer), *map(int, listed)]))


def _lr_scale(step: int, steps: int, warmup_steps: int) -> float:
    # Linear warmup, then cosine decay to a tenth: with a few hundred steps the
    # decay, not more steps, is what settles the arithmetic.
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_chat_supervised(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[ChatExample],
    steps: int,
    *,
    batch_size: int = DEFAULT_CHAT_BATCH,
    lr: float = DEFAULT_CHAT_LR,
    warmup_steps: int = 20,
    progress: Callable[..., object] | None = None,
) -> list[float]:
    """Teacher-force ``prompt_token_ids(messages) + answer + <eos>``; loss on answer and eos.

    Like ``warmstart.train_supervised`` (AdamW, batches walking ``examples``
    in order), but for chat prompts and the tokenizer's own eos and pad ids,
    and with a linear warmup then a cosine decay of ``lr`` to a tenth.

    Returns:
        The loss of every step.

    Raises:
        ValueError: ``steps < 0`` or no examples.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not examples:
        raise ValueError("train_chat_supervised needs at least one example")
    eos = _eos_id(tokenizer)
    encoded = [
        (prompt_token_ids(tokenizer, list(e.messages)),
         [*tokenizer(e.answer, add_special_tokens=False)["input_ids"], eos])
        for e in examples[: max(1, steps * batch_size)]
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_scale(step, steps, warmup_steps))
    model.train()
    losses = []
    for step in range(steps):
        start = (step * batch_size) % len(encoded)
        chunk = [encoded[(start + i) % len(encoded)] for i in range(batch_size)]
        input_ids, attention_mask, target_mask = pack_sequences(
            [p for p, _ in chunk], [a for _, a in chunk], pad_id=int(tokenizer.pad_token_id))
        losses.append(supervised_update(model, optimizer, scheduler, input_ids, attention_mask,
                                        target_mask))
        if progress is not None:
            progress(step + 1, loss=losses[-1])
    return losses


def math_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    problems: Sequence[MathProblem],
    *,
    temperature: float = 0.0,
    samples: int = 1,
    max_new_tokens: int = MAX_ANSWER_TOKENS,
    seed: int = 0,
    batch_size: int = 256,
) -> tuple[float, float]:
    """Mean reward and pass@``samples`` of decoded completions (``####`` number exact).

    Greedy when ``temperature == 0`` (then ``samples`` should be 1).

    Returns:
        ``(mean score over all samples, fraction of problems solved at least once)``.

    Raises:
        ValueError: no problems or ``samples < 1``.
    """
    if not problems:
        raise ValueError("math_accuracy needs at least one problem")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    generator = torch.Generator().manual_seed(seed)
    total, solved = 0.0, 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompt_ids = [prompt_token_ids(tokenizer, math_messages(p.question)) for p in chunk]
        hits = [0] * len(chunk)
        for _ in range(samples):
            out = generate_completions(
                model, prompt_ids, max_new_tokens, temperature=temperature,
                generator=generator, eos_id=_stop_ids(model, tokenizer),
                pad_id=int(tokenizer.pad_token_id))
            for i, (problem, ids) in enumerate(zip(chunk, out.token_ids)):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                score = score_exact_answer(problem.ground_truth, text)
                total += score
                hits[i] += score > 0
        solved += sum(h > 0 for h in hits)
    return total / (len(problems) * samples), solved / len(problems)


@dataclass
class ChatWarmStartResult:
    """What ``warm_start_chat`` produced (also saved to ``out_dir``) and its held-out accuracy."""

    out_dir: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    accuracy: float
    final_loss: float
    steps: int
    seconds: float


def warm_start_chat(
    out_dir: str | Path,
    steps: int = DEFAULT_CHAT_STEPS,
    seed: int = 0,
    *,
    difficulty: Mapping[str, int] | None = None,
    model_sizes: Mapping[str, int] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    batch_size: int = DEFAULT_CHAT_BATCH,
    lr: float = DEFAULT_CHAT_LR,
    demo_error_rate: float = DEFAULT_DEMO_ERROR_RATE,
    n_eval: int = 128,
) -> ChatWarmStartResult:
    """Build tokenizer and model, warm-start them on math demonstrations, evaluate, save.

    Demonstrations are ``steps * batch_size`` distinct train-split problems
    (seed ``seed``); the tokenizer is trained on their rendered chat turns
    (right and mistaken answers). ``accuracy`` is greedy on ``n_eval``
    eval-split problems. ``out_dir`` ends up holding the ``save_pretrained``
    files and ``warm_start.json`` (settings, accuracy, seconds).

    Raises:
        ValueError: unknown model size fields, a bad difficulty or
            ``demo_error_rate``.
    """
    started = time.perf_counter()
    difficulty = dict(difficulty or {})
    sizes = {**CHAT_MODEL_SIZES, **(model_sizes or {})}
    unknown = sorted(set(sizes) - set(CHAT_MODEL_SIZES))
    if unknown:
        raise ValueError(f"unknown model size field(s) {unknown}; "
                         f"expected {sorted(CHAT_MODEL_SIZES)}")
    problems = make_math_problems(max(1, steps * batch_size), seed, "train", **difficulty)
    examples = chat_examples(problems, demo_error_rate, seed)
    eval_problems = make_math_problems(n_eval, seed, "eval", **difficulty)
    corpus = [
        f"<|im_start|>user\n{math_messages(p.question)[0]['content']}<|im_end|>\n"
        f"<|im_start|>assistant\n{p.answer}<|im_end|>\n{p.mistake}"
        for p in problems
    ]
    tokenizer = build_chat_tokenizer(corpus, vocab_size)
    tokenizer.model_max_length = sizes["max_position_embeddings"]
    longest = max(len(prompt_token_ids(tokenizer, list(e.messages))) for e in examples[:256])
    if longest + MAX_ANSWER_TOKENS > sizes["max_position_embeddings"]:
        raise ValueError(f"max_position_embeddings={sizes['max_position_embeddings']} is too "
                         f"short for prompts of {longest} tokens plus the answer")
    assert render_chat(tokenizer, examples[0].messages).endswith("<|im_start|>assistant\n")
    model = build_chat_model(len(tokenizer), seed=seed, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        losses = train_chat_supervised(model, tokenizer, examples, steps,
                                       batch_size=batch_size, lr=lr,
                                       progress=ProgressLines("warm start", steps).update)
    model.eval()
    accuracy, _ = math_accuracy(model, tokenizer, eval_problems, seed=seed)
    out = save_chat_model(out_dir, model, tokenizer)
    seconds = time.perf_counter() - started
    final_loss = losses[-1] if losses else float("nan")
    summary = {
        "task": "arith_gsm8k",
        "difficulty": difficulty,
        "model_sizes": sizes,
        "vocab_size": len(tokenizer),
        "steps": len(losses),
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "demo_error_rate": demo_error_rate,
        "eval_accuracy": accuracy,
        "n_eval": n_eval,
        "final_loss": final_loss,
        "seconds": seconds,
    }
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("warm start math: %d steps, loss %.3f, held-out greedy accuracy %.3f, %.1fs",
                len(losses), final_loss, accuracy, seconds)
    return ChatWarmStartResult(out, model, tokenizer, accuracy, final_loss, len(losses), seconds)
