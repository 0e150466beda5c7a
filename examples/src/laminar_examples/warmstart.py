"""The supervised warm start of the demo's tiny policy (``laminar-examples warmstart``).

``warm_start`` runs a short supervised phase (teacher forcing on
``prompt + answer + <eos>``, loss on the answer and ``<eos>`` only) that leaves
greedy held-out accuracy in the range where RL has signal, optionally on
noisy demonstrations (``demo_error_rate``: a share of answers replaced by the
task's plausible mistake) or until a dev accuracy is reached, then
``save_pretrained`` of model and tokenizer so that
``AutoModelForCausalLM.from_pretrained(out_dir)`` and
``AutoTokenizer.from_pretrained(out_dir)`` load it with no network.

The defaults (task, warm-start steps, demonstration noise) are the ones the
feasibility experiment picked for the demo run; see ``tools/rl_feasibility.py``.

Invariants: deterministic for fixed seeds on one machine and thread count;
nothing here touches the network.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from laminar_common.progress import ProgressLines
from laminar_trainer.logprobs import compute_token_logprobs, encode_prompts, pack_sequences

from .accuracy import evaluate_accuracy
from .demo_model import DEFAULT_MODEL_SIZES, EOS_ID, build_tiny_model, build_tokenizer
from .tasks import make_task_records, plausible_mistake

__all__ = [
    "DEFAULT_WARM_START_STEPS",
    "WarmStartResult",
    "train_supervised",
    "warm_start",
]

logger = logging.getLogger(__name__)

DEFAULT_TASK = "sort"
DEFAULT_WARM_START_STEPS = 150
DEFAULT_WARM_START_LR = 1e-3
DEFAULT_WARM_START_BATCH = 64
DEFAULT_CHECK_EVERY = 5


def supervised_update(model: PreTrainedModel, optimizer, scheduler, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, target_mask: torch.Tensor) -> float:
    """One teacher-forced update: mean NLL over ``target_mask`` tokens, grad-norm clip 1.0,
    optimizer and schedule step; returns the loss."""
    logprobs = compute_token_logprobs(model, input_ids, attention_mask)
    loss = -(logprobs * target_mask).sum() / target_mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    return loss.item()


def train_supervised(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    records: Sequence[Mapping[str, Any]],
    steps: int,
    *,
    batch_size: int = DEFAULT_WARM_START_BATCH,
    lr: float = DEFAULT_WARM_START_LR,
    warmup_steps: int = 20,
    should_stop: Callable[[int], bool] | None = None,
    check_every: int = DEFAULT_CHECK_EVERY,
    progress: Callable[..., object] | None = None,
) -> list[float]:
    """Teacher-force ``prompt + answer + <eos>``; the loss covers answer and ``<eos>`` only.

    ``progress(done, loss=...)``, if given, is called after every step (e.g.
    :meth:`laminar_common.progress.ProgressLines.update`).

    ``should_stop(step)``, if given, is called after every ``check_every``-th
    step (``step`` counts completed steps) and ends training when it returns
    True; the model is put back in train mode after each call.

    Batches walk through ``records`` in order (wrapping around); AdamW with a
    linear warmup, then constant ``lr`` (so a run of k steps is a prefix of a
    longer one, and accuracy grows with ``steps`` alone).

    Returns:
        The loss of every step.

    Raises:
        ValueError: ``steps < 0``, ``check_every < 1`` or no records.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    if not records:
        raise ValueError("train_supervised needs at least one record")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps))
    )
    model.train()
    losses = []
    for step in range(steps):
        start = (step * batch_size) % len(records)
        chunk = [records[(start + i) % len(records)] for i in range(batch_size)]
        prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in chunk])
        answer_ids = [
            [*tokenizer(r["answer"], add_special_tokens=False)["input_ids"], EOS_ID] for r in chunk
        ]
        input_ids, attention_mask, target_mask = pack_sequences(prompt_ids, answer_ids)
        losses.append(supervised_update(model, optimizer, scheduler, input_ids, attention_mask,
                                        target_mask))
        done = step + 1
        if progress is not None:
            progress(done, loss=losses[-1])
        if should_stop is not None and done % check_every == 0:
            stop = should_stop(done)
            model.train()
            if stop:
                break
    return losses


@dataclass
class WarmStartResult:
    """What ``warm_start`` produced: the model (also saved to ``out_dir``) and its accuracy."""

    out_dir: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    accuracy: float
    dev_accuracy: float | None
    final_loss: float
    steps: int
    seconds: float


def _save(out_dir: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # transformers>=5 writes its own class name; the portable name loads with 4.x too.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _with_mistakes(
    records: Sequence[Mapping[str, str]], rate: float, seed: int
) -> list[dict[str, str]]:
    """Copies of ``records`` where a ``rate`` fraction answer with the task's plausible mistake."""
    rng = random.Random(f"demo-errors/{seed}")
    return [
        {**record, "answer": plausible_mistake(record)} if rng.random() < rate else dict(record)
        for record in records
    ]


def warm_start(
    out_dir: str | Path,
    task: str = DEFAULT_TASK,
    steps: int = DEFAULT_WARM_START_STEPS,
    seed: int = 0,
    *,
    difficulty: Mapping[str, int] | None = None,
    model_sizes: Mapping[str, int] | None = None,
    batch_size: int = DEFAULT_WARM_START_BATCH,
    lr: float = DEFAULT_WARM_START_LR,
    target_accuracy: float | None = None,
    check_every: int = DEFAULT_CHECK_EVERY,
    n_dev: int = 128,
    n_eval: int = 256,
    demo_error_rate: float = 0.0,
) -> WarmStartResult:
    """Build the tiny model, train it on ``task`` until it is partly right, evaluate, save.

    Training records come from the task's train split (seed ``seed``). With
    ``target_accuracy`` set, training stops at the first check (every
    ``check_every`` steps) where greedy accuracy on ``n_dev`` unseen
    train-split prompts (another seed) reaches it, or after ``steps``. The
    reported ``accuracy`` is measured on ``n_eval`` records of the eval split,
    which the stopping rule never sees. ``out_dir`` ends up holding
    ``config.json``, ``model.safetensors``, the tokenizer files and
    ``warm_start.json`` (the settings and accuracies of this run).

    Args:
        out_dir: directory to write (created if missing).
        task: a ``laminar_examples.tasks.TASKS`` key.
        steps: supervised steps, or the most of them with ``target_accuracy``
            (0 saves the random init).
        seed: seeds the model init, the training data and the eval data.
        difficulty: overrides of the task's default difficulty.
        model_sizes: overrides of ``DEFAULT_MODEL_SIZES``.
        target_accuracy: dev accuracy at which to stop; None trains ``steps``.
            Why a target can beat a step count: on ``sort`` the model first
            learns lists without repeated digits and only later, at a
            seed-dependent step, gets repeated digits right; RL amplifies that
            skill once it has emerged but rarely discovers it from an
            exact-match reward alone (``tools/rl_feasibility.py``).
        n_eval: number of held-out records to measure greedy accuracy on.
        demo_error_rate: fraction of the training demonstrations whose answer
            is replaced by the task's plausible mistake
            (``laminar_examples.tasks.plausible_mistake``), drawn with a fixed
            RNG. Above 0.5 the greedy policy mostly makes that mistake while
            sampling still finds the right answer, which is the situation RL
            with a verifiable reward corrects (the demo's setting).

    Raises:
        ValueError: unknown model size fields, a target outside (0, 1], or a
            ``demo_error_rate`` outside [0, 1).
    """
    started = time.perf_counter()
    difficulty = dict(difficulty or {})
    sizes = {**DEFAULT_MODEL_SIZES, **(model_sizes or {})}
    unknown = sorted(set(sizes) - set(DEFAULT_MODEL_SIZES))
    if unknown:
        raise ValueError(
            f"unknown model size field(s) {unknown}; expected {sorted(DEFAULT_MODEL_SIZES)}"
        )
    if target_accuracy is not None and not 0.0 < target_accuracy <= 1.0:
        raise ValueError(f"target_accuracy must be in (0, 1], got {target_accuracy}")
    if not 0.0 <= demo_error_rate < 1.0:
        raise ValueError(f"demo_error_rate must be in [0, 1), got {demo_error_rate}")
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = sizes["max_position_embeddings"]
    model = build_tiny_model(len(tokenizer), seed=seed, **sizes)
    train_records = make_task_records(task, max(1, steps * batch_size), seed, "train", **difficulty)
    if demo_error_rate > 0.0:
        train_records = _with_mistakes(train_records, demo_error_rate, seed)
    eval_records = make_task_records(task, n_eval, seed, "eval", **difficulty)
    dev_records = make_task_records(task, n_dev, seed + 1_000_000, "train", **difficulty)
    dev_history: list[tuple[int, float]] = []

    def reached_target(step: int) -> bool:
        dev_history.append((step, evaluate_accuracy(model, tokenizer, dev_records)))
        logger.info("warm start step %d: dev accuracy %.3f", step, dev_history[-1][1])
        return dev_history[-1][1] >= target_accuracy

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        losses = train_supervised(
            model,
            tokenizer,
            train_records,
            steps,
            batch_size=batch_size,
            lr=lr,
            should_stop=reached_target if target_accuracy is not None else None,
            check_every=check_every,
            progress=ProgressLines("warm start", steps).update,
        )
    steps_done = len(losses)
    dev_accuracy = dev_history[-1][1] if dev_history else None
    if target_accuracy is not None and (dev_accuracy or 0.0) < target_accuracy:
        logger.warning(
            "warm start %s: dev accuracy %s after the maximum %d steps is below the target %.2f",
            task,
            dev_accuracy,
            steps_done,
            target_accuracy,
        )
    model.eval()
    accuracy = evaluate_accuracy(model, tokenizer, eval_records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save(out, model, tokenizer)
    seconds = time.perf_counter() - started
    final_loss = losses[-1] if losses else float("nan")
    summary = {
        "task": task,
        "difficulty": difficulty,
        "model_sizes": sizes,
        "steps": steps_done,
        "max_steps": steps,
        "target_accuracy": target_accuracy,
        "demo_error_rate": demo_error_rate,
        "dev_accuracy": dev_accuracy,
        "dev_history": dev_history,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "eval_accuracy": accuracy,
        "n_eval": n_eval,
        "final_loss": final_loss,
        "seconds": seconds,
    }
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info(
        "warm start %s: %d steps, loss %.3f, held-out accuracy %.3f, %.1fs",
        task,
        steps_done,
        final_loss,
        accuracy,
        seconds,
    )
    return WarmStartResult(
        out, model, tokenizer, accuracy, dev_accuracy, final_loss, steps_done, seconds
    )
