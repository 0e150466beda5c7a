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
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import consumed_ids, laminar_up, read_steps, run_to_end, wait_ready, wait_until
from laminar_common.etcd import EtcdCoordinator
from laminar_common.relay.client import RelayClient
from laminar_trainer.export import export_model

# One pytest-xdist worker runs this file's tests (the "rl_run" group): they share a
# module fixture.
pytestmark = pytest.mark.xdist_group("rl_run")

REPO = Path(__file__).resolve().parents[1]
MIN_GAIN = 0.20




@pytest.mark.cost(63)
def test_demo_job_raises_held_out_accuracy_by_twenty_points(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    job["run_dir"] = str(tmp_path / "run")
    total_steps = job["tiers"]["trainer"]["config"]["total_steps"]
    up = laminar_up(tmp_path, job, name="demo.yaml")
    run_to_end(up, 1200)
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
    consumed = consumed_ids(run_dir)
    batch = job["tiers"]["trainer"]["config"]["batch_groups"] * \
        job["tiers"]["manager"]["config"]["group_size"]
    assert len(consumed) == len(set(consumed)) == total_steps * batch
    max_staleness = job["tiers"]["manager"]["config"]["max_staleness"]
    assert max(int(k) for k in summary["staleness_hist"]) <= max_staleness + 1
    up.wait_for_line(r"plot: .*\.png", 60)


def _common(etcd, job: str) -> list[str]:
    return ["--set", f"job={job}", "--set", f"etcd.endpoints=[{etcd.endpoint}]",
            "--set", "etcd.ttl_s=3"]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A briefly warm-started model, train prompts and held-out prompts, shared by the
    stack tests below."""
    out = tmp_path_factory.mktemp("warm")
    subprocess.run([sys.executable, "-m", "laminar_examples.cli", "warmstart", "--out",
                    str(out / "model"), "--steps", "40", "--demo-error-rate", "0.6"],
                   check=True, capture_output=True, timeout=600)
    for split, n in (("train", 2000), ("eval", 16)):
        subprocess.run([sys.executable, "-m", "laminar_examples.cli", "prompts", "--n", str(n),
                        "--split", split, "--seed", "1", "--out", str(out / f"{split}.jsonl")],
                       check=True, capture_output=True, timeout=60)
    return out


def _rollout_tiers(etcd, spawn, job: str, warm: Path, state_dir: Path, *manager_args: str):
    spawn("relay", "laminar_relay.cli", "serve", *_common(etcd, job), "--set", "member_id=relay-0",
          "--set", "bind_host=127.0.0.1", "--set", "advertise_host=127.0.0.1")
    manager = spawn("manager", "laminar_rollout.cli", "manage", *_common(etcd, job),
                    "--set", f"prompts={warm / 'train.jsonl'}", "--set", "group_size=4",
                    "--set", "batch_groups=4", "--set", "max_staleness=1",
                    "--set", "sampling.max_tokens=10", "--set", f"state_dir={state_dir}",
                    *manager_args)
    wait_ready(etcd, job, manager, "manager")
    worker = spawn("worker", "laminar_rollout.cli", "serve", *_common(etcd, job),
                   "--set", "worker_id=worker-0", "--set", "engine.type=torch",
                   "--set", f"engine.model_dir={warm / 'model'}", "--set", "engine.max_batch=16",
                   "--set", "reward=laminar_rollout.rewards:synthetic_task")
    return manager, worker


def test_a_step_replays_bit_exact_and_a_seeded_trajectory_regenerates(etcd, spawn, tmp_path,
                                                                      warm):
    """Issue 39: a few steps of the demo model's job with a checkpoint and a step record
    every step and seeded sampling; then ``laminar replay --step 3`` recomputes step 3
    from the checkpoint of step 2 and its record, bit-exact against the checkpoint of
    step 3, and ``laminar replay --trajectory`` generates one of its trajectories again
    on the torch engine: the same tokens, the same log-probs to float rounding."""
    from laminar_common.data.provenance import read_step_record

    job = "rl-replay"
    run_dir, ckpt, state_dir = tmp_path / "trainer", tmp_path / "ckpt", tmp_path / "manager"
    _rollout_tiers(etcd, spawn, job, warm, state_dir, "--set", "sampling.seed=11")
    trainer = spawn("trainer", "laminar_trainer.cli", "run", *_common(etcd, job),
                    "--set", "trainer_id=trainer", "--set", f"model_dir={warm / 'model'}",
                    "--set", "batch_groups=4", "--set", "total_steps=5",
                    "--set", f"run_dir={run_dir}", "--set", f"checkpoint.dir={ckpt}",
                    "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep=10")
    trainer.wait_for_line(r"TRAINER DONE", 300)
    assert trainer.proc.wait(60) == 0

    def laminar(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "laminar_common.launch.cli", *args],
                              capture_output=True, text=True, timeout=300)

    listed = laminar("replay", str(tmp_path))
    assert listed.returncode == 0 and "replayable steps: 2-5" in listed.stdout, listed
    replayed = laminar("replay", str(tmp_path), "--step", "3")
    assert replayed.returncode == 0 and "step 3: replayed bit-exact" in replayed.stdout, replayed
    shown = laminar("samples", str(tmp_path), "--step", "3", "--worst", "-n", "2")
    assert shown.returncode == 0 and shown.stdout.startswith("step 3 (trainer at v"), shown
    record = read_step_record(ckpt / "records" / "step-00000003.parquet")
    traj = next(t for g in record.groups for t in g.trajectories() if t.policy_version >= 1)
    assert traj.sampling.seed is not None and traj.prompt_token_ids
    assert traj.engine.startswith(f"TorchEngine torch {torch.__version__}"), traj.engine
    again = laminar("replay", str(tmp_path), "--trajectory", traj.trajectory_id)
    print(replayed.stdout, again.stdout, sep="")
    assert again.returncode == 0 and "the same" in again.stdout, again


def test_trainer_sigkill_then_resume_trains_nothing_twice(etcd, spawn, tmp_path, warm):
    job = "rl-resume"
    model = warm / "model"
    run_dir, ckpt, state_dir = tmp_path / "trainer", tmp_path / "ckpt", tmp_path / "manager"
    manager, worker = _rollout_tiers(etcd, spawn, job, warm, state_dir)
    total_steps, every = 12, 3
    trainer_args = ("run", *_common(etcd, job), "--set", "trainer_id=trainer",
                    "--set", f"model_dir={model}", "--set", "batch_groups=4",
                    "--set", f"total_steps={total_steps}", "--set", f"run_dir={run_dir}",
                    "--set", f"checkpoint.dir={ckpt}", "--set", f"checkpoint.every_steps={every}",
                    # streamed steps: each of the 2 mini-batches trained as its groups
                    # arrive, so a SIGKILL can land between a step's updates
                    "--set", "optim.mini_batches=2", "--set", "optim.stream=true",
                    "--set", "optim.shuffle=false", "--set", "loss.proximal=loglinear")
    trainer = spawn("trainer", "laminar_trainer.cli", *trainer_args)
    wait_ready(etcd, job, trainer, "trainer", timeout_s=120)
    assert wait_until(lambda: len(read_steps(run_dir)) >= 5, 300), "training did not reach step 5"
    trainer.kill()
    killed_at = read_steps(run_dir)[-1]["step"]

    trainer2 = spawn("trainer-2", "laminar_trainer.cli", *trainer_args, "--resume")
    resumed_step = int(wait_ready(etcd, job, trainer2, "trainer", timeout_s=120).extra["step"])
    assert 0 < resumed_step <= killed_at and resumed_step % every == 0
    trainer2.wait_for_line(r"TRAINER DONE", 600)
    assert trainer2.proc.wait(60) == 0
    assert worker.alive() and manager.alive(), "a rollout tier exited with the trainer"

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == total_steps and summary["simulated_step"] is False
    # The restarted trainer went on from the checkpoint, step by step, to the end;
    # the steps after the checkpoint that the killed one took were rolled back.
    rows = read_steps(run_dir)
    steps = [row["step"] for row in rows]
    assert steps[-(total_steps - resumed_step):] == list(range(resumed_step + 1, total_steps + 1))
    assert all(row["updates"] == 2 and row["stream_wait_s"] >= 0 for row in rows)
    consumed = consumed_ids(run_dir)
    assert len(consumed) == len(set(consumed)) == total_steps * 4 * 4
    manager.stop()
    state = json.loads((state_dir / "manager_state.json").read_text())
    assert set(state["ledger"]["states"]["acked"]) == set(consumed)


def test_the_whole_job_resumed_on_a_fresh_etcd_trains_nothing_staler_than_the_bound(
        etcd, spawn, tmp_path, warm):
    """Every tier is SIGKILLed mid-run and the job comes back as ``laminar up --resume``
    brings it: a fresh etcd (no weights/latest), a fresh relay, a fresh worker on the
    warm-start weights (v0), the manager and the trainer with --resume. Before the fix the
    worker generated with v0 until the resumed version reached it and the trainer trained
    those trajectories at staleness = the resumed version. Now the manager holds new work
    until the resumed weights are published, and no step after the resume trains anything
    staler than the trainer's bound (buffer.max_staleness, 4)."""
    from laminar_common.launch.local_etcd import LocalEtcd

    job = "rl-whole-resume"
    run_dir, ckpt, state_dir = tmp_path / "trainer", tmp_path / "ckpt", tmp_path / "manager"
    total_steps, every, bound = 30, 3, 4
    manager, worker = _rollout_tiers(etcd, spawn, job, warm, state_dir)

    def trainer_args(server):
        return ("run", *_common(server, job), "--set", "trainer_id=trainer",
                "--set", f"model_dir={warm / 'model'}", "--set", "batch_groups=4",
                "--set", f"total_steps={total_steps}", "--set", f"run_dir={run_dir}",
                "--set", f"checkpoint.dir={ckpt}", "--set", f"checkpoint.every_steps={every}",
                "--set", f"buffer.max_staleness={bound}")

    trainer = spawn("trainer", "laminar_trainer.cli", *trainer_args(etcd))
    wait_ready(etcd, job, trainer, "trainer", timeout_s=120)
    state = state_dir / "manager_state.json"

    def seen() -> int:  # the newest version in the manager's saved state (every 2 s)
        try:
            return json.loads(state.read_text())["summary"]["latest_version"]
        except (OSError, ValueError, KeyError):
            return 0

    assert wait_until(lambda: seen() >= 8, 300), "the manager's state never saw v8"
    assert len(read_steps(run_dir)) < total_steps, "the run ended before the kill"
    children = [c for c in (trainer, worker, manager) if c.alive()]
    for child in children:
        child.kill()
    etcd.close()  # and the job's etcd goes with it: the next one starts empty

    fresh = LocalEtcd().start()
    try:
        spawn("relay-2", "laminar_relay.cli", "serve", *_common(fresh, job),
              "--set", "member_id=relay-0", "--set", "bind_host=127.0.0.1",
              "--set", "advertise_host=127.0.0.1")
        manager2 = spawn("manager-2", "laminar_rollout.cli", "manage", *_common(fresh, job),
                         "--set", f"prompts={warm / 'train.jsonl'}", "--set", "group_size=4",
                         "--set", "batch_groups=4", "--set", "max_staleness=1",
                         "--set", "sampling.max_tokens=10", "--set", f"state_dir={state_dir}",
                         "--resume")
        wait_ready(fresh, job, manager2, "manager")
        spawn("worker-2", "laminar_rollout.cli", "serve", *_common(fresh, job),
              "--set", "worker_id=worker-0", "--set", "engine.type=torch",
              "--set", f"engine.model_dir={warm / 'model'}", "--set", "engine.max_batch=16",
              "--set", "reward=laminar_rollout.rewards:synthetic_task")
        trainer2 = spawn("trainer-2", "laminar_trainer.cli", *trainer_args(fresh), "--resume")
        resumed = int(wait_ready(fresh, job, trainer2, "trainer", timeout_s=120).extra["step"])
        assert resumed >= 6 and resumed % every == 0
        trainer2.wait_for_line(r"TRAINER DONE", 600)
        assert trainer2.proc.wait(60) == 0
    finally:
        fresh.close()

    rows = read_steps(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total_steps + 1))
    after = [r for r in rows if r["step"] > resumed]
    assert max(r["staleness_max"] for r in after) <= bound, \
        [(r["step"], r["staleness_max"]) for r in after]
    manager_log = Path(manager2.log_path).read_text()
    assert "resumed: no new work until the trainer publishes its resumed weights" in manager_log
    assert "resumed: new work goes out at v" in manager_log
    summary = json.loads((run_dir / "summary.json").read_text())
    # The manager held the work: nothing old even reached the trainer to be refused.
    assert summary["refused_stale_after_resume"] == 0, summary
    consumed = consumed_ids(run_dir)
    assert len(consumed) == len(set(consumed)) == total_steps * 4 * 4


def test_two_rank_fsdp_trainer_in_the_stack_publishes_what_it_trains(etcd, spawn, tmp_path,
                                                                      warm):
    """The trainer under torchrun (2 gloo ranks, FSDP2) in the real stack: the weights
    gathered from the shards reach the relay and the worker, and its sharded checkpoint
    (each rank writing its own shards) resumes in one process. Versions go as deltas (a
    full one every 3rd): the last one, rebuilt by a new reader from the full version 3
    and the delta 4, is the final weights (gathered from the shards) bit for bit.
    (Full-state checkpoints across ranks: tests/test_distributed.py.)"""
    job = "rl-fsdp"
    run_dir, ckpt, state_dir = tmp_path / "trainer", tmp_path / "ckpt", tmp_path / "manager"
    manager, worker = _rollout_tiers(etcd, spawn, job, warm, state_dir)
    steps = 4
    trainer_args = ["run", *_common(etcd, job), "--set", "trainer_id=trainer",
                    "--set", f"model_dir={warm / 'model'}", "--set", "batch_groups=4",
                    "--set", f"run_dir={run_dir}", "--set", f"checkpoint.dir={ckpt}",
                    "--set", "checkpoint.every_steps=2", "--set", "device=cpu",
                    "--set", "checkpoint.format=sharded",
                    "--set", f"eval.prompts={warm / 'eval.jsonl'}",
                    "--set", "eval.max_new_tokens=10", "--set", "eval.every_steps=2",
                    "--set", "publish_delta_full_every=3",
                    # lr 1e-6 as in LLM RL: a step changes a few % of the bf16 values, so
                    # version 4 goes as a delta (at the default 1e-4 most of them change
                    # and the trainer publishes in full).
                    "--set", "optim.lr=1e-6"]
    trainer = spawn("trainer", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                    "-m", "laminar_trainer.cli", *trainer_args,
                    "--set", f"total_steps={steps}", env={"OMP_NUM_THREADS": "1"})
    trainer.wait_for_line(r"TRAINER DONE", 600)
    assert trainer.proc.wait(60) == 0
    log = Path(trainer.log_path).read_text()
    assert "rank 1: stop after 4 steps" in log  # the follower took every step, then STOP

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["simulated_step"] is False
    assert summary["eval_before"] is not None and summary["eval_after"] is not None
    consumed = consumed_ids(run_dir)
    assert len(consumed) == len(set(consumed)) == steps * 4 * 4
    rows = read_steps(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # every 2nd step evaluated in the loop but the last, whose weights eval_after evaluates
    assert ["eval_accuracy" in r for r in rows] == [False, True, False, False]
    # The worker loaded the published versions: staleness stays within the
    # manager's bound instead of growing with every step.
    assert max(r["staleness_max"] for r in rows) <= 2

    # The relay's latest version is byte for byte the last checkpoint's weights, cast to
    # the publish dtype (bfloat16 by default); the checkpoint and final model keep fp32.
    coord = EtcdCoordinator([etcd.endpoint], job, ttl_s=3)
    try:
        client = RelayClient(coord, client_id="test-reader")
        with client.fetch(wait_s=10, verify=True) as fetched:
            assert fetched.version == summary["version"]
            assert fetched.source == "delta", fetched.source
            published = {t.name: (t.dtype, tuple(t.shape)) for t in fetched.manifest.tensors}
            views = {name: bytes(view) for name, view in fetched.tensors().items()}
    finally:
        coord.close()
    last = ckpt / f"step-{steps:08d}"
    assert (last / "sharded" / ".metadata").is_file() and not (last / "model").exists()
    assert sorted(p.name for p in (last / "sharded").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # one file of shards per rank, nothing gathered
    saved = load_file(str(run_dir / "final" / "model.safetensors"))
    # The sharded checkpoint holds the same weights (exported to a model directory).
    exported = export_model(last, tmp_path / "export", "float32")
    from_ckpt = load_file(str(exported / "model.safetensors"))
    assert set(from_ckpt) <= set(saved)
    assert all(torch.equal(t, saved[name]) for name, t in from_ckpt.items())
    assert set(published) == set(saved)
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32, name
        assert published[name] == ("bfloat16", tuple(tensor.shape)), name
        cast = tensor.to(torch.bfloat16).contiguous()
        assert views[name] == cast.view(torch.uint8).numpy().tobytes(), name

    # The two-rank checkpoint resumes in a single process and goes on.
    single = spawn("trainer-single", "laminar_trainer.cli", *trainer_args,
                   "--set", f"total_steps={steps + 2}", "--resume")
    resumed = wait_ready(etcd, job, single, "trainer", timeout_s=120)
    assert int(resumed.extra["step"]) == steps
    single.wait_for_line(r"TRAINER DONE", 600)
    assert single.proc.wait(60) == 0
    assert [r["step"] for r in read_steps(run_dir)][-2:] == [steps + 1, steps + 2]
    consumed = consumed_ids(run_dir)
    assert len(consumed) == len(set(consumed)) == (steps + 2) * 4 * 4
    assert worker.alive() and manager.alive()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_trajectories_against_the_real_model_are_refused_counted_and_regenerated(
        etcd, spawn, tmp_path, warm):
    """Well-formed but wrong trajectories pushed to a real trainer (the warm-started
    model) in the real stack: each is refused at the door and counted by reason; an
    id broken max_rejections times is given up on (its group trains without it, the
    manager records it as rejected); no step crashes and the weights stay finite;
    everything else is trained exactly once."""
    from laminar_common.codec import Trajectory
    from laminar_common.transport import ZmqPushSender

    job = "rl-hostile"
    run_dir, ckpt, state_dir = tmp_path / "trainer", tmp_path / "ckpt", tmp_path / "manager"
    manager, worker = _rollout_tiers(etcd, spawn, job, warm, state_dir)
    total_steps = 6
    trainer = spawn("trainer", "laminar_trainer.cli", "run", *_common(etcd, job),
                    "--set", "trainer_id=trainer", "--set", f"model_dir={warm / 'model'}",
                    "--set", "batch_groups=4", "--set", f"total_steps={total_steps}",
                    "--set", f"run_dir={run_dir}", "--set", f"checkpoint.dir={ckpt}",
                    "--set", "checkpoint.every_steps=2", "--set", "max_rejections=3")
    address = wait_ready(etcd, job, trainer, "trainer", timeout_s=120).address
    prompts = [json.loads(x)["id"] for x in (warm / "train.jsonl").read_text().splitlines()]
    vocab = json.loads((warm / "model" / "config.json").read_text())["vocab_size"]

    def bad(prompt: str, sample: int, **wrong) -> Trajectory:
        fields = dict(trajectory_id=f"{prompt}#{sample}", prompt_id=prompt, group_size=4,
                      sample_index=sample, worker_id="hostile", policy_version=0,
                      prompt_token_ids=(1, 5, 6), response_token_ids=(7, 8, 2),
                      behaviour_logprobs=(-1.0, -1.0, -1.0), reward=1.0, finish_reason="stop")
        return Trajectory(**(fields | wrong))

    late = prompts[12]  # dispatched steps from now: the bad copies arrive first
    cases = [
        bad(late, 0, behaviour_logprobs=(-1.0,)),               # fewer log-probs than tokens
        bad(late, 1, prompt_token_ids=()),                      # empty prompt
        bad(late, 2, response_token_ids=(7, vocab + 3, 2)),     # id >= the vocabulary
        bad(late, 3, response_token_ids=(7, -1, 2)),            # negative id
        bad(prompts[13], 0, reward=float("nan")),               # NaN reward
        bad(prompts[13], 1, behaviour_logprobs=(-1.0, float("nan"), -1.0)),
    ]
    doomed = bad(prompts[14], 2, reward=float("inf"))
    sender = ZmqPushSender(address)
    for traj in [*cases, doomed, doomed, doomed]:
        sender.send(traj)
    sender.close()

    trainer.wait_for_line(r"TRAINER DONE", 600)
    assert trainer.proc.wait(60) == 0, "a bad trajectory crashed the trainer"
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"rejected by reason: {summary['rejected']}")
    assert summary["rejected"] == {"length-mismatch": 1, "empty-prompt": 1,
                                   "token-out-of-range": 2, "non-finite-reward": 4,
                                   "bad-logprob": 1}
    assert summary["buffer"]["failed"] == 1
    assert summary["nonfinite_steps"] == 0
    weights = load_file(str(ckpt / f"step-{total_steps:08d}" / "model" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values()), "NaN in the weights"
    consumed = consumed_ids(run_dir)
    assert len(consumed) == len(set(consumed))
    assert doomed.trajectory_id not in consumed
    # Bad copies of ids the worker then generated for real did not stop those ids:
    # once their group was trained, it was trained whole.
    late_ids = {f"{late}#{i}" for i in range(4)}
    assert late_ids <= set(consumed) or not late_ids & set(consumed)
    assert summary["buffer"]["received"] > len(consumed)
    manager.stop()
    state = json.loads((state_dir / "manager_state.json").read_text())
    states = state["ledger"]["states"]
    assert doomed.trajectory_id in states["rejected"]
    assert set(states["acked"]) == set(consumed)
    assert state["summary"]["trainer_rejections"] >= 1
