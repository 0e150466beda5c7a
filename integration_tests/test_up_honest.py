"""An honest `laminar up` (issue 13): it checks every tier's config before it starts
anything, names a tier that exits early with its log's tail and stops the rest, never
reports an earlier launch's metrics, and every tier shares one default job name.

Real tier CLIs, a real embedded etcd, the simulated engine and training step.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _job(tmp_path: Path, name: str = "honest") -> dict:
    job = yaml.safe_load((REPO / "examples" / "simulated.yaml").read_text())
    job["job"] = name
    job["run_dir"] = str(tmp_path / "run")
    job["tiers"]["trainer"]["config"]["total_steps"] = 2
    return job


def _up(tmp_path: Path, job: dict, timeout_s: float) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))  # tiers start in file order
    return subprocess.run([sys.executable, "-m", "laminar_common.launch.cli", "up", str(path)],
                          capture_output=True, text=True, timeout=timeout_s, cwd=str(tmp_path))


def _processes_naming(fragment: str) -> list[int]:
    """Live (non-zombie) pids whose command line names ``fragment`` (e.g. a run dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if fragment in (proc / "cmdline").read_bytes().decode(errors="replace") and \
                    "zombie" not in (proc / "status").read_text().lower():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _started_pids(stdout: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+)\)", stdout)}


def test_a_typo_in_the_trainer_config_fails_before_anything_starts(tmp_path):
    job = _job(tmp_path)
    job["tiers"]["trainer"]["config"]["total_stepz"] = 3
    t0 = time.monotonic()
    out = _up(tmp_path, job, timeout_s=120)
    elapsed = time.monotonic() - t0
    assert out.returncode == 2, (out.stdout, out.stderr)
    err = out.stderr
    assert err.startswith("laminar up: error: 1 tier config check(s) failed (nothing was "
                          "started):"), err
    config = tmp_path / "run" / "configs" / "trainer.yaml"
    assert (f"tier trainer (trainer): config {config} (tiers.trainer.config in "
            f"{tmp_path / 'job.yaml'}) rejected by `laminar-trainer run --config {config} "
            "--print-config` (exit 2):") in err, err
    assert "total_stepz: unknown field; did you mean 'total_steps'?" in err, err
    # Nothing was set up or started: no prompts, no etcd, no tier, no launch stamp.
    run = tmp_path / "run"
    assert not (run / "train.jsonl").exists() and not (run / "etcd").exists()
    assert not (run / "launch.json").exists() and not (run / "logs").exists()
    assert "started " not in out.stdout and "etcd at" not in out.stdout
    assert _processes_naming(str(run)) == []
    print(f"laminar up refused the typo after {elapsed:.1f}s")


def test_a_tier_that_exits_early_is_named_with_its_log_tail_and_the_stack_stops(tmp_path):
    # The relay's gRPC port is taken: its config is valid, its start fails.
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    job = _job(tmp_path)
    job["tiers"]["relay"]["config"]["grpc_port"] = port
    try:
        out = _up(tmp_path, job, timeout_s=240)
    finally:
        busy.close()
    assert out.returncode == 1, (out.stdout, out.stderr)
    log = tmp_path / "run" / "logs" / "relay.log"
    started = _started_pids(out.stdout)
    assert re.search(rf"relay exited early with exit code 1 \(pid {started['relay']}\); "
                     rf"last \d+ lines of {re.escape(str(log))}:", out.stdout), out.stdout
    assert re.search(rf"^    relay\| .*cannot bind the relay gRPC server on 127\.0\.0\.1:{port}",
                     out.stdout, re.M), out.stdout
    assert "relay ended before the job did: stopping the rest of the stack" in out.stdout
    # Every process the launcher started is gone, the manager among them.
    assert "manager" in started and f"stopping manager (pid {started['manager']})" in out.stdout
    for pid in started.values():
        assert pid not in _processes_naming(str(tmp_path / "run")), (pid, out.stdout)
    assert _processes_naming(str(tmp_path / "run")) == []


def test_a_second_launch_does_not_report_the_first_launchs_metrics(tmp_path):
    job = _job(tmp_path)
    first = _up(tmp_path, job, timeout_s=240)
    assert first.returncode == 0, (first.stdout[-3000:], first.stderr)
    assert "steps: 2 (weight version 2)" in first.stdout
    metrics = tmp_path / "run" / "trainer" / "metrics.jsonl"
    assert len(metrics.read_text().splitlines()) == 2

    # The second launch into the same run dir fails before its trainer trains a step.
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    job["tiers"]["relay"]["config"]["grpc_port"] = busy.getsockname()[1]
    try:
        second = _up(tmp_path, job, timeout_s=240)
    finally:
        busy.close()
    assert second.returncode == 1, (second.stdout[-3000:], second.stderr)
    assert "steps: 2" not in second.stdout and "throughput:" not in second.stdout
    assert re.search(rf"no report: {re.escape(str(metrics))} is an earlier launch's \(last "
                     r"written .*\): the trainer wrote no step in this launch", second.stdout)
    stamp = yaml.safe_load((tmp_path / "run" / "launch.json").read_text())
    assert f"launch {stamp['launch_id']} in " in second.stdout
    # The first launch's logs are kept beside this launch's.
    assert "STEP 2 " in (tmp_path / "run" / "logs.previous" / "trainer.log").read_text()
    assert _processes_naming(str(tmp_path / "run")) == []


def test_every_tier_defaults_to_one_job_name():
    from laminar_common.launch.member import MemberConfig
    from laminar_relay.config import RelayConfig
    from laminar_rollout.config import ManagerConfig, WorkerConfig
    from laminar_trainer.config import TrainerConfig

    defaults = {model.__name__: model.model_fields["job"].default
                for model in (RelayConfig, WorkerConfig, ManagerConfig, TrainerConfig,
                              MemberConfig)}
    assert set(defaults.values()) == {"laminar"}, defaults


def test_prompts_that_run_out_are_refused_before_any_tier_starts(tmp_path):
    """A verl user's 600 prompts filled 18 of 30 steps and the job stalled silently; now
    `laminar up` refuses it after the set-up wrote the prompts, naming the numbers."""
    job = _job(tmp_path, "runsout")
    job["setup"][0][job["setup"][0].index("2000")] = "10"  # 10 prompts; 5 steps x 4 groups
    job["tiers"]["trainer"]["config"]["total_steps"] = 5
    t0 = time.monotonic()
    out = _up(tmp_path, job, timeout_s=120)
    took = time.monotonic() - t0
    assert out.returncode != 0, out.stdout[-2000:]
    text = out.stdout + out.stderr
    assert "the prompts run out at step 2 of 5" in text, text[-2000:]
    assert "total_steps 5 x batch_groups 4 = 20 groups" in text
    assert "tiers.manager.config.epochs to 2 or more" in text
    assert "started " not in out.stdout and took < 90, (took, out.stdout[-1500:])


def test_a_job_whose_every_reward_fails_stops_at_its_first_step_with_the_cause(tmp_path):
    """A reward that needs an answer on a file that keeps it under another name (here
    ``solution``; the default answer_key is ``answer``) ran a whole job to exit 0 with
    reward 0; now the trainer stops at step 1 naming the error."""
    job = _job(tmp_path, "noanswers")
    job["setup"] = [["python", "-c", "import json, sys; open(sys.argv[1], 'w').write(''.join("
                     "json.dumps({'prompt': f'sort {i}{i+1}=', 'solution': f'{i}{i+1}'}) + "
                     "'\\n' for i in range(100)))", "{run_dir}/train.jsonl"]]
    job["tiers"]["worker"]["config"]["reward"] = "exact"
    out = _up(tmp_path, job, timeout_s=240)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "trainer failed" in out.stdout, out.stdout[-3000:]
    assert re.search(r"step 1: every reward of the step failed \(16 of 16\), e\.g\. \S+ "
                     r"from worker-\d: ValueError: the 'exact' reward needs the ground truth",
                     out.stdout), out.stdout[-3000:]
    assert "STEP 1 " not in out.stdout
    assert _processes_naming(str(tmp_path / "run")) == []
