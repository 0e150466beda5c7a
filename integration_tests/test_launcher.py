"""`laminar up` (local backend): a whole stack from one job file, to a trained step and back down."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import yaml

from laminar_common.processes import ChildProcess

REPO = Path(__file__).resolve().parents[1]


def test_laminar_up_local_reaches_trained_steps_and_shuts_down(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "simulated.yaml").read_text())
    job["run_dir"] = str(tmp_path / "run")
    job["tiers"]["trainer"]["config"]["total_steps"] = 3
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    up = ChildProcess("up", [sys.executable, "-m", "laminar_common.cli", "up", str(path)],
                      str(tmp_path / "up.log"), cwd=str(tmp_path))
    up.wait_for_line(r"trainer: STEP 3 ", 180)
    up.wait_for_line(r"trainer exited with \[0\]", 60)
    assert up.proc.wait(60) == 0
    up.wait_for_line(r"plot: .*timeline\.png", 60)
    summary = json.loads((tmp_path / "run" / "trainer" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["simulated_step"] is True
    assert summary["tokens_consumed"] > 0
    assert max(int(k) for k in summary["staleness_hist"]) <= 2 + 1
    # Every tier process was stopped: none of the pids in the log is alive any more.
    pids = [int(line.split("(pid ")[1].split(")")[0]) for line in up.lines if "(pid " in line]
    assert len(pids) >= 5
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or \
            "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    shutil.rmtree(tmp_path / "run" / "etcd", ignore_errors=True)


def _pids_with(fragment: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if fragment in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_laminar_up_ray_backend_restarts_a_killed_replica(tmp_path):
    import os
    import signal

    import pytest

    pytest.importorskip("ray")
    job = yaml.safe_load((REPO / "examples" / "simulated.yaml").read_text())
    job["job"] = "simray"
    job["run_dir"] = str(tmp_path / "run")
    job["tiers"]["trainer"]["config"]["total_steps"] = 40
    # One relay per Ray node (one node here), pinned to it; named by member_id.
    job["tiers"]["relay"].update(replicas=-1, id_field="member_id")
    job["tiers"]["relay"]["config"].pop("member_id")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    up = ChildProcess("up", [sys.executable, "-m", "laminar_common.cli", "up", str(path),
                             "--backend", "ray", "--num-cpus", "2"],
                      str(tmp_path / "up.log"), cwd=str(tmp_path))
    try:
        up.wait_for_line(r"started relay-0 as a Ray actor", 120)
        up.wait_for_line(r"trainer: STEP 3 ", 240)
        assert not any("started relay-1" in line for line in up.lines)
        victims = _pids_with("laminar-worker-0-")
        assert victims, "no worker-0 process found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        up.wait_for_line(r"trainer: STEP 20 ", 240)
        restarted = [p for p in _pids_with("laminar-worker-0-") if p not in victims]
        assert restarted, "Ray did not start worker-0 again"
        up.wait_for_line(r"trainer exited with 0", 240)
        assert up.proc.wait(120) == 0
    finally:
        up.stop(grace_s=60)
