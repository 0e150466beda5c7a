"""Issue 4 acceptance: real etcd, a relay, the manager and workers as separate processes.

Workers run the simulated engine (so the test is fast); the weights they pull
are real bytes published through the relay. The test stands in for the
trainer: it receives trajectories on a PULL socket registered in etcd, acks
them, and publishes a new weight version mid-run.
"""

from __future__ import annotations

import json
import time

from conftest import wait_ready, wait_until
from laminar_common.codec import Ack, Trajectory
from laminar_common.etcd import EtcdCoordinator
from laminar_common.membership import MemberRecord
from laminar_common.relay.client import RelayClient
from laminar_common.transport import ZmqPullReceiver, ZmqPushSender

TTL = 3
JOB = "rollout-itest"
MAX_BATCH = 4


def blob(version: int, size: int = 256 * 1024):
    return [("simulated.weights", "uint8", (size,), bytes([version % 256]) * size)]


def _common(etcd):
    return ["--set", f"job={JOB}", "--set", f"etcd.endpoints=[{etcd.endpoint}]",
            "--set", f"etcd.ttl_s={TTL}"]


def test_new_version_reaches_every_worker_within_one_batch(etcd, spawn, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"id": f"p{i}", "prompt": f"sort {i % 10}{(i * 7) % 10}=", "task": "sort",
                    "answer": "x"}) + "\n" for i in range(400)))
    relay = spawn("relay", "laminar_relay.cli", "serve", *_common(etcd), "--set", "member_id=relay-0",
                  "--set", "bind_host=127.0.0.1", "--set", "advertise_host=127.0.0.1")
    coord = EtcdCoordinator([etcd.endpoint], JOB, ttl_s=TTL)
    client = RelayClient(coord, client_id="test-trainer")
    client.publish(0, blob(0))
    trainer_rx = ZmqPullReceiver(expect=Trajectory)
    coord.register(MemberRecord(member_id="trainer", role="trainer", address=trainer_rx.endpoint))

    manager = spawn("manager", "laminar_rollout.cli", "manage", *_common(etcd),
                    "--set", f"prompts={prompts}", "--set", "group_size=2",
                    "--set", "sampling.max_tokens=64", "--set", "repack.enabled=false")
    wait_ready(etcd, JOB, manager, "manager")
    workers = []
    for i in range(2):
        w = spawn(f"worker-{i}", "laminar_rollout.cli", "serve", *_common(etcd),
                  "--set", f"worker_id=worker-{i}", "--set", "engine.type=simulated",
                  "--set", f"engine.max_batch={MAX_BATCH}", "--set", "engine.median_length=8",
                  "--set", "engine.max_length=40", "--set", "engine.step_time_base=0.002",
                  "--set", "engine.step_time_per_seq=0.0002", "--set", "report_interval_s=0.1",
                  # Nothing is acked until the end: no re-send may come within the test's
                  # bounds (2 x 60 s), or the no-duplicates check below would see it.
                  "--set", "resend_after_s=600")
        workers.append(w)
    for i, w in enumerate(workers):
        wait_ready(etcd, JOB, w, "worker", f"worker-{i}")

    got: list[Trajectory] = []

    def pump(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = trainer_rx.recv(timeout_s=0.05)
            if msg is not None:
                got.append(msg)

    pump_until = lambda cond, t: wait_until(lambda: (pump(0.1), cond())[1], t)  # noqa: E731
    # Not necessarily from both workers: nothing is acked here, so v0's run-ahead budget is
    # 24 groups (48 trajectories) with these settings, and on a loaded machine the worker
    # that joins first can finish all of them (in about half a second) before the other's
    # hello. Version 1 opens a new budget, and both must then generate at it (below).
    assert pump_until(lambda: len(got) >= 40, 60), \
        f"{len(got)} trajectories arrived, from {sorted({t.worker_id for t in got})}"
    assert all(t.policy_version == 0 and t.simulated for t in got)

    published_at = len(got)
    client.publish(1, blob(1))
    assert pump_until(lambda: {t.worker_id for t in got[published_at:] if t.policy_version == 1}
                      == {"worker-0", "worker-1"}, 60), "a worker never pulled version 1"
    pump(1.0)
    for worker in ("worker-0", "worker-1"):
        after = [t.policy_version for t in got[published_at:] if t.worker_id == worker]
        first_new = after.index(1)
        # Only what was already in flight at the publish may finish at the old version.
        assert first_new <= MAX_BATCH, f"{worker}: {first_new} old trajectories after the publish"
        assert all(v == 1 for v in after[first_new:]), f"{worker} went back to v0: {after}"
    # Every trajectory arrived once (at-least-once delivery, no duplicates without faults).
    ids = [t.trajectory_id for t in got]
    assert len(ids) == len(set(ids))

    acker = ZmqPushSender(coord.members("manager")["manager"].extra["ack"])
    acker.send(Ack(trajectory_ids=tuple(ids), trainer_step=1, trainer_version=1))
    acker.close()
    assert relay.alive() and manager.alive() and all(w.alive() for w in workers)
    trainer_rx.close()
    client.close()
    coord.close()
