"""What step records cost: bytes per token, and a real training step with and without.

Builds the demo's model shape (random init, ``laminar_examples.demo_model``), makes a
batch of random trajectories of the demo job's shape (or ``--groups``, ``--group-size``,
``--prompt-tokens``, ``--response-tokens``), and times ``--steps`` pairs of real GRPO
steps (``train_step``) on the same batch, one writing the step's record
(``laminar_common.data.provenance``, zstd Parquet) and one not, in alternating order. Prints the record's size per token, its write
time, and the ratio of the step time with records to without. The trajectories are
SIMULATED (random tokens and rewards); the model, the optimizer step and the writes
are real.

    python tools/bench_records.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from laminar_common.codec import SamplingSpec, Trajectory, trajectory_seed
from laminar_common.data.provenance import StepRecordWriter
from laminar_examples.demo_model import build_tiny_model, build_tokenizer
from laminar_trainer.buffer import Group
from laminar_trainer.config import TrainerConfig
from laminar_trainer.step import make_optimizer, train_step


def batch(rng: random.Random, vocab: int, groups: int, size: int, prompt: int, response: int,
          step: int) -> list[Group]:
    out = []
    for g in range(groups):
        group = Group(f"s{step}-p{g}", size)
        for i in range(size):
            n = rng.randint(max(1, response // 4), response)
            tid = f"s{step}-p{g}#{i}"
            group.members[i] = Trajectory(
                trajectory_id=tid, prompt_id=group.prompt_id, group_size=size,
                sample_index=i, worker_id="worker-0", policy_version=step,
                prompt_token_ids=tuple(rng.randrange(3, vocab) for _ in range(prompt)),
                response_token_ids=tuple(rng.randrange(3, vocab) for _ in range(n)),
                behaviour_logprobs=tuple(-rng.random() * 4 for _ in range(n)),
                reward=float(rng.random() < 0.5), finish_reason="stop",
                completion="x" * (3 * n),
                sampling=SamplingSpec(max_tokens=response, seed=trajectory_seed(1, tid)))
        out.append(group)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="steps of each kind (interleaved)")
    p.add_argument("--groups", type=int, default=32, help="groups a step (the demo: 32)")
    p.add_argument("--group-size", type=int, default=8, help="trajectories a group (demo: 8)")
    p.add_argument("--prompt-tokens", type=int, default=12)
    p.add_argument("--response-tokens", type=int, default=10, help="the demo: 10")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    model = build_tiny_model(len(tok))
    rng = random.Random(0)
    times: dict[str, list[float]] = {"without": [], "with": []}
    writes: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(f"{tmp}/model")
        tok.save_pretrained(f"{tmp}/model")
        cfg = TrainerConfig(model_dir=f"{tmp}/model", batch_groups=args.groups,
                            total_steps=10 ** 6)
        optimizer, scheduler = make_optimizer(model, cfg.optim, cfg.total_steps)
        writer = StepRecordWriter(f"{tmp}/records", cfg.model_dump_json(),
                                  keep_steps=2 * args.steps,
                                  decode=lambda ids: tok.decode(list(ids)))
        step = 0
        for pair in range(args.steps + 1):
            # Each pair trains the same batch twice, once with its record written and once
            # without (in alternating order): the ratio compares like with like.
            groups = batch(rng, len(tok), args.groups, args.group_size, args.prompt_tokens,
                           args.response_tokens, pair)
            for kind in (("without", "with") if pair % 2 else ("with", "without")):
                step += 1
                t0 = time.perf_counter()
                train_step(model, optimizer, scheduler, groups, cfg, version=pair)
                t1 = time.perf_counter()
                if kind == "with":
                    writer.write(step, pair, groups)
                    writes.append(time.perf_counter() - t1)
                if pair:  # the first pair warms up
                    times[kind].append(time.perf_counter() - t0)
    tokens = writer.tokens_written
    per_step = tokens / len(writes)
    step_without, step_with = statistics.median(times["without"]), statistics.median(times["with"])
    print("SIMULATED trajectories (random tokens, rewards); real model, optimizer step and "
          "record writes")
    print(f"batch: {args.groups} groups x {args.group_size}, prompts {args.prompt_tokens} "
          f"tokens, responses up to {args.response_tokens}; {per_step:.0f} tokens a step")
    print(f"record: {writer.bytes_written / len(writes) / 1024:.1f} KiB a step, "
          f"{writer.bytes_written / tokens:.2f} bytes a token (zstd Parquet, completion text "
          f"included); write {1000 * statistics.median(writes):.1f} ms median")
    print(f"step without records {1000 * step_without:.1f} ms, with {1000 * step_with:.1f} ms "
          f"(medians of {len(times['with'])}): ratio {step_with / step_without:.3f}; the "
          f"write alone is {100 * statistics.median(writes) / step_without:.2f}% of a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
