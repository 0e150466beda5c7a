"""Feasibility check for the demo RL run: does GRPO lift the warm-started tiny model?

In one process and on CPU: warm-start the tiny model (``laminar_examples.demo_model``),
measure greedy held-out accuracy, then run a plain synchronous GRPO loop
(sample ``group_size`` completions per prompt at temperature 1 with a KV
cache, record behaviour log-probs, score them, group-normalise advantages,
``laminar_trainer.loss.compute_policy_loss``, one AdamW step per batch) and
measure held-out accuracy again. Prints one line per logged step and a JSON
summary at the end.

This is a tool, not the trainer: no relay, no rollout tier, no asynchrony.
Its defaults are the settings chosen for the demo (see the trainer README);
the real distributed run adds overhead on top of the compute measured here.

Measured on this 2-core CPU with the defaults (demo_error_rate 0.6, 150
warm-start steps, 32 prompts x 8 samples per step, lr 2e-4): seed 0 held-out
greedy accuracy 34.4% -> 81.6% after 30 steps (55% at step 10), seed 1
16.4% -> 84.0% after 20 steps; about 1 s per RL step. With clean
demonstrations (``--demo-error-rate 0``) the same loop gained about 11 points
in 40 steps from a 75-step warm start (46% -> 57%) and lost accuracy from a
91% one: exact-match reward has little to amplify once greedy and sampled
answers agree, and little to find when the skill is absent.

Example::

    python tools/rl_feasibility.py --seed 0
    python tools/rl_feasibility.py --seed 1 --demo-error-rate 0 --target-accuracy 0.5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--task", default="sort", help="laminar_examples.tasks.TASKS key")
    parser.add_argument("--min-len", type=int, default=None, help="sort/reverse: shortest list")
    parser.add_argument("--max-len", type=int, default=None, help="sort/reverse: longest list")
    parser.add_argument("--max-digit", type=int, default=None, help="sort/reverse: largest digit")
    parser.add_argument("--max-digits", type=int, default=None, help="add: longest operand")
    parser.add_argument("--seed", type=int, default=0, help="seeds init, data, sampling")
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument(
        "--warm-steps", type=int, default=None, help="most warm-start steps (default: model's)"
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="stop the warm start once its dev accuracy reaches this (default: run all steps)",
    )
    parser.add_argument(
        "--demo-error-rate",
        type=float,
        default=0.6,
        help="fraction of warm-start demonstrations answering with the task's plausible mistake",
    )
    parser.add_argument("--rl-steps", type=int, default=30, help="GRPO optimizer steps")
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--lr", type=float, default=2e-4, help="RL AdamW learning rate")
    parser.add_argument(
        "--warmup-steps", type=int, default=10, help="linear lr warmup of the fresh optimizer"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--correction", default="decoupled", choices=["decoupled", "tis", "none"])
    parser.add_argument(
        "--aggregation",
        default="token-mean",
        choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
    )
    parser.add_argument("--n-eval", type=int, default=256, help="held-out records")
    parser.add_argument("--eval-every", type=int, default=10, help="RL steps between evals")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out-dir", default=None, help="warm-start dir (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    # Imported here so that --help is instant.
    import torch

    from laminar_examples.accuracy import evaluate_accuracy
    from laminar_examples.demo_model import EOS_ID, PAD_ID
    from laminar_examples.tasks import TASKS, make_task_records, score_completion
    from laminar_examples.warmstart import DEFAULT_WARM_START_STEPS, warm_start
    from laminar_trainer.decoding import decode_completion, generate_completions
    from laminar_trainer.logprobs import compute_token_logprobs, encode_prompts, pack_sequences
    from laminar_trainer.loss import compute_grpo_advantages, compute_policy_loss

    torch.set_num_threads(args.threads)
    difficulty = {
        key: value
        for key, value in (
            ("min_len", args.min_len),
            ("max_len", args.max_len),
            ("max_digit", args.max_digit),
            ("max_digits", args.max_digits),
        )
        if value is not None and key in TASKS[args.task].defaults
    }
    sizes = {
        key: value
        for key, value in (("hidden_size", args.hidden_size), ("num_layers", args.num_layers))
        if value is not None
    }
    warm_steps = DEFAULT_WARM_START_STEPS if args.warm_steps is None else args.warm_steps
    target = args.target_accuracy
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="laminar-feasibility-")

    started = time.perf_counter()
    warm = warm_start(
        out_dir,
        args.task,
        warm_steps,
        args.seed,
        difficulty=difficulty,
        model_sizes=sizes,
        target_accuracy=target or None,
        n_eval=args.n_eval,
        demo_error_rate=args.demo_error_rate,
    )
    warm_seconds = time.perf_counter() - started
    model, tokenizer = warm.model, warm.tokenizer
    eval_records = make_task_records(args.task, args.n_eval, args.seed, "eval", **difficulty)
    max_new_tokens = max(len(r["answer"]) for r in eval_records) + 4
    print(
        f"warm start: {warm.steps} steps (dev accuracy {warm.dev_accuracy}), "
        f"held-out greedy accuracy {warm.accuracy:.3f}, "
        f"{warm_seconds:.1f}s",
        flush=True,
    )

    n_prompts = args.prompts_per_step * args.rl_steps
    # A seed offset keeps RL prompts apart from the warm-start stream.
    rl_records = make_task_records(args.task, n_prompts, args.seed + 10_000, "train", **difficulty)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # A fresh Adam takes sign-like steps of size lr at first; warming up keeps
    # those first noisy policy-gradient steps from undoing the warm start.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, args.warmup_steps))
    )
    sampler = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    history = [{"step": 0, "accuracy": warm.accuracy, "seconds": 0.0}]
    rl_started = time.perf_counter()
    rl_cpu_started = time.process_time()
    for step in range(1, args.rl_steps + 1):
        batch = rl_records[(step - 1) * args.prompts_per_step : step * args.prompts_per_step]
        rows = [r for r in batch for _ in range(args.group_size)]
        prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in rows])
        model.eval()
        samples = generate_completions(
            model, prompt_ids, max_new_tokens, temperature=args.temperature, generator=sampler,
            eos_id=EOS_ID, pad_id=PAD_ID,
        )
        rewards = torch.tensor(
            [
                score_completion(r, decode_completion(tokenizer, ids))
                for r, ids in zip(rows, samples.token_ids)
            ]
        )
        advantages = compute_grpo_advantages(rewards.view(-1, args.group_size)).view(-1)
        # Zero-advantage rows contribute no gradient; skipping them saves the
        # forward/backward (their only effect would be on the token-mean divisor).
        keep = [i for i in range(len(rows)) if advantages[i] != 0]
        stats: dict[str, float] = {}
        if keep:
            model.train()
            input_ids, attention_mask, mask = pack_sequences(
                [prompt_ids[i] for i in keep], [samples.token_ids[i] for i in keep]
            )
            old_logprobs = torch.zeros(mask.shape)
            for row, i in enumerate(keep):
                start = len(prompt_ids[i])
                old_logprobs[row, start : start + len(samples.logprobs[i])] = torch.tensor(
                    samples.logprobs[i]
                )
            logprobs = compute_token_logprobs(model, input_ids, attention_mask)
            loss, stats = compute_policy_loss(
                logprobs,
                old_logprobs,
                advantages[keep],
                mask,
                correction=args.correction,
                aggregation=args.aggregation,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        scheduler.step()
        if step % args.eval_every == 0 or step == args.rl_steps:
            accuracy = evaluate_accuracy(model, tokenizer, eval_records, max_new_tokens)
            elapsed = time.perf_counter() - rl_started
            history.append({"step": step, "accuracy": accuracy, "seconds": round(elapsed, 1)})
            print(
                f"rl step {step:4d}: reward {rewards.mean():.3f}, trained rows {len(keep):3d}, "
                f"ratio {stats.get('ratio_mean', 1.0):.3f}, "
                f"behaviour kl {stats.get('behaviour_kl', 0.0):.2e}, "
                f"held-out accuracy {accuracy:.3f}, {elapsed:.1f}s",
                flush=True,
            )
    rl_seconds = time.perf_counter() - rl_started
    final = history[-1]["accuracy"]
    summary = {
        "task": args.task,
        "difficulty": difficulty,
        "seed": args.seed,
        "model_sizes": sizes or "default",
        "warm_steps": warm.steps,
        "warm_max_steps": warm_steps,
        "warm_target_accuracy": target or None,
        "warm_dev_accuracy": warm.dev_accuracy,
        "demo_error_rate": args.demo_error_rate,
        "rl_steps": args.rl_steps,
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "correction": args.correction,
        "aggregation": args.aggregation,
        "accuracy_before": warm.accuracy,
        "accuracy_after": final,
        "gain_pp": round(100 * (final - warm.accuracy), 1),
        "best_accuracy": max(h["accuracy"] for h in history),
        "warm_seconds": round(warm_seconds, 1),
        "rl_seconds": round(rl_seconds, 1),
        "rl_cpu_seconds": round(time.process_time() - rl_cpu_started, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        "history": history,
        "model_dir": out_dir,
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
