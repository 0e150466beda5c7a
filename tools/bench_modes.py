"""Headline benchmark: laminar vs one-step vs sync on the real stack, in one invocation.

Each mode runs the real processes — embedded etcd, a relay, the manager,
N workers and the trainer — through ``laminar up``'s local launcher, on the
same workload. Two parts are SIMULATED and the output says so: the workers'
engine (``SimulatedEngine``: decode step = a + b * active, long-tail response
lengths with p99/median = 10) and the training step (the trainer sleeps
``--step-s`` per step and publishes ``--weight-mb`` of real bytes through the
relay). Everything else (dispatch, weight pulls, repack, buffering, acks) is
the production code path.

``--workload tool`` makes every trajectory multi-turn: each of its first
``--tool-turns`` turns ends in a tool call whose latency is drawn from a
log-normal distribution (``--tool-median-s``, p99 = ``--tool-tail`` x median;
SIMULATED too: the environment sleeps, no sandbox runs), so the long tail of
a trajectory is generation plus tool waits, as in agentic RL.

Printed per mode: training throughput (trajectory tokens consumed per
second), rollout busy fraction, staleness p50/p99/max, trainer idle fraction,
weight-wait per rollout; then the ratios laminar/sync and laminar/one-step.
Saves a per-worker timeline (busy / idle / weight load) and a throughput bar
chart as PNG.

    python tools/bench_modes.py --workers 4 --steps 12
    python tools/bench_modes.py --workload tool --tool-median-s 0.2 --tool-tail 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from laminar_common.launch.jobfile import JobFile
from laminar_common.launch.local import LocalLauncher
from laminar_common.launch.report import busy_in_window, write_timeline
from laminar_examples.tasks import make_task_records, write_jsonl

MODES = ("sync", "one-step", "laminar")


def make_job(mode: str, root: Path, args: argparse.Namespace) -> JobFile:
    run = root / mode
    return JobFile.model_validate({
        "job": f"bench-{mode}",
        "run_dir": str(run),
        "etcd": {"embedded": True, "ttl_s": 3},
        "tiers": {
            "relay": {"command": ["laminar-relay", "serve"],
                      "config": {"member_id": "relay-0", "bind_host": "127.0.0.1",
                                 "advertise_host": "127.0.0.1",
                                 "store": {"max_bytes": 1 << 30}}},
            "manager": {"command": ["laminar-rollout", "manage"], "ready": "manager",
                        "config": {"prompts": str(root / "prompts.jsonl"),
                                   "group_size": args.group_size,
                                   "batch_groups": args.batch_groups, "mode": mode,
                                   "max_staleness": args.max_staleness,
                                   "max_waiting": args.max_waiting,
                                   "sampling": {"max_tokens": args.max_length},
                                   "repack": {"enabled": not args.no_repack,
                                              "interval_s": 1.0},
                                   "state_dir": str(run / "manager")}},
            "worker": {"command": ["laminar-rollout", "serve"], "replicas": args.workers,
                       "id_field": "worker_id", "ready": "worker",
                       "config": {"engine": {"type": "simulated", "max_batch": args.max_batch,
                                             "median_length": args.median,
                                             "tail_ratio": 10.0, "max_length": args.max_length,
                                             "step_time_base": args.step_a,
                                             "step_time_per_seq": args.step_b},
                                  "report_interval_s": 0.1,
                                  "stats_path": str(run / "{name}.stats.json"),
                                  **_environment(args)}},
            "trainer": {"command": ["laminar-trainer", "run"],
                        "config": {"trainer_id": "trainer",
                                   "simulate": {"step_s": args.step_s,
                                                "weight_bytes": int(args.weight_mb * 2**20)},
                                   "batch_groups": args.batch_groups,
                                   **_trainer_buffer(args),
                                   "total_steps": args.steps, "run_dir": str(run / "trainer")}},
        },
        "wait_for": "trainer",
        "timeout_s": args.timeout,
    })


def _trainer_buffer(args: argparse.Namespace) -> dict:
    """``--drop-staler-than N``: the trainer's buffer drops groups staler than N."""
    if args.drop_staler_than is None:
        return {}
    return {"buffer": {"policy": "staleness", "max_staleness": args.drop_staler_than,
                       "stale_action": "drop"}}


def _environment(args: argparse.Namespace) -> dict:
    """The workers' ``environment`` config of ``--workload tool`` ({} for single turns)."""
    if args.workload != "tool":
        return {}
    return {"environment": {
        "type": "simulated", "max_turns": args.tool_turns + 1,
        "max_tokens_per_turn": args.max_length,
        "max_total_tokens": (args.tool_turns + 1) * args.max_length + 64 * args.tool_turns,
        "tool_timeout_s": 60.0, "workers": args.max_batch,
        "options": {"median_s": args.tool_median_s, "tail_ratio": args.tool_tail,
                    "tool_turns": args.tool_turns}}}


def percentile(hist: dict[int, int], q: float) -> int:
    total = sum(hist.values())
    seen = 0
    for k in sorted(hist):
        seen += hist[k]
        if seen >= q * total:
            return k
    return max(hist) if hist else 0


def collect(mode: str, root: Path, args) -> dict:
    run = root / mode
    summary = json.loads((run / "trainer" / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "trainer" / "metrics.jsonl").read_text().splitlines()]
    t1 = rows[-1]["time"]
    t0 = rows[0]["time"] - rows[0]["step_s"] - rows[0]["wait_s"]
    workers = [json.loads(p.read_text()) for p in sorted(run.glob("worker-*.stats.json"))]
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    return {
        "mode": mode, "tokens_per_s": summary["tokens_per_s"],
        "busy": statistics.fmean(busy_in_window(w, t0, t1) for w in workers) if workers else 0,
        "stale_p50": percentile(hist, 0.5), "stale_p99": percentile(hist, 0.99),
        "stale_max": max(hist) if hist else 0, "trainer_idle": summary["trainer_idle_fraction"],
        "weight_wait": statistics.fmean(w["weight_wait_s"] for w in workers) if workers else 0,
        "dropped_stale": summary.get("buffer", {}).get("dropped_stale", 0),
        "workers": workers, "window": (t0, t1),
    }


def plot(results: list[dict], out: Path) -> list[Path]:
    timeline = write_timeline([(r["mode"], r["workers"], r["window"]) for r in results],
                              out / "timeline.png", " — simulated engine and training step")
    if timeline is None:
        return []
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([r["mode"] for r in results], [r["tokens_per_s"] for r in results],
           color=["tab:grey", "tab:blue", "tab:green"][: len(results)])
    ax.set_ylabel("trajectory tokens consumed / s")
    ax.set_title("training throughput (simulated engine + step)")
    fig.tight_layout()
    bars = out / "throughput.png"
    fig.savefig(bars, dpi=90)
    plt.close(fig)
    return [timeline, bars]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4, help="rollout workers")
    p.add_argument("--steps", type=int, default=12, help="trainer steps per mode")
    p.add_argument("--batch-groups", type=int, default=4, help="groups per trainer step")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-batch", type=int, default=8, help="decode slots per worker")
    p.add_argument("--median", type=int, default=24, help="median response length (tokens)")
    p.add_argument("--max-length", type=int, default=480, help="response length cap")
    p.add_argument("--step-a", type=float, default=0.004, help="decode step base time (s)")
    p.add_argument("--step-b", type=float, default=0.0004, help="decode step time per sequence")
    p.add_argument("--step-s", type=float, default=0.3, help="simulated training step (s)")
    p.add_argument("--weight-mb", type=float, default=8.0, help="published weights (MiB)")
    p.add_argument("--max-staleness", type=lambda v: None if v.lower() == "none" else int(v),
                   default=2, help="laminar-mode run-ahead bound (ManagerConfig.max_staleness; "
                                   "'none': off)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="laminar mode: no new group while this many batches of finished "
                        "trajectories wait for the trainer (ManagerConfig.max_waiting)")
    p.add_argument("--drop-staler-than", type=int, default=None, metavar="N",
                   help="the trainer drops groups staler than N (buffer.policy staleness, "
                        "stale_action drop); the dropped count is printed")
    p.add_argument("--no-repack", action="store_true", help="turn dynamic repack off")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    p.add_argument("--out", default="runs/bench_modes", help="output directory")
    p.add_argument("--timeout", type=float, default=600, help="per-mode time limit (s)")
    p.add_argument("--workload", choices=("single", "tool"), default="single",
                   help="single-turn completions, or multi-turn with simulated tool calls")
    p.add_argument("--tool-turns", type=int, default=2, help="tool calls per trajectory (tool)")
    p.add_argument("--tool-median-s", type=float, default=0.2,
                   help="median tool latency in seconds (tool)")
    p.add_argument("--tool-tail", type=float, default=10.0,
                   help="tool latency p99 / median (tool)")
    args = p.parse_args()
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "prompts.jsonl", make_task_records("sort", 5000, 0))
    print("SIMULATED: engine (decode a + b*batch, long-tail lengths p99/median=10) and "
          "training step (sleep); real etcd, relay, manager, workers, trainer processes.")
    if args.workload == "tool":
        print(f"SIMULATED tool calls: {args.tool_turns} a trajectory, latency log-normal with "
              f"median {args.tool_median_s}s and p99/median {args.tool_tail} (the "
              "environment sleeps; no sandbox runs)")
    results = []
    for mode in args.modes.split(","):
        t = time.monotonic()
        code = LocalLauncher(make_job(mode, root, args), echo=False).run()
        if code != 0:
            print(f"{mode}: the run failed (exit {code}); logs in {root / mode / 'logs'}")
            return 1
        results.append(collect(mode, root, args))
        print(f"  {mode}: done in {time.monotonic() - t:.0f}s", flush=True)
    print(f"\n{'mode':<10} {'tokens/s':>9} {'busy':>6} {'stale p50/p99/max':>18} "
          f"{'trainer idle':>12} {'weight wait/rollout':>20} {'stale groups dropped':>21}")
    for r in results:
        print(f"{r['mode']:<10} {r['tokens_per_s']:>9.1f} {r['busy']:>6.2f} "
              f"{r['stale_p50']:>8}/{r['stale_p99']}/{r['stale_max']:<6} "
              f"{r['trainer_idle']:>12.2f} {r['weight_wait']:>18.3f} s "
              f"{r['dropped_stale']:>21}")
    by = {r["mode"]: r for r in results}
    if "laminar" in by:
        for other in ("sync", "one-step"):
            if other in by:
                print(f"laminar/{other} throughput ratio: "
                      f"{by['laminar']['tokens_per_s'] / by[other]['tokens_per_s']:.2f}x")
    for path in plot(results, root):
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
