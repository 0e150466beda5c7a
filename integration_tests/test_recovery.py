"""Issue 12 acceptance: faults that are not clean deaths, on the real stack.

Real etcd, a relay, the manager, workers and the trainer as separate processes
(simulated engine and simulated training step, so each run is bounded to about
a minute). Each test injects one fault and finishes with every prompt trained
exactly once, checked from the trainer's consumed-id log and the manager's
ledger:

- a worker paused (SIGSTOP) for 2x the lease TTL is dropped, then taken back
  when it wakes (it generates again), and nothing it held is trained twice;
- etcd itself paused for 2x TTL: the trainer keeps stepping during the pause,
  every tier stays up, and the run finishes;
- the trainer SIGTERMed between checkpoints and restarted with --resume on the
  same fixed port: it wrote a final checkpoint, workers re-send their unacked
  outboxes to the new incarnation, metrics.jsonl has each step once;
- a trainer buffer far smaller than what workers push, and groups dropped as
  too stale: refused trajectories are re-sent and dropped ones acked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from conftest import metric_value, read_steps, scrape_metrics, tier_args, wait_ready, wait_until
from laminar_common.etcd import EtcdCoordinator

TTL = 3
STEP_S = 0.2
JOB = "recovery"


def _common(etcd):
    return tier_args(etcd, JOB, TTL)


def _prompts(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"sort {i}=", "task": "sort",
                                        "answer": str(i)}) + "\n" for i in range(n)))
    return path




def _consumed_rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines() if x]






def _worker(spawn, etcd, i: int, *extra: str):
    return spawn(f"worker-{i}", "laminar_rollout.cli", "serve", *_common(etcd),
                 "--set", f"worker_id=worker-{i}", "--set", "engine.type=simulated",
                 "--set", "engine.max_batch=4", "--set", "engine.median_length=8",
                 "--set", "engine.max_length=48", "--set", "engine.step_time_base=0.003",
                 "--set", "report_interval_s=0.1", *extra)


def _stack(etcd, spawn, tmp_path, n_prompts: int, workers: int = 2,
           manager_extra: tuple[str, ...] = (), worker_extra: tuple[str, ...] = ()):
    spawn("relay-0", "laminar_relay.cli", "serve", *_common(etcd), "--set", "member_id=relay-0",
          "--set", "bind_host=127.0.0.1", "--set", "advertise_host=127.0.0.1")
    state_dir = tmp_path / "manager"
    manager = spawn("manager", "laminar_rollout.cli", "manage", *_common(etcd),
                    "--set", f"prompts={_prompts(tmp_path, n_prompts)}", "--set", "group_size=2",
                    "--set", "batch_groups=2", "--set", "sampling.max_tokens=48",
                    "--set", f"state_dir={state_dir}", *manager_extra)
    wait_ready(etcd, JOB, manager, "manager")
    ws = [_worker(spawn, etcd, i, *worker_extra) for i in range(workers)]
    return manager, ws, state_dir


def _trainer_args(etcd, run_dir: Path, steps: int, *extra: str) -> tuple[str, ...]:
    return ("run", *_common(etcd), "--set", "trainer_id=trainer",
            "--set", f"simulate.step_s={STEP_S}", "--set", "simulate.weight_bytes=65536",
            "--set", "batch_groups=2", "--set", f"total_steps={steps}",
            "--set", f"run_dir={run_dir}", *extra)


def _start_checkpointing_trainer(etcd, spawn, tmp_path: Path, steps: int):
    """The trainer (checkpoint every 3 steps), once it has taken 4 steps."""
    run_dir = tmp_path / "trainer"
    trainer = spawn("trainer", "laminar_trainer.cli",
                    *_trainer_args(etcd, run_dir, steps, "--set", f"checkpoint.dir={tmp_path}/ck",
                                   "--set", "checkpoint.every_steps=3"))
    assert wait_until(lambda: len(read_steps(run_dir)) >= 4, 60), "training did not start"
    return trainer, run_dir


def _check_exactly_once(run_dir: Path, manager, state_dir: Path, trained: int) -> dict:
    """Consumed ids unique and as many as the steps took; the manager's acks equal
    what the trainer consumed (trained or dropped as stale); no id in two states."""
    rows = _consumed_rows(run_dir)
    consumed = [i for r in rows for i in r["ids"]]
    dropped = [i for r in rows for i in r.get("dropped", ())]
    assert len(consumed) == len(set(consumed)) == trained, (len(consumed), len(set(consumed)))
    assert not set(consumed) & set(dropped), "a stale-dropped id was also trained"
    manager.wait_for_line(r"MANAGER DRAINED", 60)
    assert manager.stop() == 0
    state = json.loads((state_dir / "manager_state.json").read_text())
    states = state["ledger"]["states"]
    everything = [t for ids in states.values() for t in ids]
    assert len(everything) == len(set(everything)), "a trajectory is in two states"
    assert set(states["acked"]) == set(consumed) | set(dropped)
    assert not states["rejected"]
    return state


def test_worker_paused_past_its_lease_is_taken_back(etcd, spawn, tmp_path):
    n_prompts, steps = 160, 80  # long enough to outlast the pause by several seconds
    manager, workers, state_dir = _stack(etcd, spawn, tmp_path, n_prompts,
                                         worker_extra=("--set", "metrics.port=0"))
    trainer, run_dir = _start_checkpointing_trainer(etcd, spawn, tmp_path, steps)
    watch = EtcdCoordinator([etcd.endpoint], JOB, ttl_s=TTL)
    url = watch.members("worker")["worker-0"].extra["metrics"]
    paused = workers[0]
    t0 = time.monotonic()
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        # Its lease runs out while it is stopped: it is gone from etcd and the manager.
        assert wait_until(lambda: "worker-0" not in watch.members("worker"), 3 * TTL)
        time.sleep(max(0.0, t0 + 2 * TTL - time.monotonic()))
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    before = metric_value(scrape_metrics(url), "laminar_worker_trajectories_total")
    # It registers again, says hello again, and is given work that it finishes.
    assert wait_until(lambda: "worker-0" in watch.members("worker"), 10)
    assert wait_until(lambda: metric_value(scrape_metrics(url), "laminar_worker_trajectories_total")
                      >= before + 4, 60), "the paused worker was never taken back"
    assert metric_value(scrape_metrics(url), "laminar_worker_rejoins_total") >= 1
    trainer.wait_for_line(r"TRAINER DONE", 180)
    assert trainer.proc.wait(30) == 0
    state = _check_exactly_once(run_dir, manager, state_dir, steps * 2 * 2)
    assert state["summary"]["workers_lost"] >= 1
    watch.close()


def test_etcd_paused_past_the_ttl_training_goes_on(etcd, spawn, tmp_path):
    n_prompts, steps = 68, 34
    # A run-ahead bound loose enough that the buffer holds several steps when etcd stops
    # (new versions cannot become visible while it is paused).
    manager, workers, state_dir = _stack(etcd, spawn, tmp_path, n_prompts,
                                         manager_extra=("--set", "max_staleness=8"))
    trainer, run_dir = _start_checkpointing_trainer(etcd, spawn, tmp_path, steps)
    t_pause = time.time()
    os.kill(etcd.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2 * TTL)
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)
    t_resume = time.time()
    during = [r for r in read_steps(run_dir) if t_pause + 0.5 <= r["time"] <= t_resume]
    print(f"steps while etcd was paused for {t_resume - t_pause:.1f}s: {len(during)}")
    # The step loop writes its status to etcd in the background: it never waited.
    assert len(during) >= 3, [r["time"] - t_pause for r in read_steps(run_dir)]
    trainer.wait_for_line(r"TRAINER DONE", 180)
    assert trainer.proc.wait(30) == 0
    assert all(w.alive() for w in workers) and manager.alive(), "a tier exited"
    rows = read_steps(run_dir)
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    print(f"max step gap {max(gaps):.2f}s")
    _check_exactly_once(run_dir, manager, state_dir, steps * 2 * 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trainer_sigterm_then_resume_on_the_same_port(etcd, spawn, tmp_path):
    n_prompts, steps = 60, 30
    manager, workers, state_dir = _stack(etcd, spawn, tmp_path, n_prompts)
    run_dir, ckpt = tmp_path / "trainer", tmp_path / "ckpt"
    listen = f"tcp://127.0.0.1:{_free_port()}"
    args = _trainer_args(etcd, run_dir, steps, "--set", f"listen={listen}",
                         "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_steps=5")
    trainer = spawn("trainer", "laminar_trainer.cli", *args)
    assert wait_until(lambda: len(read_steps(run_dir)) >= 7, 60), "training did not start"
    # Between checkpoints (5 and 10): a graceful stop checkpoints where it is.
    assert trainer.stop(grace_s=30) == 0
    stopped_at = read_steps(run_dir)[-1]["step"]
    assert (ckpt / "LATEST").read_text() == f"step-{stopped_at:08d}"
    trainer2 = spawn("trainer-2", "laminar_trainer.cli", *args, "--resume")
    resumed = wait_ready(etcd, JOB, trainer2, "trainer")
    assert resumed.address == listen and int(resumed.extra["step"]) == stopped_at
    trainer2.wait_for_line(r"TRAINER DONE", 180)
    assert trainer2.proc.wait(30) == 0
    assert [r["step"] for r in read_steps(run_dir)] == list(range(1, steps + 1))
    _check_exactly_once(run_dir, manager, state_dir, steps * 2 * 2)


def test_full_buffer_and_stale_drops_lose_nothing(etcd, spawn, tmp_path):
    """A buffer of 5 trajectories (a step takes 4; workers push far more) and groups dropped when
    staler than 0 versions: refused pushes are re-sent, dropped groups acked."""
    n_prompts = 40
    manager, workers, state_dir = _stack(
        etcd, spawn, tmp_path, n_prompts, manager_extra=("--set", "max_staleness=3"),
        worker_extra=("--set", "resend_after_s=1"))
    run_dir = tmp_path / "trainer"
    trainer = spawn("trainer", "laminar_trainer.cli",
                    *_trainer_args(etcd, run_dir, 1000, "--set", "buffer.capacity=5",
                                   "--set", "buffer.policy=staleness",
                                   "--set", "buffer.max_staleness=0",
                                   "--set", "buffer.stale_action=drop"))
    # Every trajectory is acked (refused pushes came back, dropped groups were acked
    # too) but for at most one group at the very end: a step takes two groups, and
    # stale drops can leave an odd one over.
    def settled() -> bool:
        path = state_dir / "manager_state.json"
        if not path.exists():
            return False
        counts = json.loads(path.read_text())["summary"]["ledger"]
        return counts["acked"] + counts["done"] == 2 * n_prompts and counts["done"] <= 2

    assert wait_until(settled, 240), "refused or dropped trajectories were never settled"
    assert trainer.stop(grace_s=30) == 0
    summary = json.loads((run_dir / "summary.json").read_text()) \
        if (run_dir / "summary.json").exists() else None
    rows = _consumed_rows(run_dir)
    consumed = [i for r in rows for i in r["ids"]]
    dropped = [i for r in rows for i in r.get("dropped", ())]
    print(f"trained {len(consumed)}, dropped as stale {len(dropped)}; summary {summary}")
    assert dropped, "no group was dropped as stale"
    assert len(consumed) == len(set(consumed)) and not set(consumed) & set(dropped)
    assert manager.stop() == 0
    state = json.loads((state_dir / "manager_state.json").read_text())
    states = state["ledger"]["states"]
    assert set(states["acked"]) == set(consumed) | set(dropped)
    assert len(states["done"]) <= 2 and not states["pending"] and not states["dispatched"]
    assert set(consumed) | set(dropped) | set(states["done"]) == {
        f"p{i}#{k}" for i in range(n_prompts) for k in range(2)}
    log = Path(trainer.log_path).read_text()
    assert "buffer full (1 refused so far)" in log, "the buffer never filled"


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.cost(77)
def test_chaos_soak_short_run_keeps_exactly_once(tmp_path):
    """tools/chaos.py itself, briefly: faults every few seconds on the real stack
    (simulated engine and step), then its exactly-once check from the trainer's
    consumed log and the manager's ledger."""
    import subprocess
    import sys

    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "chaos.py"), "--minutes", "0.75",
                           "--interval-s", "8", "--seed", "7", "--workers", "2", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "chaos_result.json").read_text())
    run = result["runs"]["chaos"]
    assert result["exactly_once"] is True and run["exactly_once"]["holds"]
    assert len(run["faults"]) >= 3, run["faults"]
    assert run["exactly_once"]["consumed"] > 0 and run["exactly_once"]["duplicated"] == 0


def test_exactly_once_state_stays_flat(tmp_path):
    """tools/bench_exactly_once.py: 10x the trajectories leaves the trainer's compacted
    checkpoint the same size, while the unbounded one grows with the run."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench_exactly_once.py"),
                           "--points", "3000", "30000", "--in-flight", "64",
                           "--keep-groups", "128"],
                          capture_output=True, text=True, timeout=300, check=True)
    print(proc.stdout)
    rows = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[0] in ("manager", "trainer"):
            rows[parts[0], int(parts[1].replace(",", "")), parts[2]] = float(parts[4])
    assert rows["trainer", 30000, "compacted"] <= 2 * rows["trainer", 3000, "compacted"]
    assert rows["trainer", 30000, "unbounded"] >= 8 * rows["trainer", 3000, "unbounded"]
    assert rows["manager", 30000, "compacted"] <= 1.5 * rows["manager", 3000, "compacted"]
    assert rows["manager", 30000, "unbounded"] >= 8 * rows["manager", 3000, "unbounded"]
