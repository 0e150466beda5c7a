"""Issue 14: DAPO dynamic sampling across the manager, a worker and the trainer.

In one process, over real etcd and real ZeroMQ: the manager (laminar mode, a run-ahead
bound of one step: ``max_staleness=0``), a worker on the simulated engine, and the
trainer with a simulated step and ``buffer.dynamic_sampling``. Half the prompts score
the same reward on every sample, so half the groups teach nothing. The trainer drops
them and tells the manager, whose credit lets it create groups past its bound: without
it the run would wait for ever for groups the bound never lets the manager create.
"""

from __future__ import annotations

import collections
import json
import threading

from conftest import wait_until
from laminar_common.config import EtcdConfig
from laminar_common.etcd import make_coordinator
from laminar_common.membership import VersionRecord
from laminar_rollout.config import ManagerConfig, WorkerConfig
from laminar_rollout.engines import LogNormalLengths, SimulatedEngine
from laminar_rollout.manager import ManagerService
from laminar_rollout.tokenizer import ByteTokenizer
from laminar_rollout.worker import FetchedVersion, WorkerService
from laminar_trainer.config import TrainerConfig
from laminar_trainer.service import TrainerService

JOB = "dynamic-sampling"
PROMPTS = 24
STEPS = 4
BATCH = 2


def _reward_fn():
    """1 then 0 for the samples of an informative prompt; always 1 for a uniform one."""
    lock = threading.Lock()
    seen: collections.Counter[str] = collections.Counter()

    def reward(prompt, text, meta):
        if meta["uniform"]:
            return 1.0
        with lock:
            seen[meta["key"]] += 1
            return float(seen[meta["key"]] % 2)

    return reward


def _prompt(tid: str) -> int:
    return int(tid.split("#")[0][1:])


def test_dynamic_sampling_drops_uniform_groups_and_the_run_does_not_stall(etcd, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    # Even prompts are uniform; the first group of the run is one of them.
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"sort {i}=", "key": f"p{i}",
                                           "uniform": i % 2 == 0, "answer": "x"}) + "\n"
                               for i in range(PROMPTS)))
    etcd_cfg = EtcdConfig(endpoints=[etcd.endpoint], ttl_s=5)
    publisher = make_coordinator(etcd_cfg, JOB)
    services = []
    try:
        manager = ManagerService(ManagerConfig(
            job=JOB, etcd=etcd_cfg, prompts=str(prompts), group_size=2, batch_groups=BATCH,
            max_staleness=0, repack={"enabled": False})).start()
        services.append(manager)
        engine = SimulatedEngine(max_batch=4, step_time_base=0.001, step_time_per_seq=0.0,
                                 prefill_time_per_token=0.0,
                                 lengths=LogNormalLengths(median=6, tail_ratio=4, max_length=24),
                                 vocab_size=200, eos_token_id=0, seed=1)
        worker = WorkerService(
            WorkerConfig(job=JOB, etcd=etcd_cfg, worker_id="w0", engine={"type": "simulated"},
                         report_interval_s=0.05),
            engine, ByteTokenizer(), fetch_weights=lambda v: FetchedVersion(v, None),
            reward_fn=_reward_fn()).start()
        services.append(worker)

        def publish(version, tensors, step):  # stands in for the relay master
            publisher.publish_version(VersionRecord(version=version, trainer_step=step))

        trainer = TrainerService(TrainerConfig(
            job=JOB, etcd=etcd_cfg, trainer_id="trainer", run_dir=str(tmp_path / "run"),
            batch_groups=BATCH, total_steps=STEPS, wait_timeout_s=60,
            simulate={"step_s": 0.01, "weight_bytes": 1024},
            buffer={"dynamic_sampling": True}), publish_fn=publish).start()
        services.append(trainer)

        assert wait_until(lambda: trainer.finished.is_set() or trainer.failure is not None,
                          90), f"stalled at step {trainer.step}: {manager.summary()}"
        assert trainer.failure is None, trainer.failure
        assert wait_until(lambda: manager.ledger.filtered_groups == trainer.buffer.stats.filtered,
                          10)
    finally:
        for svc in reversed(services):
            svc.close("test over")
        publisher.close()

    rows = [json.loads(x) for x in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
    trained = [i for r in rows for i in r["ids"]]
    dropped = [i for r in rows for i in r.get("dropped", ())]
    assert len(rows) == STEPS and len(trained) == STEPS * BATCH * 2
    assert all(_prompt(t) % 2 == 1 for t in trained), trained
    assert dropped and all(_prompt(t) % 2 == 0 for t in dropped), dropped
    assert not set(trained) & set(dropped)
    filtered = trainer.buffer.stats.filtered
    assert filtered == len(dropped) // 2 and filtered >= STEPS  # the bound alone would stall
    # The manager's bound grew by exactly the credited groups, and no further.
    bound = (manager.latest + 1) * BATCH + manager.ledger.filtered_groups
    assert manager.ledger.created <= bound * 2
    assert trainer.summary()["buffer"]["filtered"] == filtered
