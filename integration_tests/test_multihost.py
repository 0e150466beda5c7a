"""Issue 15: a stack spread over hosts, emulated on this machine.

Three hosts are three loopback addresses (127.0.0.2, .3, .4), each with its
own ``host_id``. Every tier binds only its own host's address (no tier binds
127.0.0.1 or a wildcard), so a member that advertised loopback, its bind
address of another host, or the wrong host would be unreachable and the job
would not finish; a worker that read weights from another host's relay shows
up in the relays' fetch counters. etcd (embedded) listens on host A only.

- ``test_three_hosts_...``: ``laminar up`` with authentication on everywhere
  (``laminar keys --split --host`` for the three addresses): host A runs etcd,
  a relay, the manager and the trainer; hosts B and C a relay and a worker
  each. The job ends with every prompt trained exactly once, every member's
  etcd record advertises its own host's address, and each worker's fetches
  are counted by its own host's relay only.
- ``test_a_job_spanning_hosts_without_auth_is_refused``: the same job without
  ``auth.dir`` is refused before anything starts, naming the tiers; with
  ``auth: {insecure: true}`` it passes that check with a loud warning.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from conftest import metric_value, scrape_metrics
from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.processes import ChildProcess
from laminar_common.roles import Extra

HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}
STEPS = 6
GROUPS, GROUP_SIZE = 4, 4


def _job(run_dir: Path, auth: dict | None) -> dict:
    """Host A: etcd, relay-a, manager, trainer; hosts B, C: a relay and a worker each."""

    def on(host: str, tier: str, **config) -> dict:
        listen = {"bind_host": HOSTS[host]} if tier != "worker" else {}
        a = auth if auth is None or "dir" not in auth else \
            {"dir": f"{auth['dir']}/{'rollout' if tier in ('manager', 'worker') else tier}"}
        return {"host_id": f"host-{host}", **listen, **({"auth": a} if a else {}), **config}

    tiers: dict = {}
    for h in HOSTS:
        tiers[f"relay-{h}"] = {
            "command": ["laminar-relay", "serve"],
            "config": on(h, "relay", member_id=f"relay-{h}", metrics={"port": 0},
                         store={"max_bytes": 64 << 20})}
    tiers["manager"] = {
        "command": ["laminar-rollout", "manage"], "ready": "manager",
        "config": on("a", "manager", prompts="{run_dir}/train.jsonl", group_size=GROUP_SIZE,
                     batch_groups=GROUPS, mode="laminar", sampling={"max_tokens": 64})}
    for h in ("b", "c"):
        tiers[f"worker-{h}"] = {
            "command": ["laminar-rollout", "serve"],
            "config": on(h, "worker", worker_id=f"worker-{h}", report_interval_s=0.2,
                         engine={"type": "simulated", "max_batch": 8, "median_length": 12,
                                 "max_length": 64, "step_time_base": 0.002,
                                 "step_time_per_seq": 0.0002})}
    tiers["trainer"] = {
        "command": ["laminar-trainer", "run"],
        "config": on("a", "trainer", trainer_id="trainer",
                     simulate={"step_s": 0.3, "weight_bytes": 1 << 20}, batch_groups=GROUPS,
                     total_steps=STEPS, run_dir="{run_dir}/trainer")}
    setup = [["laminar", "prompts", "--task", "sort", "--n", "500", "--split", "train",
              "--out", "{run_dir}/train.jsonl"]]
    if auth and "dir" in auth:
        setup.append(["laminar", "keys", "--split", "--out", auth["dir"],
                      *[a for ip in HOSTS.values() for a in ("--host", ip)]])
    return {"job": "threehosts", "run_dir": str(run_dir),
            "etcd": {"embedded": True, "host": HOSTS["a"], "ttl_s": 3},
            "setup": setup, "tiers": tiers, "wait_for": "trainer", "timeout_s": 300}


def _up(tmp_path: Path, job: dict) -> ChildProcess:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return ChildProcess("up", [sys.executable, "-m", "laminar_common.launch.cli", "up",
                               str(path)], str(tmp_path / "up.log"), cwd=str(tmp_path))


def test_three_hosts_train_exactly_once_and_read_weights_from_their_own_hosts_relay(tmp_path):
    run_dir = tmp_path / "run"
    up = _up(tmp_path, _job(run_dir, {"dir": "{run_dir}/keys"}))
    try:
        up.wait_for_line(r"this job spans hosts \(.*3 host ids", 60)
        endpoint = up.wait_for_line(r"etcd at (\S+)", 120).group(1)
        assert endpoint == f"{HOSTS['a']}:{endpoint.rsplit(':', 1)[1]}", endpoint
        up.wait_for_line(r"trainer: STEP 3 ", 240)
        coord = EtcdCoordinator([endpoint], "threehosts", connect_timeout_s=10)
        try:
            members = coord.members()
        finally:
            coord.close()
        # Every listening member advertises its own host's address, every member its host id.
        for mid, host in (("relay-a", "a"), ("relay-b", "b"), ("relay-c", "c"),
                          ("manager", "a"), ("trainer", "a")):
            rec = members[mid]
            assert rec.address.split("//")[-1].rsplit(":", 1)[0] == HOSTS[host], (mid, rec)
            assert rec.host_id == f"host-{host}", (mid, rec.host_id)
        for h in ("b", "c"):
            assert members[f"worker-{h}"].host_id == f"host-{h}"
        # Each worker read weights from its own host's relay, and from no other.
        fetches = {h: scrape_metrics(members[f"relay-{h}"].extra[Extra.METRICS]) for h in HOSTS}
        for h in HOSTS:
            for w in ("b", "c"):
                n = metric_value({k: v for k, v in fetches[h].items()
                                  if f'reader="worker-{w}"' in k},
                                 "laminar_relay_fetches_total")
                assert (n > 0) == (h == w), (f"relay-{h}", f"worker-{w}", n, fetches[h])
        up.wait_for_line(r"trainer exited with \[0\]", 240)
        assert up.proc.wait(120) == 0
    finally:
        up.stop(grace_s=30)
    trainer_dir = run_dir / "trainer"
    consumed = [i for line in (trainer_dir / "consumed.jsonl").read_text().splitlines()
                if line.strip() for i in json.loads(line)["ids"]]
    assert len(consumed) == len(set(consumed)) == STEPS * GROUPS * GROUP_SIZE
    summary = json.loads((trainer_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS


def test_a_job_spanning_hosts_without_auth_is_refused(tmp_path):
    up = _up(tmp_path, _job(tmp_path / "run", None))
    assert up.proc.wait(60) != 0
    up.wait_for_line(r"this job spans hosts \(.*3 host ids.*\) but relay-a, relay-b, relay-c, "
                     r"manager, worker-b, worker-c, trainer run without authentication", 10)
    assert not (tmp_path / "run" / "logs" / "relay-a.log").exists()

    insecure = tmp_path / "insecure"
    insecure.mkdir()
    job = _job(insecure / "run", {"insecure": True})
    job["tiers"]["trainer"]["config"]["total_steps"] = 1
    up = _up(insecure, job)
    try:
        up.wait_for_line(r"WARNING: this job spans hosts .* run WITHOUT AUTHENTICATION", 60)
    finally:
        up.stop(grace_s=30)
