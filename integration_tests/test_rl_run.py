"""Issue 5 acceptance: real RL on the tiny model, the whole stack as separate processes.

1. The README's main job (``examples/demo.yaml``, unchanged but for its run
   dir) through ``laminar up``: local etcd, a relay, the manager, two torch
   rollout workers and the trainer. Held-out greedy accuracy on the sort task
   must rise by at least 20 points over the warm start within the job's 30
   steps (fixed seeds). No simulated engine or training step anywhere.
2. The trainer on the same real model is SIGKILLed mid-run and restarted with
   ``--resume``: no trajectory is trained twice, the run continues from the
   checkpoint to its last step, and the manager's acks match what was trained.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import wait_until
from laminar_common.processes import ChildProcess

REPO = Path(__file__).resolve().parents[1]
MIN_GAIN = 0.20


def _consumed(run_dir: Path) -> list[str]:
    path = run_dir / "consumed.jsonl"
    return [i for line in path.read_text().splitlines() if line.strip()
            for i in json.loads(line)["ids"]]


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_demo_job_raises_held_out_accuracy_by_twenty_points(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    job["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(job))
    total_steps = job["tiers"]["trainer"]["config"]["total_steps"]
    up = ChildProcess("up", [sys.executable, "-m", "laminar_common.cli", "up", str(path)],
                      str(tmp_path / "up.log"), cwd=str(tmp_path))
    try:
        up.wait_for_line(r"trainer exited with \[0\]", 1200)
        assert up.proc.wait(120) == 0
    finally:
        up.stop(grace_s=10)
    run_dir = tmp_path / "run" / "trainer"
    summary = json.loads((run_dir / "summary.json").read_text())
    warm = json.loads((tmp_path / "run" / "model" / "warm_start.json").read_text())
    assert summary["simulated_step"] is False and summary["steps"] == total_steps
    before, after = summary["eval_before"], summary["eval_after"]
    print(f"held-out accuracy {before:.3f} -> {after:.3f} in {total_steps} steps "
          f"(warm start {warm['steps']} steps, demo_error_rate {warm['demo_error_rate']})")
    # The greedy policy starts mostly wrong (the warm start's noisy demonstrations).
    assert before < 0.6
    assert after - before >= MIN_GAIN, (before, after)
    consumed = _consumed(run_dir)
    batch = job["tiers"]["trainer"]["config"]["batch_groups"] * \
        job["tiers"]["manager"]["config"]["group_size"]
    assert len(consumed) == len(set(consumed)) == total_steps * batch
    max_staleness = job["tiers"]["manager"]["config"]["max_staleness"]
    assert max(int(k) for k in summary["staleness_hist"]) <= max_staleness + 1
    up.wait_for_line(r"plot: .*\.png", 60)


def _common(etcd, job: str) -> list[str]:
    return ["--set", f"job={job}", "--set", f"etcd.endpoints=[{etcd.endpoint}]",
            "--set", "etcd.ttl_s=3"]


def test_trainer_sigkill_then_resume_trains_nothing_twice(etcd, spawn, tmp_path):
    job = "rl-resume"
    model = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "laminar_trainer.cli", "warmstart", "--out", str(model),
                    "--steps", "40", "--demo-error-rate", "0.6"],
                   check=True, capture_output=True, timeout=600)
    prompts = tmp_path / "train.jsonl"
    subprocess.run([sys.executable, "-m", "laminar_common.cli", "prompts", "--n", "2000",
                    "--seed", "1", "--out", str(prompts)],
                   check=True, capture_output=True, timeout=60)
    run_dir, ckpt, state_dir = tmp_path / "trainer", tmp_path / "ckpt", tmp_path / "manager"
    spawn("relay", "laminar_relay.cli", "serve", *_common(etcd, job), "--set", "member_id=relay-0",
          "--set", "bind_host=127.0.0.1", "--set", "advertise_host=127.0.0.1")
    manager = spawn("manager", "laminar_rollout.cli", "manage", *_common(etcd, job),
                    "--set", f"prompts={prompts}", "--set", "group_size=4",
                    "--set", "batch_groups=4", "--set", "max_staleness=1",
                    "--set", "sampling.max_tokens=10", "--set", f"state_dir={state_dir}")
    manager.wait_for_line("MANAGER READY", 60)
    worker = spawn("worker", "laminar_rollout.cli", "serve", *_common(etcd, job),
                   "--set", "worker_id=worker-0", "--set", "engine.type=torch",
                   "--set", f"engine.model_dir={model}", "--set", "engine.max_batch=16",
                   "--set", "reward=laminar_rollout.rewards:synthetic_task")
    total_steps, every = 12, 3
    trainer_args = ("run", *_common(etcd, job), "--set", "trainer_id=trainer",
                    "--set", f"model_dir={model}", "--set", "batch_groups=4",
                    "--set", f"total_steps={total_steps}", "--set", f"run_dir={run_dir}",
                    "--set", f"checkpoint.dir={ckpt}", "--set", f"checkpoint.every_steps={every}")
    trainer = spawn("trainer", "laminar_trainer.cli", *trainer_args)
    trainer.wait_for_line("TRAINER READY", 120)
    assert wait_until(lambda: len(_steps(run_dir)) >= 5, 300), "training did not reach step 5"
    trainer.kill()
    killed_at = _steps(run_dir)[-1]["step"]

    trainer2 = spawn("trainer-2", "laminar_trainer.cli", *trainer_args, "--resume")
    resumed = trainer2.wait_for_line(r"TRAINER READY \S+ step=(\d+)", 120)
    resumed_step = int(resumed.group(1))
    assert 0 < resumed_step <= killed_at and resumed_step % every == 0
    trainer2.wait_for_line(r"TRAINER DONE", 600)
    assert trainer2.proc.wait(60) == 0
    assert worker.alive() and manager.alive(), "a rollout tier exited with the trainer"

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == total_steps and summary["simulated_step"] is False
    # The restarted trainer went on from the checkpoint, step by step, to the end;
    # the steps after the checkpoint that the killed one took were rolled back.
    steps = [row["step"] for row in _steps(run_dir)]
    assert steps[-(total_steps - resumed_step):] == list(range(resumed_step + 1, total_steps + 1))
    consumed = _consumed(run_dir)
    assert len(consumed) == len(set(consumed)) == total_steps * 4 * 4
    manager.stop()
    state = json.loads((state_dir / "manager_state.json").read_text())
    assert set(state["states"]["acked"]) == set(consumed)
