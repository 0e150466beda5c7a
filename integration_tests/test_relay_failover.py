"""Issue 40 acceptance: a master relay's death costs the training nothing measurable.

Real etcd, three relays, the manager, two workers (simulated engine) and the trainer
(simulated step, real weight publishes) as separate processes, with a long lease
(TTL 8 s). The test SIGKILLs the master relay mid-run and does not restart it. Before
the fix, a dead master stopped the job until its lease expired: the trainer's publish
failed, no new version reached the workers, the manager's staleness bound stopped
admission, and the trainer took at most ``max_staleness + 1`` more steps. Now the
relay after it in the chain sees its port refuse connections and takes over at once.

Asserted: the trainer keeps stepping while the dead master's lease would still be
alive (a count of steps in that window, not a wall-clock limit), every version made
visible after the kill reaches both live relays (but the one in flight at the kill,
which a relay receiving it from the dead master may skip), each live worker loads a version
published after the kill, and every trajectory is trained exactly once.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from conftest import read_steps, tier_args, wait_ready, wait_until
from laminar_common.etcd import EtcdCoordinator

TTL = 8
STEP_S = 0.3
JOB = "failover"
STEPS = 70


def _versions(lines: list[str], pattern: str) -> set[int]:
    return {int(m.group(1)) for line in lines if (m := re.search(pattern, line))}


@pytest.mark.cost(45)
def test_a_killed_master_relay_does_not_stop_training_for_its_lease(etcd, spawn, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"sort {i}=", "task": "sort",
                                           "answer": str(i)}) + "\n" for i in range(1000)))
    run_dir, state_dir = tmp_path / "trainer", tmp_path / "manager"
    common = tier_args(etcd, JOB, TTL)
    relays = {f"relay-{i}": spawn(f"relay-{i}", "laminar_relay.cli", "serve", *common,
                                  "--set", f"member_id=relay-{i}", "--set", "bind_host=127.0.0.1",
                                  "--set", "advertise_host=127.0.0.1") for i in range(3)}
    watch = EtcdCoordinator([etcd.endpoint], JOB, ttl_s=TTL)
    assert wait_until(lambda: len(watch.members("relay")) == 3 and watch.leader("relay-master"),
                      60), "the relays did not come up"
    manager = spawn("manager", "laminar_rollout.cli", "manage", *common,
                    "--set", f"prompts={prompts}", "--set", "group_size=2",
                    "--set", "batch_groups=2", "--set", "sampling.max_tokens=32",
                    "--set", f"state_dir={state_dir}", "--set", f"worker_timeout_s={2 * TTL}")
    wait_ready(etcd, JOB, manager, "manager")
    workers = [spawn(f"worker-{i}", "laminar_rollout.cli", "serve", *common,
                     "--set", f"worker_id=worker-{i}", "--set", "engine.type=simulated",
                     "--set", "engine.max_batch=4", "--set", "engine.median_length=8",
                     "--set", "engine.max_length=32", "--set", "engine.step_time_base=0.003",
                     "--set", "report_interval_s=0.1") for i in range(2)]
    trainer = spawn("trainer", "laminar_trainer.cli", "run", *common,
                    "--set", "trainer_id=trainer", "--set", f"simulate.step_s={STEP_S}",
                    "--set", "simulate.weight_bytes=262144", "--set", "batch_groups=2",
                    "--set", f"total_steps={STEPS}", "--set", f"run_dir={run_dir}")
    wait_ready(etcd, JOB, trainer, "trainer")
    assert wait_until(lambda: len(read_steps(run_dir)) >= 8, 90), "training did not start"

    master = watch.leader("relay-master")
    live = {name: proc for name, proc in relays.items() if name != master}
    t_kill = time.time()
    relays[master].kill()
    v_kill = watch.latest_version().version
    # The window in which the dead master's lease was still alive: before, the job
    # stood still in it after max_staleness + 1 steps (here 2).
    time.sleep(TTL)
    in_window = [r for r in read_steps(run_dir) if t_kill < r["time"] <= t_kill + TTL]
    print(f"{len(in_window)} trainer steps in the {TTL} s after the master's SIGKILL "
          f"(fault-free: about {TTL / STEP_S:.0f})")
    assert len(in_window) >= 10, [round(r["time"] - t_kill, 2) for r in in_window]
    new_master = watch.leader("relay-master")
    assert new_master in live

    trainer.wait_for_line(r"TRAINER DONE", 120)
    assert trainer.proc.wait(30) == 0
    # Every version made visible after the kill reached both live relays.
    published = {v for v in _versions(live[new_master].lines,
                                      r"published version (\d+) in etcd") if v > v_kill}
    assert published, "the new master made no version visible"
    # The version in flight through the old chain at the kill may be skipped by a relay
    # that was receiving it from the dead master (the new master offers its newest); every
    # later one reaches every live relay.
    in_flight = min(published)
    for name, proc in live.items():
        stored = _versions(proc.lines, r"stored version (\d+)")
        assert wait_until(lambda p=proc: published - {in_flight} <= _versions(
            p.lines, r"stored version (\d+)"), 20), (name, sorted(published - stored))
    for worker in workers:
        assert max(_versions(worker.lines, r"loaded weights v(\d+)")) > v_kill, worker.name
    # Exactly once.
    consumed = [i for x in (run_dir / "consumed.jsonl").read_text().splitlines()
                for i in json.loads(x)["ids"]]
    assert len(consumed) == len(set(consumed)) == STEPS * 2 * 2
    manager.stop()
    states = json.loads((state_dir / "manager_state.json").read_text())["ledger"]["states"]
    assert set(states["acked"]) == set(consumed)
    watch.close()
