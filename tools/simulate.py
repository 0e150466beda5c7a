"""SIMULATED speedup of Laminar's trajectory-level asynchrony over sync and one-step, by scale.

A discrete-event simulation (``tools/simlib.py``) of the three scheduling modes on a
disaggregated cluster of 64-1024 GPUs (by default 3/4 run rollout workers, 1/4 train). No
model runs and no GPU is used: the engine, the relays and the training step are cost models.
The decisions are the project's own: dispatch by ``laminar_rollout.scheduling``
(``plan_dispatch``, ``plan_barrier``, ``required_version``), dynamic repack by
``laminar_rollout.repack.plan_repack``, accounting in ``TrajectoryLedger``.

Modes: ``sync`` (generate a global batch, train, every worker pulls, repeat), ``one-step``
(batch k+1 is generated with weights k-1 while the trainer trains batch k; a global barrier
between batches), ``laminar`` (workers pull the newest weights whenever they are empty,
the trainer consumes complete GRPO groups as they come, stale stragglers are repacked).

Time model (also printed with the numbers in use):
  decode step a + b*batch; prefill c per token, re-prefill for migrated / preempted
  trajectories; KV capacity per worker with vLLM-style preemption; response lengths
  log-normal with p99/median = 10 (``LogNormalLengths``); trainer step = overhead +
  tokens / (trainer GPUs x tokens/s/GPU); weight publish = trainer snapshot stall, then a
  pipelined relay chain (size/bw + hops*chunk/bw) and a per-worker load (size/(GPUs*bw)).

Admission control in laminar mode, as ``ManagerService`` does with
``ManagerConfig.max_staleness`` (AReaL-style bounded staleness): fresh trajectories start only
while started <= (trainer version + 1 + bound) x batch. ``--max-staleness`` sets the bound
(default 2, the manager's default); ``--max-staleness none`` dispatches without a bound, so
when the rollouts produce faster than the trainer consumes, the backlog and the staleness
grow with the length of the run.

Throughput is trajectory tokens (prompt + response) consumed by the trainer per simulated
second, between trainer-step ends after a warm-up. The three modes of one scale run side by
side with the same seed (the k-th trajectory has the same length in every mode). The paper
figures printed next to the results (Laminar, arXiv 2510.12633: up to 5.48x over
synchronous, 1.98x over one-step staleness, math, 1024 GPUs) come from real systems whose
baselines differ from these modes; compare trends, not digits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAPER_OVER_SYNC = 5.48
PAPER_OVER_ONE_STEP = 1.98


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", default="64,128,256,512,1024", help="total GPUs (comma list)")
    p.add_argument("--rollout-fraction", type=float, default=0.75,
                   help="share of GPUs running rollout workers (rest train)")
    p.add_argument("--gpus-per-worker", type=int, default=4, help="GPUs of one rollout engine")
    p.add_argument("--steps", type=int, default=3,
                   help="measured trainer steps, sync and one-step")
    p.add_argument("--laminar-steps", type=int, default=6, help="measured trainer steps, laminar")
    p.add_argument("--max-staleness", default="2",
                   help="laminar admission bound (ManagerConfig.max_staleness, default 2), "
                        "or 'none' for unbounded dispatch")
    p.add_argument("--no-repack", action="store_true", help="laminar without dynamic repack")
    p.add_argument("--batch-prompts", type=int, default=512, help="prompts per global batch")
    p.add_argument("--group-size", type=int, default=16, help="samples per prompt (GRPO)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--median", type=float, default=2048.0, help="median response length")
    p.add_argument("--tail-ratio", type=float, default=10.0, help="p99 / median of lengths")
    p.add_argument("--max-len", type=int, default=20480, help="response length cap")
    p.add_argument("--decode-base", type=float, default=0.015, help="a: s per decode step")
    p.add_argument("--decode-per-seq", type=float, default=0.00015,
                   help="b: s per decode step per running sequence")
    p.add_argument("--prefill-per-token", type=float, default=4e-5, help="c: s per token")
    p.add_argument("--max-batch", type=int, default=256, help="decode slots per worker")
    p.add_argument("--kv-tokens", type=int, default=800_000, help="KV capacity per worker")
    p.add_argument("--weights-gb", type=float, default=64.0, help="model weights, GB")
    p.add_argument("--relay-gbps", type=float, default=25.0, help="relay link, GB/s")
    p.add_argument("--h2d-gbps", type=float, default=25.0, help="weight load per GPU, GB/s")
    p.add_argument("--train-tok-per-gpu", type=float, default=1200.0,
                   help="trainer tokens/s per GPU (prompt + response)")
    p.add_argument("--train-overhead", type=float, default=3.0, help="s per trainer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/simulate/speedup.png", help="speedup plot (PNG)")
    p.add_argument("--json", default=None, help="also write every metric to this JSON file")
    args = p.parse_args(argv)
    try:
        args.scales = [int(x) for x in args.scales.split(",") if x.strip()]
        args.max_staleness = None if args.max_staleness.lower() == "none" else \
            int(args.max_staleness)
    except ValueError as exc:
        p.error(f"bad --scales or --max-staleness: {exc}")
    if not args.scales:
        p.error("--scales is empty")
    if args.max_staleness is not None and args.max_staleness < 0:
        p.error("--max-staleness must be >= 0 or 'none'")
    if args.steps < 1 or args.laminar_steps < 1:
        p.error("--steps and --laminar-steps must be >= 1")
    return args


def _row(r) -> str:
    return (f"{r.gpus:>5} {r.mode:<8} {r.throughput_tok_s:>9,.0f} {r.generation_tok_s:>9,.0f} "
            f"{r.rollout_busy_frac:>5.2f} {r.workers_generating_frac:>5.2f} {r.slot_util:>5.2f} "
            f"{r.kv_util:>5.2f} {r.staleness_p50:>4.0f}/{r.staleness_p99:<3.0f}/"
            f"{r.staleness_max:<3d} {r.trainer_idle_frac:>5.2f} {r.weight_wait_per_pull_s:>6.2f} "
            f"{r.weight_wait_frac:>6.3f} {r.repacks:>5d} {r.migrated:>7,d} {r.mean_step_s:>7.0f} "
            f"{r.wall_s:>5.1f}")


_HEADER = (" GPUs mode      train tok/s gen tok/s  busy  gen'g  slot    kv stale p50/p99/max "
           "t-idle  wait/pull  wait%  repk migrated  step s  wall")


def _plot(path: str, rows: list[dict], title_note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["gpus"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(x, [r["laminar/sync"] for r in rows], "o-", label="laminar / sync (simulated)")
    ax.plot(x, [r["laminar/one-step"] for r in rows], "s-",
            label="laminar / one-step (simulated)")
    ax.scatter([1024], [PAPER_OVER_SYNC], marker="*", s=160, color="C0", zorder=5,
               label=f"paper: up to {PAPER_OVER_SYNC}x over sync (1024 GPUs)")
    ax.scatter([1024], [PAPER_OVER_ONE_STEP], marker="*", s=160, color="C1", zorder=5,
               label=f"paper: {PAPER_OVER_ONE_STEP}x over one-step (math)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels([str(v) for v in x])
    ax.set_xlabel("GPUs (rollout + trainer)")
    ax.set_ylabel("trainer throughput ratio")
    ax.set_title(f"SIMULATION: Laminar speedup by scale\n{title_note}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from simlib import (
        Cluster,
        SimConfig,
        TimeModel,
        Workload,
        pipeline_fill_s,
        simulate,
    )

    from laminar_rollout.engines import LogNormalLengths

    model = TimeModel(
        decode_base_s=args.decode_base, decode_per_seq_s=args.decode_per_seq,
        prefill_per_token_s=args.prefill_per_token, max_batch=args.max_batch,
        kv_capacity_tokens=args.kv_tokens, weight_bytes=args.weights_gb * 1e9,
        relay_bandwidth=args.relay_gbps * 1e9, h2d_bandwidth=args.h2d_gbps * 1e9,
        train_tokens_per_gpu_s=args.train_tok_per_gpu,
        train_step_overhead_s=args.train_overhead)
    workload = Workload(
        lengths=LogNormalLengths(median=args.median, tail_ratio=args.tail_ratio,
                                 max_length=args.max_len),
        prompt_tokens=args.prompt_len, group_size=args.group_size,
        batch_groups=args.batch_prompts)
    clusters = [Cluster(g, args.rollout_fraction, args.gpus_per_worker) for g in args.scales]
    fill = pipeline_fill_s(model, workload)
    bound = "none (no run-ahead bound)" if args.max_staleness is None else \
        f"{args.max_staleness} (ManagerConfig.max_staleness, through plan_dispatch)"

    print("SIMULATION: discrete-event model of the sync / one-step / laminar modes. Simulated "
          "engine and simulated training step; no model runs, no GPU is used.")
    print("Decisions are the project's: laminar_rollout.scheduling (plan_dispatch, plan_barrier, "
          "required_version), laminar_rollout.repack.plan_repack, TrajectoryLedger.")
    print("Time model:")
    for line in model.describe(workload=workload):
        print("  " + line)
    print(f"  laminar repack {'off' if args.no_repack else 'on'}; laminar staleness bound "
          f"{bound}; barrier grants: an even share of the batch per worker (plan_barrier)")
    print(f"  windows: sync {args.steps} steps after 1, one-step {args.steps} after 2, laminar "
          f"{args.laminar_steps} after >= 2 steps and {2 * fill:.0f} s; seed {args.seed}")
    print()
    print(_HEADER)
    t_start = time.perf_counter()
    ratios, everything = [], []
    for cl in clusters:
        configs = {
            "sync": SimConfig("sync", measure_steps=args.steps, warmup_steps=1,
                              seed=args.seed),
            "one-step": SimConfig("one-step", measure_steps=args.steps, warmup_steps=2,
                                  seed=args.seed),
            "laminar": SimConfig("laminar", measure_steps=args.laminar_steps, warmup_steps=2,
                                 warmup_s=2 * fill, repack=not args.no_repack,
                                 laminar_max_staleness=args.max_staleness, seed=args.seed),
        }
        res = {}
        for mode, cfg in configs.items():
            res[mode] = simulate(cl, model, workload, cfg)
            print(_row(res[mode]), flush=True)
            everything.append(res[mode].key() | {"wall_s": res[mode].wall_s})
        lam = res["laminar"].throughput_tok_s
        ratios.append({
            "gpus": cl.gpus, "rollout_gpus": cl.rollout_gpus, "trainer_gpus": cl.trainer_gpus,
            "workers": cl.workers,
            "laminar/sync": lam / res["sync"].throughput_tok_s,
            "laminar/one-step": lam / res["one-step"].throughput_tok_s,
            "one-step/sync": res["one-step"].throughput_tok_s / res["sync"].throughput_tok_s,
            "broadcast_s": model.broadcast_s(cl.relay_hops),
        })
    wall = time.perf_counter() - t_start
    print("  (train tok/s: consumed by the trainer; gen tok/s: generated; busy: worker time "
          "decoding or prefilling; gen'g: workers that generated at all; slot / kv: mean use; "
          "t-idle: trainer idle; wait/pull: weight fetch + load per pull, wait%: its share of "
          "worker time)")
    print()
    print("Speedup (trainer throughput ratios, simulated side by side in this run):")
    print(" GPUs  rollout/trainer GPUs  workers  broadcast s  laminar/sync  laminar/one-step  "
          "one-step/sync")
    for r in ratios:
        print(f"{r['gpus']:>5}  {r['rollout_gpus']:>7} / {r['trainer_gpus']:<10} {r['workers']:>7}"
              f"  {r['broadcast_s']:>11.2f}  {r['laminar/sync']:>11.2f}x  "
              f"{r['laminar/one-step']:>15.2f}x  {r['one-step/sync']:>12.2f}x")
    print(f"Paper (Laminar, arXiv 2510.12633; real 1024-GPU cluster, math): up to "
          f"{PAPER_OVER_SYNC}x over synchronous, {PAPER_OVER_ONE_STEP}x over one-step staleness.")
    print("  Not like for like: the paper's baselines are other systems (e.g. verl's colocated "
          "synchronous mode); here all modes share one disaggregated cluster, so one-step/sync "
          "<= 2 by construction.")
    _plot(args.out, ratios, f"{args.rollout_fraction:.0%} rollout GPUs, "
          f"{workload.batch_trajectories} trajectories/batch, staleness bound "
          f"{args.max_staleness}")
    print(f"plot: {args.out}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"ratios": ratios, "runs": everything}, fh, indent=1)
        print(f"metrics: {args.json}")
    print(f"simulated in {wall:.1f} s wall (SIMULATION, not a measurement of real hardware)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
