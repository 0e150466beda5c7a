"""Issue 19: a custom stack on the public API, run as the examples in examples/custom_stack.

Real etcd and a real relay; the example scripts run as separate processes:

- ``publish_loop.py`` (a plain PyTorch loop) publishes its state dict every few steps
  and ``fetch_engine.py`` fetches the last version into its own model: byte-identical;
  the same version reaches ``fetch_engine:make_engine``, built as a worker builds an
  ``engine: {type: custom}`` engine, through the rollout tier's own relay fetcher;
- ``my_trainer.py`` (a ``TrajectoryConsumer``) receives every trajectory of a real
  manager and worker exactly once and acks them: the manager's ledger shows them acked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import scrape_metrics, tier_args, wait_ready, wait_until
from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.processes import ChildProcess
from laminar_common.relay.client import RelayClient
from laminar_common.roles import Extra, Role
from laminar_rollout.config import CustomEngineConfig
from laminar_rollout.engines import make_engine_from_config
from laminar_rollout.relay_fetch import make_relay_fetcher

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "custom_stack"
JOB = "custom-stack"
TTL = 3
PROMPTS = 8
GROUP = 2


@pytest.fixture
def script(tmp_path):
    """Start ``python examples/custom_stack/<name>.py args...``; all stopped at teardown."""
    children: list[ChildProcess] = []

    def start(name: str, *args: str) -> ChildProcess:
        child = ChildProcess(name, [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
                             str(tmp_path / f"{name}.log"))
        children.append(child)
        return child

    yield start
    for child in children:
        child.stop(grace_s=5)


def _run(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _bytes(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for k, t in state.items()}


@pytest.fixture
def stack(etcd, spawn):
    """A relay of the job, and a coordinator + relay client that watch it."""
    relay = spawn("relay-0", "laminar_relay.cli", "serve", *tier_args(etcd, JOB, TTL),
          "--set", "member_id=relay-0", "--set", "bind_host=127.0.0.1",
          "--set", "advertise_host=127.0.0.1")
    coord = EtcdCoordinator([etcd.endpoint], JOB, ttl_s=TTL)
    client = RelayClient(coord, client_id="test")
    # Ready (its own record), then master: publishing needs a won election.
    wait_ready(etcd, JOB, relay, Role.RELAY, "relay-0")
    client.master(wait_s=60)
    yield coord, client
    client.close()
    coord.close()


def test_published_state_dict_arrives_byte_identical(etcd, stack, tmp_path, monkeypatch):
    coord, client = stack
    etcd_args = ("--etcd", etcd.endpoint, "--job", JOB)
    out = _run("publish_loop", *etcd_args, "--steps", "20", "--publish-every", "5",
               "--save", str(tmp_path / "published.pt"))
    assert "published v4" in out, out
    assert coord.latest_version().version == 4
    out = _run("fetch_engine", *etcd_args, "--version", "4", "--save", str(tmp_path / "fetched.pt"))
    assert "loaded v4" in out, out
    published = _bytes(torch.load(tmp_path / "published.pt"))
    assert _bytes(torch.load(tmp_path / "fetched.pt")) == published

    # The example engine, as a worker builds `engine: {type: custom}` and loads a pull.
    monkeypatch.syspath_prepend(str(EXAMPLES))
    engine = make_engine_from_config(CustomEngineConfig(factory="fetch_engine:make_engine",
                                                        options={"max_batch": 2}))
    fetched = make_relay_fetcher(client)(4)
    try:
        engine.load_weights(fetched.version, fetched.tensors)
    finally:
        fetched.release()
    assert engine.weight_version == 4
    assert _bytes(engine.model.state_dict()) == published


def test_custom_trainer_consumes_every_trajectory_once(etcd, stack, spawn, script, tmp_path):
    coord, client = stack
    client.publish(0, [("simulated.weights", "uint8", (4096,), bytes(4096))])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"sort {i}=", "task": "sort",
                                           "answer": str(i)}) + "\n" for i in range(PROMPTS)))
    state_dir = tmp_path / "manager"
    manager = spawn("manager", "laminar_rollout.cli", "manage", *tier_args(etcd, JOB, TTL),
                    "--set", f"prompts={prompts}", "--set", f"group_size={GROUP}",
                    "--set", "sampling.max_tokens=32", "--set", f"state_dir={state_dir}",
                    "--set", "metrics.port=0", "--set", "repack.enabled=false")
    trainer = script("my_trainer", "--etcd", etcd.endpoint, "--job", JOB,
                     "--count", str(PROMPTS * GROUP), "--batch", "4", "--timeout", "60",
                     "--out", str(tmp_path / "trainer.json"))
    # The worker runs the example's own engine: `engine: {type: custom, factory: ...}`.
    worker = spawn("worker-0", "laminar_rollout.cli", "serve", *tier_args(etcd, JOB, TTL),
                   "--set", "worker_id=worker-0", "--set", "engine.type=custom",
                   "--set", "engine.factory=fetch_engine:make_engine",
                   "--set", "engine.options.max_batch=4",
                   "--set", "engine.options.step_time_base=0.002",
                   "--set", "report_interval_s=0.1", "--set", "resend_after_s=1",
                   env={"PYTHONPATH": os.pathsep.join([str(EXAMPLES), *sys.path])})
    manager_rec = wait_ready(etcd, JOB, manager, Role.MANAGER)
    # The consumer's own record says it serves: readiness without parsing its stdout.
    assert wait_ready(etcd, JOB, trainer, Role.TRAINER, "trainer").address.startswith("tcp://")
    assert wait_ready(etcd, JOB, worker, Role.WORKER, "worker-0").extra[Extra.ENGINE] == "TinyEngine"

    assert trainer.proc.wait(timeout=60) == 0, "\n".join(trainer.lines[-20:])
    report = json.loads((tmp_path / "trainer.json").read_text())
    print(f"consumer counters: {report['stats']}")
    ids = report["ids"]
    everything = {f"p{i}#{k}" for i in range(PROMPTS) for k in range(GROUP)}
    assert len(ids) == len(set(ids)) == PROMPTS * GROUP and set(ids) == everything
    assert report["stats"]["delivered"] == PROMPTS * GROUP
    assert report["stats"]["acks_sent"] >= PROMPTS * GROUP

    url = manager_rec.extra[Extra.METRICS]

    def acked() -> float:
        samples = scrape_metrics(url)
        return sum(v for k, v in samples.items()
                   if k.startswith("laminar_manager_trajectories{") and 'state="acked"' in k)

    assert wait_until(lambda: acked() == PROMPTS * GROUP, 20), f"manager acked {acked()}"
    assert manager.stop() == 0  # a graceful stop writes its state file
    states = json.loads((state_dir / "manager_state.json").read_text())["ledger"]["states"]
    assert set(states["acked"]) == everything
    assert not any(states.get(s) for s in ("pending", "dispatched", "done", "rejected"))
