"""Exactly-once state over a long run: memory and checkpoint size, compacted vs not.

Drives the project's own bookkeeping with SIMULATED trajectories (no engine, no
training step, no sockets): the manager's ``TrajectoryLedger`` (groups created,
dispatched, finished and durably acked, its state file written as
``ManagerService`` writes it) and the trainer's ``ExperienceBuffer`` (the same
trajectories added, consumed by steps, the trainer's checkpoint ``trainer.json``
written as ``AckAfterCheckpoint.checkpoint`` writes it). Each role runs in its own
child process so its resident memory (VmRSS, minus the process's RSS before the
run) is its own.

Two modes side by side, same workload:

- ``compacted``: what Laminar does now. The ledger keeps ``ledger_keep_groups``
  settled groups behind its watermark; trajectories carry ``group_seq`` and the
  watermark ``settled_below`` (lagging by ``--in-flight`` groups, the run-ahead
  window) and the trainer keeps per-id records only above it.
- ``unbounded``: no watermark and no compaction (the state before issue 12):
  every id ever consumed stays in memory and in every checkpoint.

Reported at 10k and 100k trajectories (``--points``): resident memory of each
role, the manager's state file size and the trainer's checkpoint size.

    python tools/bench_exactly_once.py --points 10000 100000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _run_manager(args: argparse.Namespace, out: Path) -> list[dict]:
    from laminar_common.codec import SamplingSpec
    from laminar_rollout.config import ManagerConfig
    from laminar_rollout.ledger import TrajectoryLedger
    from laminar_rollout.prompts import PromptRecord

    keep = (args.keep_groups if args.keep_groups is not None else
            ManagerConfig.model_fields["ledger_keep_groups"].default) \
        if args.mode == "compacted" else None
    ledger = TrajectoryLedger(keep)
    sampling = SamplingSpec(max_tokens=64)
    base, rows, g, done = _rss_mb(), [], 0, 0
    points = sorted(args.points)
    state = out / "manager_state.json"
    inflight: list[list[str]] = []
    while points:
        ids = ledger.add_group(PromptRecord(f"prompt-{g:09d}", f"question {g}", {"answer": "1"}),
                               args.group_size, sampling)
        g += 1
        ledger.take_pending("worker-0", 0, args.group_size)
        for tid in ids:
            ledger.mark_done(tid, "worker-0")
        inflight.append(ids)
        if len(inflight) > args.in_flight:  # the trainer acks what it consumed long ago
            for tid in inflight.pop(0):
                ledger.mark_acked(tid)
        done += args.group_size
        if done >= points[0]:
            points.pop(0)
            t0 = time.perf_counter()
            state.write_text(json.dumps({"ledger": ledger.snapshot()}))
            rows.append({"trajectories": done, "rss_mb": _rss_mb() - base,
                         "state_bytes": state.stat().st_size,
                         "entries": len(ledger.entries),
                         "write_s": time.perf_counter() - t0})
    return rows


def _run_trainer(args: argparse.Namespace, out: Path) -> list[dict]:
    from laminar_common.codec import Trajectory
    from laminar_trainer.buffer import ExperienceBuffer
    from laminar_trainer.checkpoint import TrainerState, save_checkpoint

    buf = ExperienceBuffer(capacity=1 << 30)
    base, rows, g, done, step = _rss_mb(), [], 0, 0, 0
    points = sorted(args.points)
    while points:
        watermark = max(0, g - args.in_flight) if args.mode == "compacted" else -1
        seq = g if args.mode == "compacted" else -1
        for i in range(args.group_size):
            buf.add(Trajectory(
                trajectory_id=f"prompt-{g:09d}#{i}", prompt_id=f"prompt-{g:09d}",
                group_size=args.group_size, sample_index=i, worker_id="worker-0",
                policy_version=0, prompt_token_ids=(1, 2, 3), response_token_ids=(4, 5),
                behaviour_logprobs=(-0.1, -0.2), reward=1.0, finish_reason="stop",
                group_seq=seq, settled_below=watermark))
        g += 1
        done += args.group_size
        if buf.ready_groups() >= args.batch_groups:
            buf.take(args.batch_groups, 0)
            step += 1
        if done >= points[0]:
            points.pop(0)
            kept, mark, failed = buf.consumed_state()
            t0 = time.perf_counter()
            path = save_checkpoint(out / "ckpt", None, None, None, TrainerState(
                step, step, [i for i, _ in kept], 0, consumed_seqs=[q for _, q in kept],
                settled_below=mark, failed=failed), keep=1)
            rows.append({"trajectories": done, "rss_mb": _rss_mb() - base,
                         "checkpoint_bytes": (path / "trainer_state" / "trainer.json").stat().st_size,
                         "ids_kept": len(kept), "write_s": time.perf_counter() - t0})
    return rows


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", type=int, nargs="+", default=[10_000, 100_000],
                   help="report after this many trajectories")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-groups", type=int, default=32, help="groups a trainer step takes")
    p.add_argument("--in-flight", type=int, default=256,
                   help="groups between the newest and the watermark (the run-ahead window)")
    p.add_argument("--keep-groups", type=int, default=None,
                   help="the manager's ledger_keep_groups (default: ManagerConfig's)")
    p.add_argument("--role", choices=("manager", "trainer"), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("compacted", "unbounded"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _child(args: argparse.Namespace) -> None:
    out = Path(args.out)
    rows = (_run_manager if args.role == "manager" else _run_trainer)(args, out)
    print(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.role:
        _child(args)
        return 0
    print("SIMULATED trajectories through the real TrajectoryLedger and ExperienceBuffer "
          f"(group size {args.group_size}, {args.batch_groups} groups a step, watermark "
          f"{args.in_flight} groups behind the newest); one child process per role and mode.")
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="laminar-bench-eo-") as tmp:
        for role in ("manager", "trainer"):
            for mode in ("compacted", "unbounded"):
                out = Path(tmp) / f"{role}-{mode}"
                out.mkdir()
                cmd = [sys.executable, __file__, "--role", role, "--mode", mode, "--out",
                       str(out), "--group-size", str(args.group_size), "--batch-groups",
                       str(args.batch_groups), "--in-flight", str(args.in_flight),
                       "--points", *map(str, args.points)]
                if args.keep_groups is not None:
                    cmd += ["--keep-groups", str(args.keep_groups)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                      env=dict(os.environ, PYTHONHASHSEED="0"))
                results[role, mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    size_key = {"manager": "state_bytes", "trainer": "checkpoint_bytes"}
    print(f"{'role':8} {'trajectories':>12} {'mode':10} {'RSS MB':>8} {'state/ckpt KB':>14} "
          f"{'ids kept':>9}")
    for role in ("manager", "trainer"):
        for i, point in enumerate(sorted(args.points)):
            for mode in ("compacted", "unbounded"):
                r = results[role, mode][i]
                kept = r.get("entries", r.get("ids_kept"))
                print(f"{role:8} {point:>12,} {mode:10} {r['rss_mb']:>8.1f} "
                      f"{r[size_key[role]] / 1024:>14.1f} {kept:>9,}")
        first, last = results[role, "compacted"][0], results[role, "compacted"][-1]
        full = results[role, "unbounded"][-1]
        print(f"  {role}: compacted {size_key[role]} {last[size_key[role]] / first[size_key[role]]:.2f}x "
              f"from {sorted(args.points)[0]:,} to {sorted(args.points)[-1]:,} trajectories "
              f"(unbounded {full[size_key[role]] / results[role, 'unbounded'][0][size_key[role]]:.2f}x); "
              f"at {sorted(args.points)[-1]:,}: unbounded / compacted size "
              f"{full[size_key[role]] / last[size_key[role]]:.1f}x, RSS "
              f"{full['rss_mb']:.1f} vs {last['rss_mb']:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
