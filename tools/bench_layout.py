"""Process and thread layouts of one job on this machine, side by side in one invocation.

Runs ``laminar up JOB`` once per layout, one after the other, each pinned with
``taskset`` to its number of cores, with ``layout: manual`` and the layout's values
set on the command line (trainer ``threads``; the torch-engine workers' ``replicas``
and ``engine.threads``; ``engine.max_batch`` as the auto rule sets it: a step's
samples over the workers). The job's set-up runs once (its outputs are kept in the
run dir); each layout starts with no trainer, checkpoint or manager state.

Printed per layout: the 30-step window's trajectory tokens/s, the window, held-out
accuracy after, and each tier's CPU seconds; then, per core count, the fastest layout
and the one ``layout: auto`` picks (``laminar_common.launch.layout.choose_layout``)
with its ratio to the fastest. Everything is real (torch engine, trainer steps); the
figures are this machine's, then.

    python tools/bench_layout.py --job examples/demo.yaml --cores 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from laminar_common.launch.jobfile import fill_placeholders, load_job
from laminar_common.launch.layout import (
    MANAGER,
    TRAINER,
    WORKER,
    choose_layout,
    step_samples,
    tier_command,
)

_CPU = re.compile(r"CPU time over .*?: (.*); total")


def candidates(cores: int) -> list[tuple[int, int, int]]:
    """(trainer threads, workers, worker threads) tried on ``cores`` cores: the auto
    rule's pick and its neighbours (one thread or worker more or fewer)."""
    auto = choose_layout(cores)
    seen: list[tuple[int, int, int]] = []
    for t, w, wt in [(auto.trainer_threads, auto.workers, auto.worker_threads),
                     (max(1, auto.trainer_threads - 1), auto.workers, auto.worker_threads),
                     (auto.trainer_threads + 1, auto.workers, auto.worker_threads),
                     (auto.trainer_threads, auto.workers, auto.worker_threads + 1),
                     (auto.trainer_threads, auto.workers + 1, auto.worker_threads)]:
        if (t, w, wt) not in seen:
            seen.append((t, w, wt))
    return seen


def _state_dirs(job, run_dir: str) -> list[Path]:
    """The trainer's run and checkpoint dirs and the manager's state dir of ``job``."""
    subs = {"run_dir": run_dir, "job": job.job, "name": "x"}
    out = []
    for spec in job.tiers.values():
        cfg = fill_placeholders(dict(spec.config), subs)
        if tier_command(spec) == TRAINER:
            out += [Path(cfg.get("run_dir", "")), Path(cfg.get("checkpoint", {}).get("dir", ""))]
        elif tier_command(spec) == MANAGER:
            out.append(Path(cfg.get("state_dir", "")))
    return [p for p in out if str(p) not in ("", ".")]


def run_one(job_path: str, job, run_dir: str, cores: int, layout: tuple[int, int, int],
            samples: int, log: Path) -> dict:
    trainer_threads, workers, worker_threads = layout
    worker_tier = next(n for n, s in job.tiers.items() if tier_command(s) == WORKER)
    trainer_tier = next(n for n, s in job.tiers.items() if tier_command(s) == TRAINER)
    for d in _state_dirs(job, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    sets = [f"run_dir={run_dir}", "layout=manual",
            f"tiers.{trainer_tier}.config.threads={trainer_threads}",
            f"tiers.{worker_tier}.replicas={workers}",
            f"tiers.{worker_tier}.config.engine.threads={worker_threads}",
            f"tiers.{worker_tier}.config.engine.max_batch={-(-samples // workers)}"]
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:cores])
    argv = ["taskset", "-c", cpus, sys.executable, "-m",
            "laminar_common.launch.cli", "up", job_path]
    for s in sets:
        argv += ["--set", s]
    t0 = time.monotonic()
    with log.open("w") as f:
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"laminar up exited {code} for layout {layout} on {cores} cores; "
                         f"see {log}")
    text = log.read_text()
    trainer_dir = next(p for p in _state_dirs(job, run_dir) if (p / "summary.json").exists())
    summary = json.loads((trainer_dir / "summary.json").read_text())
    cpu = {}
    if (m := _CPU.search(text)) is not None:
        for part in m.group(1).split(", "):
            name, secs = part.rsplit(" ", 2)[:2]
            cpu[name] = float(secs)
    return {"cores": cores, "trainer_threads": trainer_threads, "workers": workers,
            "worker_threads": worker_threads, "tokens_per_s": summary["tokens_per_s"],
            "eval_after": summary.get("eval_after"), "cpu_s": cpu,
            "wall_s": time.monotonic() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="examples/demo.yaml")
    p.add_argument("--cores", default="1,2", help="comma-separated core counts to pin to")
    p.add_argument("--work-dir", default=None, help="run dir (default: a new temp dir)")
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    args = p.parse_args()
    cores_list = [int(c) for c in args.cores.split(",")]
    available = len(os.sched_getaffinity(0))
    if max(cores_list) > available:
        p.error(f"--cores {max(cores_list)} > the {available} this process may use")
    job = load_job(args.job)
    samples = step_samples(job)
    if samples is None:
        p.error(f"{args.job}: the manager's config does not give batch_groups and group_size")
    run_dir = str(Path(args.work_dir or tempfile.mkdtemp(prefix="bench_layout-")).resolve())
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    print(f"job {args.job}, run dir {run_dir}; real torch engine and trainer steps")
    results = []
    for cores in cores_list:
        for layout in candidates(cores):
            r = run_one(args.job, job, run_dir, cores, layout, samples,
                        Path(run_dir) / f"up-c{cores}-{'-'.join(map(str, layout))}.log")
            results.append(r)
            print(f"  {cores} core(s): trainer {layout[0]} thread(s), {layout[1]} worker(s) x "
                  f"{layout[2]} thread(s): {r['tokens_per_s']:.0f} tokens/s, held-out after "
                  f"{r['eval_after']:.3f}, CPU " + ", ".join(
                      f"{k} {v:.1f}s" for k, v in r["cpu_s"].items()), flush=True)
    print(f"\n{'cores':>5} {'fastest layout (t/w x wt)':>28} {'tokens/s':>9} "
          f"{'auto picks':>12} {'auto/fastest':>13}")
    for cores in cores_list:
        rows = [r for r in results if r["cores"] == cores]
        best = max(rows, key=lambda r: r["tokens_per_s"])
        auto = choose_layout(cores)
        pick = next(r for r in rows if (r["trainer_threads"], r["workers"],
                                        r["worker_threads"]) == (auto.trainer_threads,
                                                                 auto.workers,
                                                                 auto.worker_threads))
        label = f"{best['trainer_threads']}/{best['workers']} x {best['worker_threads']}"
        picked = f"{auto.trainer_threads}/{auto.workers} x {auto.worker_threads}"
        print(f"{cores:>5} {label:>28} {best['tokens_per_s']:>9.0f} {picked:>12} "
              f"{pick['tokens_per_s'] / best['tokens_per_s']:>12.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
