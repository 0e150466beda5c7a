"""`laminar up` (local backend): a whole stack from one job file, to a trained step and back down."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import yaml

from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.processes import ChildProcess
from laminar_common.launch.readiness import wait_ready

REPO = Path(__file__).resolve().parents[1]


def test_laminar_up_local_reaches_trained_steps_and_shuts_down(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "simulated.yaml").read_text())
    job["run_dir"] = str(tmp_path / "run")
    job["tiers"]["trainer"]["config"]["total_steps"] = 3
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    up = ChildProcess("up", [sys.executable, "-m", "laminar_common.launch.cli", "up", str(path)],
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


@pytest.mark.cost(60)
@pytest.mark.xdist_group("ray")  # one Ray cluster at a time on this machine
def test_laminar_up_ray_backend_restarts_killed_replicas_and_the_trainer_resumes(tmp_path):
    import os
    import signal

    import pytest

    pytest.importorskip("ray")
    job = yaml.safe_load((REPO / "examples" / "simulated.yaml").read_text())
    job["job"] = "simray"
    job["run_dir"] = str(tmp_path / "run")
    trainer = job["tiers"]["trainer"]
    trainer["config"].update(total_steps=40,
                             checkpoint={"dir": "{run_dir}/ckpt", "every_steps": 3})
    trainer["restart_args"] = ["--resume"]
    # One relay per Ray node (one node here), pinned to it; named by member_id.
    job["tiers"]["relay"].update(replicas=-1, id_field="member_id")
    job["tiers"]["relay"]["config"].pop("member_id")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    up = ChildProcess("up", [sys.executable, "-m", "laminar_common.launch.cli", "up", str(path),
                             "--backend", "ray", "--num-cpus", "2"],
                      str(tmp_path / "up.log"), cwd=str(tmp_path))
    try:
        up.wait_for_line(r"started relay-0 as a Ray actor", 120)
        up.wait_for_line(r"trainer: STEP 3 ", 420)  # Ray actors start slowly on 2 busy cores
        assert not any("started relay-1" in line for line in up.lines)
        victims = _pids_with("laminar-worker-0-")
        assert victims, "no worker-0 process found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        up.wait_for_line(r"trainer: STEP 20 ", 240)
        restarted = [p for p in _pids_with("laminar-worker-0-") if p not in victims]
        assert restarted, "Ray did not start worker-0 again"

        # The trainer (the tier the run waits for) crashes: Ray starts it again with
        # --resume, it goes on from its last checkpoint, and the run still ends with 0.
        victims = _pids_with("laminar-trainer-")
        assert victims, "no trainer process found"
        killed_at = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        up.wait_for_line(r"trainer crashed \(-9\); restart 1 with \['--resume'\]", 60)
        # The restarted trainer's own etcd record says where it resumed.
        endpoint = up.wait_for_line(r"etcd at (\S+)", 1).group(1)
        coord = EtcdCoordinator([endpoint], "simray", connect_timeout_s=10)
        try:
            resumed = int(wait_ready(coord, "trainer", timeout_s=240,
                                     newer_than=killed_at)[0].extra["step"])
        finally:
            coord.close()
        assert resumed >= 18 and resumed % 3 == 0
        up.wait_for_line(r"trainer exited with 0", 240)
        assert up.proc.wait(120) == 0
    finally:
        up.stop(grace_s=60)
    consumed = [i for line in (tmp_path / "run" / "trainer" / "consumed.jsonl").read_text()
                .splitlines() for i in json.loads(line)["ids"]]
    batch = job["tiers"]["trainer"]["config"]["batch_groups"] * \
        job["tiers"]["manager"]["config"]["group_size"]
    assert len(consumed) == len(set(consumed)) == 40 * batch


def _laminar(*args: str, timeout_s: float = 60):
    import subprocess

    return subprocess.run([sys.executable, "-m", "laminar_common.launch.cli", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def test_laminar_up_serves_embedded_etcd_over_mutual_tls_from_auth_dir(tmp_path):
    """One switch: with `auth.dir` from `laminar keys --etcd` in every tier, the embedded
    etcd serves https with client certificates, the tiers reach it, plaintext does not."""
    import re

    import pytest

    from laminar_common.errors import EtcdUnavailableError
    from laminar_common.etcd import EtcdCoordinator

    keys = tmp_path / "keys"
    made = _laminar("keys", "--etcd", "--out", str(keys))
    assert made.returncode == 0, made.stderr
    job = yaml.safe_load((REPO / "examples" / "simulated.yaml").read_text())
    job["job"] = "simtls"
    job["run_dir"] = str(tmp_path / "run")
    # Long enough that the run is still up while the checks below talk to its etcd.
    job["tiers"]["trainer"]["config"]["total_steps"] = 60
    for spec in job["tiers"].values():
        spec["config"]["auth"] = {"dir": str(keys)}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    up = ChildProcess("up", [sys.executable, "-m", "laminar_common.launch.cli", "up", str(path)],
                      str(tmp_path / "up.log"), cwd=str(tmp_path))
    try:
        endpoint = up.wait_for_line(r"etcd at (https://127\.0\.0\.1:\d+) \(mutual TLS", 60)[1]
        up.wait_for_line(r"trainer: STEP 2 ", 90)
        for name in ("relay", "manager", "worker-0", "worker-1", "trainer"):
            written = yaml.safe_load((tmp_path / "run" / "configs" / f"{name}.yaml").read_text())
            assert written["etcd"]["endpoints"] == [endpoint], name

        tls = {"ca_cert": str(keys / "etcd-ca.pem"), "client_cert": str(keys / "etcd-client.pem"),
               "client_key": str(keys / "etcd-client-key.pem")}
        client = EtcdCoordinator([endpoint], "simtls", connect_timeout_s=10, **tls)
        assert {"relay-0", "manager", "worker-0", "worker-1", "trainer"} <= set(client.members())
        bare = endpoint.removeprefix("https://")
        with pytest.raises(EtcdUnavailableError, match=re.escape(f"etcd at http://{bare} ")):
            EtcdCoordinator([bare], "simtls", connect_timeout_s=2)
        status = _laminar("status", "--etcd", endpoint, "--job", "simtls",
                          "--auth-dir", str(keys))
        assert status.returncode == 0, status.stderr
        # No tier serves /metrics here (metrics.port unset): `metrics=-`.
        assert re.search(r"^  trainer\s+trainer\s.* ready=yes metrics=-$", status.stdout, re.M), \
            status.stdout
        assert re.search(r"^  worker\s+worker-1\s.* ready=yes metrics=-$", status.stdout, re.M), \
            status.stdout
        assert re.search(r"^trainer: step \d+/60 ", status.stdout, re.M), status.stdout
        # The same from the run dir alone: launch.json names its etcd, job and TLS files.
        by_dir = _laminar("status", str(tmp_path / "run"))
        assert by_dir.returncode == 0, by_dir.stderr
        assert "job simtls: latest weight version" in by_dir.stdout
        assert re.search(r"^trainer: step \d+/60 ", by_dir.stdout, re.M), by_dir.stdout
        # etcd was up all along: the refusal above was TLS, not a stopped server.
        assert "trainer" in client.members()
        assert not any("trainer exited" in line for line in up.lines)
        client.close()

        up.wait_for_line(r"trainer exited with \[0\]", 120)
        assert up.proc.wait(60) == 0
    finally:
        up.stop(grace_s=30)
    summary = json.loads((tmp_path / "run" / "trainer" / "summary.json").read_text())
    assert summary["steps"] == 60


def test_laminar_up_refuses_tiers_mixing_etcd_tls_and_plaintext(tmp_path):
    import re

    from laminar_common.auth import create_keys

    with_etcd = create_keys(tmp_path / "keys", etcd_hosts=[])
    without_etcd = create_keys(tmp_path / "plain")
    job = yaml.safe_load((REPO / "examples" / "simulated.yaml").read_text())
    job["run_dir"] = str(tmp_path / "run")
    job["setup"] = []
    for tier in ("relay", "trainer"):
        job["tiers"][tier]["config"]["auth"] = {"dir": str(with_etcd)}
    job["tiers"]["manager"]["config"]["auth"] = {"dir": str(without_etcd)}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    out = _laminar("up", str(path), timeout_s=90)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "laminar up: error:" in out.stderr
    assert re.search(r"tiers relay \(auth\.dir .*\), trainer \(auth\.dir .*\) take etcd TLS",
                     out.stderr), out.stderr
    assert f"manager (auth.dir {str(without_etcd)!r} has no etcd-ca.pem)" in out.stderr
    assert "worker (no auth.dir)" in out.stderr
    assert "started " not in out.stdout and "etcd at" not in out.stdout
