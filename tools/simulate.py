"""SIMULATED speedup of Laminar's trajectory-level asynchrony over sync and one-step, by scale.

A discrete-event simulation (``tools/simlib.py``) of three systems on 64-1024 GPUs. No model
runs and no GPU is used: the engine, the weight paths and the training step are cost models.
The decisions are the project's own: dispatch by ``laminar_rollout.scheduling``
(``plan_dispatch``, ``plan_barrier``, ``required_version``), dynamic repack by
``laminar_rollout.repack.plan_repack``, accounting in ``TrajectoryLedger``.

The baselines are modelled as the systems the paper compares against run:

- ``sync``: colocated, as verl's synchronous mode: every GPU generates a global batch, then
  every GPU trains on it; each step pays a generate <-> train switch (offload / reload of
  weights and KV cache, reshard). No relay, no pulls.
- ``one-step``: disaggregated, one-step staleness (batch k+1 generated with weights k-1
  while batch k trains), weights spread by a global NCCL-style broadcast that starts when
  the trainer finished a step and every engine is idle; the trainer waits for it; its time
  grows with the number of rollout GPUs.
- ``laminar``: disaggregated; the relay tier (the trainer stalls for a host snapshot only),
  workers pull when empty, the trainer consumes complete groups as they come, repack.

The trainer/rollout split of the disaggregated modes is swept (``--fractions``) and each
mode reported at its best split. The trainer's rate is calibrated (``--gen-share``) so that
generation is 83% of colocated sync's step time at the smallest scale, as the paper reports
for math; every assumption is printed with its source, and a sensitivity table
(``--sensitivity``) reruns one scale with each of four assumptions changed (response
tail, generation share, correlation within a group, switch cost).

Throughput is trajectory tokens (prompt + response) consumed by the trainer per simulated
second, between trainer-step ends after a warm-up. The runs of one scale use the same seed
(the k-th trajectory has the same length in every run). The paper's figures printed next to
the results (Laminar, arXiv 2510.12633) come from real systems on real hardware; compare
trends, not digits, and read the assumptions table.
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
PAPER_OVER_SYNC_MEAN = 2.56
PAPER_OVER_ONE_STEP = 1.98
PAPER_GEN_SHARE = 0.83


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", default="64,128,256,512,1024", help="total GPUs (comma list)")
    p.add_argument("--fractions", default="0.5,0.625,0.75,0.875",
                   help="rollout shares of the GPUs swept for one-step and laminar")
    p.add_argument("--gpus-per-worker", type=int, default=4, help="GPUs of one rollout engine")
    p.add_argument("--steps", type=int, default=3,
                   help="measured trainer steps, sync and one-step")
    p.add_argument("--laminar-steps", type=int, default=6, help="measured trainer steps, laminar")
    p.add_argument("--max-staleness", default="2",
                   help="laminar admission bound (ManagerConfig.max_staleness, default 2), "
                        "or 'none' for unbounded dispatch")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="laminar: no new group while this many global batches of finished "
                        "trajectories wait for the trainer (ManagerConfig.max_waiting; "
                        "default off)")
    p.add_argument("--no-repack", action="store_true", help="laminar without dynamic repack")
    p.add_argument("--kv-transfer", action="store_true",
                   help="laminar's repack moves migrated caches worker to worker (no "
                        "re-prefill; the plane issue 18 asks for, not built at this shape)")
    p.add_argument("--kv-kib-per-token", type=float, default=256.0,
                   help="KV cache per token, KiB (32B: 64 layers x 8 KV heads x 128 x K,V "
                        "x bf16)")
    p.add_argument("--kv-gbps", type=float, default=25.0, help="KV transfer link, GB/s")
    p.add_argument("--batch-prompts", type=int, default=512, help="prompts per global batch")
    p.add_argument("--group-size", type=int, default=16, help="samples per prompt (GRPO)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--median", type=float, default=2048.0, help="median response length")
    p.add_argument("--tail-ratio", type=float, default=10.0, help="p99 / median of lengths")
    p.add_argument("--max-len", type=int, default=20480, help="response length cap")
    p.add_argument("--group-correlation", type=float, default=0.5,
                   help="correlation of log lengths within a prompt group")
    p.add_argument("--decode-base", type=float, default=0.015, help="a: s per decode step")
    p.add_argument("--decode-per-seq", type=float, default=0.00015,
                   help="b: s per decode step per running sequence")
    p.add_argument("--decode-per-kv", type=float, default=2.2e-8,
                   help="k: s per decode step per KV-cache token")
    p.add_argument("--prefill-per-token", type=float, default=4e-5, help="c: s per token")
    p.add_argument("--max-batch", type=int, default=256, help="decode slots per worker")
    p.add_argument("--kv-tokens", type=int, default=800_000, help="KV capacity per worker")
    p.add_argument("--weights-gb", type=float, default=64.0, help="model weights, GB")
    p.add_argument("--relay-gbps", type=float, default=25.0, help="relay link, GB/s")
    p.add_argument("--h2d-gbps", type=float, default=25.0, help="weight load per GPU, GB/s")
    p.add_argument("--nccl-gbps", type=float, default=25.0, help="NCCL broadcast, GB/s")
    p.add_argument("--switch-s", type=float, default=5.0,
                   help="colocated sync: generate <-> train switch per step, s")
    p.add_argument("--gen-share", type=float, default=PAPER_GEN_SHARE,
                   help="calibrate the trainer so generation is this share of colocated "
                        "sync's step at the smallest scale (0: use --train-tok-per-gpu)")
    p.add_argument("--train-tok-per-gpu", type=float, default=1200.0,
                   help="trainer tokens/s per GPU (prompt + response), before calibration")
    p.add_argument("--train-overhead", type=float, default=3.0, help="s per trainer step")
    p.add_argument("--sensitivity", default="256",
                   help="scale of the sensitivity table ('none': skip it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/simulate/speedup.png", help="speedup plot (PNG)")
    p.add_argument("--json", default=None, help="also write every metric to this JSON file")
    args = p.parse_args(argv)
    try:
        args.scales = [int(x) for x in args.scales.split(",") if x.strip()]
        args.fractions = _floats(args.fractions)
        args.max_staleness = None if args.max_staleness.lower() == "none" else \
            int(args.max_staleness)
        args.sensitivity = None if args.sensitivity.lower() == "none" else \
            int(args.sensitivity)
    except ValueError as exc:
        p.error(f"bad --scales, --fractions, --max-staleness or --sensitivity: {exc}")
    if not args.scales or not args.fractions:
        p.error("--scales and --fractions must not be empty")
    if any(not 0 < f < 1 for f in args.fractions):
        p.error("--fractions must lie in (0, 1)")
    if args.max_staleness is not None and args.max_staleness < 0:
        p.error("--max-staleness must be >= 0 or 'none'")
    if args.max_waiting is not None and args.max_waiting < 1:
        p.error("--max-waiting must be >= 1")
    if args.steps < 1 or args.laminar_steps < 1:
        p.error("--steps and --laminar-steps must be >= 1")
    if not 0 <= args.gen_share < 1:
        p.error("--gen-share must be in [0, 1)")
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


def _configs(args, fill: float):
    from simlib import SimConfig

    return {
        "sync": SimConfig("sync", measure_steps=args.steps, warmup_steps=1, seed=args.seed),
        "one-step": SimConfig("one-step", measure_steps=args.steps, warmup_steps=2,
                              weight_sync="nccl", seed=args.seed),
        "laminar": SimConfig("laminar", measure_steps=args.laminar_steps, warmup_steps=2,
                             warmup_s=2 * fill, repack=not args.no_repack,
                             laminar_max_staleness=args.max_staleness,
                             laminar_max_waiting=args.max_waiting,
                             kv_transfer=args.kv_transfer, seed=args.seed),
    }


def run_scale(gpus: int, model, workload, args, on_row=None) -> dict:
    """Colocated sync, and one-step / laminar at every split of ``--fractions``; each mode's
    best split is its result."""
    from simlib import Cluster, pipeline_fill_s, simulate

    cfgs = _configs(args, pipeline_fill_s(model, workload))
    out = {"gpus": gpus, "sweep": {}}
    sync = simulate(Cluster(gpus, gpus_per_worker=args.gpus_per_worker, colocated=True),
                    model, workload, cfgs["sync"])
    out["sync"] = sync
    if on_row:
        on_row(sync, "all")
    for mode in ("one-step", "laminar"):
        best = None
        for frac in args.fractions:
            try:
                cl = Cluster(gpus, frac, args.gpus_per_worker)
            except ValueError:
                continue  # too few GPUs for a worker or a trainer at this split
            r = simulate(cl, model, workload, cfgs[mode])
            out["sweep"][(mode, frac)] = r
            if best is None or r.throughput_tok_s > best[1].throughput_tok_s:
                best = (frac, r)
        if best is None:
            raise SystemExit(f"simulate: no split of {args.fractions} fits {gpus} GPUs")
        out[mode] = best[1]
        out[mode + "_split"] = best[0]
        if on_row:
            on_row(best[1], f"{best[0]:.3f}")
    lam = out["laminar"].throughput_tok_s
    out["laminar/sync"] = lam / sync.throughput_tok_s
    out["laminar/one-step"] = lam / out["one-step"].throughput_tok_s
    out["one-step/sync"] = out["one-step"].throughput_tok_s / sync.throughput_tok_s
    return out


def calibrate(model, workload, args, gpus: int, share: float):
    """The trainer rate (tokens/s/GPU) at which generation is ``share`` of colocated sync's
    step at ``gpus`` GPUs; returns (model with it, generation s, step s)."""
    import dataclasses

    from simlib import Cluster, simulate

    r = simulate(Cluster(gpus, gpus_per_worker=args.gpus_per_worker, colocated=True), model,
                 workload, _configs(args, 0.0)["sync"])
    tokens = r.throughput_tok_s * r.mean_step_s
    gen = r.mean_step_s - model.train_step_s(tokens, gpus) - model.colocate_switch_s
    train = gen * (1 - share) / share - model.colocate_switch_s - model.train_step_overhead_s
    if train <= 0:
        raise SystemExit(f"simulate: generation takes {gen:.0f} s a step; at a share of "
                         f"{share:.2f} the switch ({model.colocate_switch_s} s) and the step "
                         f"overhead ({model.train_step_overhead_s} s) leave no training time")
    rate = tokens / (gpus * train)
    return dataclasses.replace(model, train_tokens_per_gpu_s=rate), gen, gen / share


def assumptions(model, workload, args) -> list[tuple[str, str, str]]:
    """(assumption, value, source) of every number the result depends on."""
    m, d = model, workload.lengths
    kv_bytes = 64 * 8 * 128 * 2 * 2
    return [
        ("model, engines", f"32B dense, {m.weight_bytes / 1e9:.0f} GB bf16; TP{args.gpus_per_worker}"
         " rollout engines", "assumption: a Qwen2.5-32B-shaped model (64 layers, GQA 8 KV heads)"),
        ("decode a, b", f"{m.decode_base_s * 1e3:.0f} ms + {m.decode_per_seq_s * 1e3:.2f} ms/seq",
         "assumption: 16 GB of weights per GPU read per step at ~3 TB/s (5 ms) plus launch "
         "and sampling overheads"),
        ("decode k (KV)", f"{m.decode_per_kv_token_s * 1e9:.0f} ns per KV token",
         f"arithmetic: {kv_bytes // 1024} KB of K/V per token (64 x 8 x 128 x 2 x bf16) "
         f"read from 4 GPUs' HBM at ~3 TB/s each"),
        ("KV capacity", f"{m.kv_capacity_tokens:,} tokens per engine",
         "arithmetic: 4 x 80 GB - 64 GB weights, 80% for KV, / 256 KB per token"),
        ("prefill", f"{m.prefill_per_token_s * 1e6:.0f} us/token", "assumption"),
        ("responses", f"median {d.median:.0f}, p99/median {d.tail_ratio:.0f}, cap {d.max_length}",
         "brief: p99 ~10x the median (long-tail reasoning); median: assumption"),
        ("group correlation", f"{workload.group_correlation:.2f} (log lengths)",
         "assumption (no published figure found): hard prompts are long for every sample"),
        ("batch", f"{workload.batch_groups} prompts x {workload.group_size} samples",
         "assumption: DAPO-style math batch"),
        ("trainer rate", f"{m.train_tokens_per_gpu_s:,.0f} tokens/s/GPU + "
         f"{m.train_step_overhead_s:.0f} s a step",
         f"calibrated: generation {args.gen_share:.0%} of colocated sync's step at "
         f"{args.scales[0]} GPUs (paper, math)" if args.gen_share else "given (--train-tok-per-gpu)"),
        ("colocated switch", f"{m.colocate_switch_s:.0f} s a step",
         "assumption: vLLM sleep / wake of weights and KV plus the FSDP -> vLLM reshard"),
        ("NCCL sync", f"{m.nccl_bandwidth / 1e9:.0f} GB/s, {m.nccl_tensors} tensors x "
         f"({m.nccl_latency_s * 1e6:.0f} + {m.nccl_latency_per_hop_s * 1e6:.0f} log2 ranks) us",
         "assumption: 200 Gb/s NICs; one broadcast per tensor (771 in Qwen2.5-32B)"),
        ("relay", f"{m.relay_bandwidth / 1e9:.0f} GB/s, {m.chunk_bytes / 1e6:.0f} MB chunks; "
         f"load {m.h2d_bandwidth / 1e9:.0f} GB/s/GPU", "assumption: 200 Gb/s NICs, PCIe 5"),
        ("staleness bound", str(args.max_staleness), "ManagerConfig.max_staleness default"
         if args.max_staleness == 2 else "--max-staleness"),
        ("waiting bound", str(args.max_waiting), "ManagerConfig.max_waiting default"
         if args.max_waiting is None else "--max-waiting"),
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from simlib import TimeModel, Workload

    from laminar_rollout.engines import LogNormalLengths

    base = TimeModel(
        decode_base_s=args.decode_base, decode_per_seq_s=args.decode_per_seq,
        decode_per_kv_token_s=args.decode_per_kv,
        prefill_per_token_s=args.prefill_per_token, max_batch=args.max_batch,
        kv_capacity_tokens=args.kv_tokens, weight_bytes=args.weights_gb * 1e9,
        relay_bandwidth=args.relay_gbps * 1e9, h2d_bandwidth=args.h2d_gbps * 1e9,
        nccl_bandwidth=args.nccl_gbps * 1e9, colocate_switch_s=args.switch_s,
        train_tokens_per_gpu_s=args.train_tok_per_gpu,
        train_step_overhead_s=args.train_overhead,
        kv_bytes_per_token=args.kv_kib_per_token * 1024, kv_transfer_bandwidth=args.kv_gbps * 1e9)

    def workload_of(tail: float) -> Workload:
        return Workload(
            lengths=LogNormalLengths(median=args.median, tail_ratio=tail, max_length=args.max_len),
            prompt_tokens=args.prompt_len, group_size=args.group_size,
            batch_groups=args.batch_prompts, group_correlation=args.group_correlation)

    workload = workload_of(args.tail_ratio)
    t_start = time.perf_counter()
    print("SIMULATION: discrete-event model of colocated sync, one-step with an NCCL weight "
          "sync, and laminar. Simulated engine and simulated training step; no model runs, "
          "no GPU is used.")
    print("Decisions are the project's: laminar_rollout.scheduling (plan_dispatch, "
          "plan_barrier, required_version), laminar_rollout.repack.plan_repack, "
          "TrajectoryLedger.")
    model = base
    if args.gen_share:
        model, gen, step = calibrate(base, workload, args, args.scales[0], args.gen_share)
        print(f"Calibration: colocated sync at {args.scales[0]} GPUs generates for {gen:.0f} s "
              f"a step; a trainer at {model.train_tokens_per_gpu_s:,.0f} tokens/s/GPU makes "
              f"that {args.gen_share:.0%} of a {step:.0f} s step (paper: ~83% for math).")
    print("Time model:")
    for line in model.describe(workload=workload):
        print("  " + line)
    print(f"  laminar repack {'off' if args.no_repack else 'on'}, staleness bound "
          f"{args.max_staleness}, waiting bound {args.max_waiting}; one-step and laminar at the best rollout share of "
          f"{', '.join(f'{f:g}' for f in args.fractions)}; seed {args.seed}")
    print()
    print("Assumptions (every number the result depends on, with its source):")
    for name, value, source in assumptions(model, workload, args):
        print(f"  {name:<18} {value:<46} {source}")
    print()
    print(_HEADER + "  split")
    everything, ratios = [], []

    def on_row(r, split: str) -> None:
        print(_row(r) + f"  {split}", flush=True)
        everything.append(r.key() | {"wall_s": r.wall_s, "split": split})

    for gpus in args.scales:
        out = run_scale(gpus, model, workload, args, on_row)
        ratios.append({"gpus": gpus, "laminar/sync": out["laminar/sync"],
                       "laminar/one-step": out["laminar/one-step"],
                       "one-step/sync": out["one-step/sync"],
                       "one-step split": out["one-step_split"],
                       "laminar split": out["laminar_split"],
                       "sweep": {f"{m} {f:g}": r.throughput_tok_s
                                 for (m, f), r in out["sweep"].items()}})
    print("  (train tok/s: consumed by the trainer; gen tok/s: generated; busy: worker time "
          "decoding or prefilling; gen'g: workers that generated at all; slot / kv: mean use; "
          "t-idle: trainer idle; wait/pull: weight sync or fetch + load per version, wait%: "
          "its share of worker time; split: rollout share of the GPUs, all = colocated)")
    print()
    print("Split sweep (trainer tokens/s by rollout share; the best is used):")
    for r in ratios:
        cells = "  ".join(f"{k} {v:,.0f}" for k, v in r["sweep"].items())
        print(f"  {r['gpus']:>5} GPUs: {cells}")
    print()
    print("Speedup (trainer throughput ratios, simulated side by side in this run):")
    print(" GPUs  laminar/sync  laminar/one-step  one-step/sync  (best splits: one-step, laminar)")
    for r in ratios:
        print(f"{r['gpus']:>5}  {r['laminar/sync']:>11.2f}x  {r['laminar/one-step']:>15.2f}x  "
              f"{r['one-step/sync']:>12.2f}x  ({r['one-step split']:g}, {r['laminar split']:g})")
    print(f"Paper (Laminar, arXiv 2510.12633; real clusters up to 1024 GPUs): "
          f"{PAPER_OVER_SYNC_MEAN}x over synchronous on average, up to {PAPER_OVER_SYNC}x; "
          f"{PAPER_OVER_ONE_STEP}x over one-step staleness (math).")
    sensitivity = []
    if args.sensitivity is not None:
        print()
        print(f"Sensitivity at {args.sensitivity} GPUs (one assumption changed at a time; "
              "the trainer is recalibrated only when the share itself changes):")
        print(f"  {'assumption':<22} {'value':>8}  laminar/sync  laminar/one-step")
        base_row = run_scale(args.sensitivity, model, workload, args)
        print(f"  {'(as above)':<22} {'':>8}  {base_row['laminar/sync']:>11.2f}x  "
              f"{base_row['laminar/one-step']:>15.2f}x", flush=True)
        import dataclasses

        variants = [("p99/median length", v, model, workload_of(v)) for v in (5.0, 20.0)]
        variants += [("group correlation", v, model, dataclasses.replace(
            workload, group_correlation=v)) for v in (0.0, 0.9)]
        variants += [("colocated switch s", v, dataclasses.replace(model, colocate_switch_s=v),
                      workload) for v in (2.0, 10.0)]
        if args.gen_share:
            for v in (0.7, 0.9):
                m2, _, _ = calibrate(base, workload, args, args.scales[0], v)
                variants.append(("generation share", v, m2, workload))
        for name, value, m2, wl2 in variants:
            row = run_scale(args.sensitivity, m2, wl2, args)
            sensitivity.append({"assumption": name, "value": value,
                                "laminar/sync": row["laminar/sync"],
                                "laminar/one-step": row["laminar/one-step"]})
            print(f"  {name:<22} {value:>8g}  {row['laminar/sync']:>11.2f}x  "
                  f"{row['laminar/one-step']:>15.2f}x", flush=True)
    _plot(args.out, ratios, f"sync colocated, one-step NCCL, best splits; "
          f"{workload.batch_trajectories} trajectories/batch, staleness bound "
          f"{args.max_staleness}")
    print(f"plot: {args.out}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"ratios": ratios, "sensitivity": sensitivity, "runs": everything,
                       "assumptions": assumptions(model, workload, args)}, fh, indent=1,
                      default=str)
        print(f"metrics: {args.json}")
    print(f"simulated in {time.perf_counter() - t_start:.1f} s wall (SIMULATION, not a "
          "measurement of real hardware)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
