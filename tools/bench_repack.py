"""SIMULATED benchmark of dynamic repack: the same long-tail laminar workload, repack on vs off,
and repack with KV transfer (migrated trajectories carry their caches, no re-prefill).

Runs the discrete-event simulator core (``tools/simlib.py``) three times in one process with the
same seed (the k-th trajectory has the same response length in both runs): laminar mode on
``--workers`` rollout workers, with repack planned by the project's
``laminar_rollout.repack.plan_repack`` (periodic every ``RepackConfig.interval_s`` and forced
on every new weight version, like the manager's ``Dispatch.maybe_repack``) and off. The engine and
the training step are cost models (simulated engine, simulated training step; see
``simlib``'s docstring for the time model, printed below); migrated trajectories pay a
re-prefill of prompt + generated tokens on their destination, which stalls its decoding, or
with KV transfer (``SimConfig.kv_transfer``) wait for their cache to arrive instead.

Why the simulator and not the real ``ManagerService`` + ``WorkerService`` with
``SimulatedEngine``: the real services need etcd and ZeroMQ and run on the wall clock, so 32
workers for an hour of simulated generation would not fit two minutes on a small machine;
the simulator calls the same planning function and ledger with the same inputs (per-worker
version, assigned count, KV use, active-count history over the last reports), so the
decision under test is the project's, and only the engine is modelled.

Dispatch is unbounded here (``ManagerService`` behaviour: every worker at the latest version
is kept full), so generation is limited by the rollouts, not by the trainer: the numbers
isolate what repack does to generation throughput and slot / KV use. Reported: generation
throughput (tokens generated per simulated second), trainer throughput, mean slot and KV
use, the share of slot time left free on stale workers that are draining (what repack is
meant to reclaim), repack count, migrated trajectories, re-prefilled tokens and the
destination stall they cost.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=32, help="rollout workers")
    p.add_argument("--gpus-per-worker", type=int, default=4)
    p.add_argument("--trainer-gpus", type=int, default=128,
                   help="trainer GPUs (sets how often a new version arrives)")
    p.add_argument("--steps", type=int, default=6, help="measured trainer steps")
    p.add_argument("--warmup-s", type=float, default=2200.0,
                   help="simulated seconds before the window opens (pipeline fill)")
    p.add_argument("--batch-prompts", type=int, default=512)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--median", type=float, default=2048.0, help="median response length")
    p.add_argument("--tail-ratio", type=float, default=10.0, help="p99 / median of lengths")
    p.add_argument("--max-len", type=int, default=20480)
    p.add_argument("--max-batch", type=int, default=256, help="decode slots per worker")
    p.add_argument("--kv-tokens", type=int, default=800_000, help="KV capacity per worker")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.workers < 2 or args.trainer_gpus < 1 or args.steps < 1:
        p.error("need --workers >= 2, --trainer-gpus >= 1, --steps >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from simlib import Cluster, SimConfig, TimeModel, Workload, simulate

    from laminar_rollout.engines import LogNormalLengths

    rollout_gpus = args.workers * args.gpus_per_worker
    total = rollout_gpus + args.trainer_gpus
    cluster = Cluster(total, rollout_gpus / total, args.gpus_per_worker)
    model = TimeModel(max_batch=args.max_batch, kv_capacity_tokens=args.kv_tokens)
    workload = Workload(
        lengths=LogNormalLengths(median=args.median, tail_ratio=args.tail_ratio,
                                 max_length=args.max_len),
        group_size=args.group_size, batch_groups=args.batch_prompts)
    print("SIMULATION: repack on vs off, laminar mode, simulated engine and simulated training "
          "step (tools/simlib.py); repack decisions by laminar_rollout.repack.plan_repack.")
    for line in model.describe(cluster, workload):
        print("  " + line)
    print(f"  dispatch unbounded (ManagerService behaviour); window: {args.steps} trainer steps "
          f"after {args.warmup_s:.0f} s; seed {args.seed}")
    results = {}
    t0 = time.perf_counter()
    for name, on, kv in (("on", True, False), ("off", False, False), ("kv", True, True)):
        cfg = SimConfig("laminar", measure_steps=args.steps, warmup_steps=1,
                        warmup_s=args.warmup_s, repack=on, laminar_max_staleness=None,
                        kv_transfer=kv, seed=args.seed)
        results[name] = simulate(cluster, model, workload, cfg)
    wall = time.perf_counter() - t0
    on, off, kv = results["on"], results["off"], results["kv"]
    rows = [
        ("generation throughput, tok/s", on.generation_tok_s, off.generation_tok_s, ",.0f"),
        ("trainer throughput, tok/s", on.throughput_tok_s, off.throughput_tok_s, ",.0f"),
        ("mean slot use (running / slots)", on.slot_util, off.slot_util, ".3f"),
        ("mean KV use (tokens / capacity)", on.kv_util, off.kv_util, ".3f"),
        ("free slot time on draining stale workers", on.stale_drain_idle_frac,
         off.stale_drain_idle_frac, ".3f"),
        ("worker busy fraction", on.rollout_busy_frac, off.rollout_busy_frac, ".3f"),
        ("weight pulls", on.pulls, off.pulls, "d"),
        ("KV preemptions (whole run)", on.preemptions, off.preemptions, "d"),
        ("staleness p50 / p99", on.staleness_p50, off.staleness_p50, ".1f"),
    ]
    print()
    print(f"{'metric':<42} {'repack on':>12} {'repack off':>12} {'on/off':>8}")
    for name, a, b, fmt in rows:
        ratio = f"{a / b:8.3f}" if b else "       -"
        if name.startswith("staleness"):
            print(f"{name:<42} {a:>5.1f} / {on.staleness_p99:<4.1f} {b:>5.1f} / "
                  f"{off.staleness_p99:<4.1f}")
            continue
        print(f"{name:<42} {format(a, fmt):>12} {format(b, fmt):>12} {ratio}")
    worker_s = on.workers * on.window_s
    print()
    print(f"repack (in the {on.window_s:,.0f} s window): {on.repacks} repacks, "
          f"{on.migrated:,} trajectories migrated, {on.repack_prefill_tokens:,.0f} tokens "
          f"re-prefilled = {on.repack_stall_s:,.0f} s of destination stall "
          f"({on.repack_stall_s / worker_s:.2%} of worker time)")
    kv_worker_s = kv.workers * kv.window_s
    print(f"repack + KV transfer (in its {kv.window_s:,.0f} s window): {kv.migrated:,} migrated, "
          f"{kv.kv_carried_tokens:,.0f} tokens carried, not re-prefilled "
          f"({kv.kv_transfer_s:,.0f} s of transfers, each waited for by its own trajectory), "
          f"{kv.repack_prefill_tokens:,.0f} re-prefilled = {kv.repack_stall_s:,.0f} s of stall "
          f"({kv.repack_stall_s / kv_worker_s:.2%} of worker time); generation "
          f"{kv.generation_tok_s:,.0f} tok/s, slot use {kv.slot_util:.3f}")
    print(f"generation throughput ratio repack on/off: "
          f"{on.generation_tok_s / off.generation_tok_s:.2f}x; repack with KV transfer / "
          f"repack: {kv.generation_tok_s / on.generation_tok_s:.3f}x (SIMULATION; {wall:.1f} s "
          f"wall for the three runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
