"""A trainer on two ranks (torchrun, gloo, FSDP2 on CPU) against the same trainer in one
process: the same update, the same eval, and a checkpoint one process can resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from laminar_common.codec import Trajectory
from laminar_common.errors import LaminarError
from laminar_examples.demo_model import build_tiny_model, build_tokenizer
from laminar_examples.tasks import make_task_records
from laminar_trainer.buffer import Group
from laminar_trainer.checkpoint import latest_checkpoint
from laminar_trainer.config import TrainerConfig
from laminar_trainer.distributed import decode_groups, encode_groups, init_distributed
from laminar_trainer.policy import build_training, evaluate_records, restore_training
from laminar_trainer.step import train_step

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _groups(step: int, n_groups: int = 4, size: int = 2) -> list[Group]:
    # Unequal response lengths (1 to 12 tokens): a token mean over a split batch is the
    # whole batch's only if each part is normalised by the whole batch's token count.
    gen = torch.Generator().manual_seed(step)
    out = []
    for g in range(n_groups):
        trajs = {}
        for i in range(size):
            n = int(torch.randint(1, 13, (1,), generator=gen))
            resp = tuple(int(x) for x in torch.randint(4, 30, (n,), generator=gen))
            trajs[i] = Trajectory(
                trajectory_id=f"s{step}g{g}#{i}", prompt_id=f"s{step}g{g}", group_size=size,
                sample_index=i, worker_id="w", policy_version=0,
                prompt_token_ids=(1, 10 + g, 11, 12), response_token_ids=resp,
                behaviour_logprobs=tuple(float(x) for x in -torch.rand(n, generator=gen) - 2.5),
                reward=float((g + i) % 2 + 0.5 * i * (g % 3)), finish_reason="stop")
        out.append(Group(f"s{step}g{g}", size, trajs))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    build_tiny_model(len(tok), seed=1, hidden_size=32, num_layers=2, num_heads=2,
                     intermediate_size=64).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def test_groups_round_trip_through_the_step_payload():
    groups = _groups(0)
    back = decode_groups(encode_groups(groups))
    assert [(g.prompt_id, g.group_size, g.weight) for g in back] == \
        [(g.prompt_id, g.group_size, g.weight) for g in groups]
    assert [g.trajectories() for g in back] == [g.trajectories() for g in groups]
    with pytest.raises(LaminarError, match="STEP payload from rank 0 does not decode"):
        decode_groups(b"\x93garbage")


def test_uneven_batch_groups_are_refused_before_joining(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(LaminarError, match=r"batch_groups \(4\) must be a multiple of the "
                                           r"number of trainer ranks \(3\)"):
        init_distributed("cpu", 4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed("cpu", 4) is None


def _checkpointing(model) -> bool:
    # transformers renamed it (is_gradient_checkpointing warns from 5.2x)
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(model.is_gradient_checkpointing if flag is None else flag)


def _grads(training) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in training.model.named_parameters()}


def test_micro_batches_by_tokens_sort_by_length_and_keep_the_gradient(model_dir):
    from laminar_trainer.step import _by_tokens, _length

    groups = _groups(0, n_groups=8)
    everyone = sorted(t.trajectory_id for g in groups for t in g.trajectories())
    # Each rank's share sorted by length, in as many micro-batches on every rank, split by
    # trajectory (a group's samples can land in different micro-batches and ranks).
    for world in (1, 2):
        plans = [_by_tokens(groups, r, world, budget=40) for r in range(world)]
        assert len({len(p) for p in plans}) == 1 and len(plans[0]) > 1
        assert sorted(t.trajectory_id for p in plans for part in p for t in part) == everyone
        for plan in plans:
            flat = [t for part in plan for t in part]
            assert [_length(t) for t in flat] == sorted(_length(t) for t in flat)
            assert all(part for part in plan)
    # Rows padded to their own micro-batch's longest: within the budget, but for one row.
    for part in _by_tokens(groups, 0, 1, budget=40):
        assert len(part) == 1 or len(part) * max(_length(t) for t in part) <= 40
    # A group with one long sample: its seven short siblings are not padded to it.
    def traj(i: int, n: int) -> Trajectory:
        return Trajectory(trajectory_id=f"g#{i}", prompt_id="g", group_size=8, sample_index=i,
                          worker_id="w", policy_version=0, prompt_token_ids=(1, 10, 11, 12),
                          response_token_ids=(5,) * n, behaviour_logprobs=(-1.0,) * n,
                          reward=float(i == 0), finish_reason="stop")

    tail = Group("g", 8, {i: traj(i, 12 if i == 0 else 1) for i in range(8)})
    plan = _by_tokens([tail], 0, 1, budget=40)
    assert [[t.sample_index for t in part] for part in plan] == [[1, 2, 3, 4, 5, 6, 7], [0]]
    # The same gradient as the whole batch at once (the loss is normalised over it).
    grads_cfg = {"model_dir": model_dir, "batch_groups": 8, "seed": 3,
                 "optim": {"lr": 1e-2, "grad_clip": 1e9}}
    torch.manual_seed(3)
    whole = build_training(TrainerConfig(**grads_cfg), None)
    train_step(whole.model, whole.optimizer, whole.scheduler, groups, TrainerConfig(**grads_cfg))
    tok_cfg = TrainerConfig(**{**grads_cfg, "optim": {**grads_cfg["optim"],
                                                      "micro_batch_tokens": 40}})
    torch.manual_seed(3)
    split = build_training(tok_cfg, None)
    train_step(split.model, split.optimizer, split.scheduler, groups, tok_cfg)
    for name, grad in _grads(whole).items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(_grads(split)[name], grad, atol=1e-5, rtol=0), name


def test_two_ranks_make_the_same_update_as_one_process(model_dir, tmp_path):
    # Two PPO mini-batches (one group per rank each) and two epochs: four updates per
    # step, the later ones clipped against the proximal log-probs of the step's start.
    cfg = {"model_dir": model_dir, "batch_groups": 4, "seed": 3, "eval": {"max_new_tokens": 8},
           "optim": {"lr": 1e-2, "mini_batches": 2, "epochs": 2}}
    grads_cfg = {"model_dir": model_dir, "batch_groups": 4, "seed": 3,
                 "optim": {"lr": 1e-2, "grad_clip": 1e9}}
    out = tmp_path / "ranks"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "grads_config.json").write_text(json.dumps(grads_cfg))
    steps = [_groups(s) for s in range(2)]
    groups_file = tmp_path / "groups.msgpack"
    groups_file.write_bytes(msgspec.msgpack.encode([encode_groups(g) for g in steps]))
    records = [{"id": r["id"], "prompt": r["prompt"], "metadata": r}
               for r in make_task_records("sort", 12, seed=0, split="eval", max_len=3)]
    (out / "eval.json").write_text(json.dumps(records))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), str(HERE / "fsdp_ranks.py"), model_dir,
         str(groups_file), str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())

    # The gradient of one unsplit batch with unequal lengths, by every aggregation's
    # rule: two ranks, and one process in micro-batches of one group, give the same.
    rank_grads = load_file(str(out / "grads.safetensors"))
    torch.manual_seed(3)
    whole = build_training(TrainerConfig(**grads_cfg), None)
    train_step(whole.model, whole.optimizer, whole.scheduler, steps[0],
               TrainerConfig(**grads_cfg))
    micro_cfg = TrainerConfig(**{**grads_cfg, "optim": {**grads_cfg["optim"],
                                                        "micro_batch_groups": 1}})
    torch.manual_seed(3)
    micro = build_training(micro_cfg, None)
    train_step(micro.model, micro.optimizer, micro.scheduler, steps[0], micro_cfg)
    expected_grads, micro_grads = _grads(whole), _grads(micro)
    assert set(rank_grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(rank_grads[name], grad, atol=1e-5, rtol=0), name
        assert torch.allclose(micro_grads[name], grad, atol=1e-5, rtol=0), name

    # The same two steps in one process, each mini-batch split in micro-batches.
    torch.manual_seed(3)
    single_cfg = TrainerConfig(**{**cfg, "optim": {**cfg["optim"], "micro_batch_groups": 1}})
    single = build_training(single_cfg, None)
    losses = [train_step(single.model, single.optimizer, single.scheduler, g, single_cfg).loss
              for g in steps]
    assert losses == pytest.approx(result["losses"], abs=1e-5)
    gathered = load_file(str(out / "gathered.safetensors"))
    expected = single.model.state_dict()
    assert set(gathered) == set(expected)
    # Updates are ~lr = 1e-2 per element; summation order differs between the
    # layouts, and Adam magnifies that on elements whose gradient is ~0.
    for name, tensor in expected.items():
        assert torch.allclose(gathered[name], tensor, atol=1e-4), name
    initial = build_training(single_cfg, None).model.state_dict()
    moved = sum(not torch.equal(initial[k], expected[k]) for k in expected)
    assert moved == len(expected)  # every tensor took the update (lr 1e-2)
    assert result["accuracy"] == evaluate_records(single, records, single_cfg).accuracy

    # The two-rank checkpoint resumes in one process: weights, optimizer, schedule.
    resumed = build_training(single_cfg, None)
    state = restore_training(resumed, latest_checkpoint(out / "ckpt"), None)
    assert state.step == 2
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, gathered[name]), name
    mine = single.optimizer.state_dict()["state"]
    theirs = resumed.optimizer.state_dict()["state"]
    assert len(mine) == len(theirs)
    for idx in mine:
        assert torch.allclose(mine[idx]["exp_avg"], theirs[idx]["exp_avg"], atol=1e-5)
        assert torch.allclose(mine[idx]["exp_avg_sq"], theirs[idx]["exp_avg_sq"], atol=1e-6)
        # four optimizer updates per trainer step (2 mini-batches x 2 epochs)
        assert float(mine[idx]["step"]) == float(theirs[idx]["step"]) == 8.0
    assert resumed.scheduler.last_epoch == single.scheduler.last_epoch == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_on_cuda_matches_the_same_step_on_cpu(model_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = {"model_dir": model_dir, "batch_groups": 4, "optim": {"lr": 1e-2}, "seed": 3}
    runs = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(3)
        dev_cfg = TrainerConfig(**cfg, device=device)
        training = build_training(dev_cfg, None)
        assert training.device.type == device
        losses = [train_step(training.model, training.optimizer, training.scheduler,
                             _groups(s), dev_cfg).loss for s in range(2)]
        runs[device] = (losses, {k: v.cpu() for k, v in training.model.state_dict().items()})
    assert runs["cuda"][0] == pytest.approx(runs["cpu"][0], abs=1e-4)
    for name, tensor in runs["cpu"][1].items():
        assert torch.allclose(runs["cuda"][1][name], tensor, atol=1e-3), name


def test_sharded_checkpoints_resume_on_another_rank_count(tmp_path):
    # A tied-embedding Qwen2 whose dims do not split evenly over 2 ranks (vocab 49,
    # 3 KV heads x 6 = 18 rows), built on the meta device, each rank reading its rows.
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from laminar_trainer.export import export_model

    model_dir = tmp_path / "tied"
    tok = build_tokenizer()
    torch.manual_seed(5)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=36, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64,
        tie_word_embeddings=True)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "ranks"
    out.mkdir()
    cfg = {"model_dir": str(model_dir), "batch_groups": 4, "seed": 3,
           "activation_checkpointing": True, "checkpoint": {"format": "sharded"},
           "optim": {"lr": 1e-2}}
    (out / "config.json").write_text(json.dumps(cfg))
    steps = [_groups(s) for s in range(2)]
    groups_file = tmp_path / "groups.msgpack"
    groups_file.write_bytes(msgspec.msgpack.encode([encode_groups(g) for g in steps]))

    # One process takes step 0 and writes a sharded checkpoint (another rank count).
    one_cfg = TrainerConfig(**cfg)
    torch.manual_seed(3)
    one = build_training(one_cfg, None)
    train_step(one.model, one.optimizer, one.scheduler, steps[0], one_cfg)
    from laminar_trainer.checkpoint import TrainerState, save_checkpoint
    from laminar_trainer.distributed import save_sharded
    save_checkpoint(out / "one", one.model, one.tokenizer, one.optimizer, TrainerState(1, 1, []),
                    write_sharded=lambda p: save_sharded(one.model, one.optimizer, p))
    assert not (latest_checkpoint(out / "one") / "model").exists()  # nothing gathered

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         str(HERE / "fsdp_sharded_ranks.py"), str(groups_file), str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]

    # The two ranks resumed exactly what one process saved (tied weights included).
    resumed = load_file(str(out / "resumed.safetensors"))
    mine = one.model.state_dict()
    assert set(resumed) == set(mine)
    for name, tensor in mine.items():
        assert torch.equal(resumed[name], tensor), name
    # The same step 1 in one process, with activation checkpointing too.
    loss = train_step(one.model, one.optimizer, one.scheduler, steps[1], one_cfg).loss
    assert loss == pytest.approx(json.loads((out / "result.json").read_text())["loss"], abs=1e-5)
    gathered = load_file(str(out / "gathered.safetensors"))
    published = load_file(str(out / "published.safetensors"))
    for name, tensor in one.model.state_dict().items():
        assert torch.allclose(gathered[name], tensor, atol=1e-4), name
        assert published[name].dtype == torch.bfloat16, name
        assert torch.equal(published[name], gathered[name].to(torch.bfloat16)), name

    # The two-rank sharded checkpoint resumes in one process: weights and optimizer.
    two = latest_checkpoint(out / "two")
    back = build_training(one_cfg, None, two)
    state = restore_training(back, two, None)
    assert state.step == 2
    for name, tensor in back.model.state_dict().items():
        assert torch.equal(tensor, gathered[name]), name
    assert back.model.lm_head.weight is back.model.model.embed_tokens.weight
    assert _checkpointing(back.model)
    theirs = back.optimizer.state_dict()["state"]
    ours = one.optimizer.state_dict()["state"]
    assert len(theirs) == len(ours)
    for idx in ours:
        assert float(theirs[idx]["step"]) == float(ours[idx]["step"]) == 2.0
        assert torch.allclose(theirs[idx]["exp_avg"], ours[idx]["exp_avg"], atol=1e-5)
    assert back.scheduler.last_epoch == 2

    # ... and exports to a Hugging Face directory (the CLI, from the checkpoint root).
    from laminar_trainer.cli import main as trainer_cli

    assert trainer_cli(["export", str(out / "two"), "--out", str(tmp_path / "export"),
                        "--dtype", "fp32"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, gathered[name]), name
    bf16 = export_model(two, tmp_path / "export16", "bf16")
    assert AutoModelForCausalLM.from_pretrained(str(bf16)).dtype == torch.bfloat16

    # A shard file gone: refused with the checkpoint named (not torch's BaseException).
    for shard in (two / "sharded").glob("__1_*.distcp"):
        shard.unlink()
    broken = build_training(one_cfg, None)
    with pytest.raises(LaminarError, match=r"sharded checkpoint .*step-00000002.* cannot be"):
        restore_training(broken, two, None)


def test_a_broken_sharded_checkpoint_is_refused_by_name(tmp_path):
    ckpt = tmp_path / "step-00000001"
    (ckpt / "trainer_state").mkdir(parents=True)
    (ckpt / "trainer_state" / "trainer.json").write_text(json.dumps(
        {"step": 1, "version": 1, "consumed": []}))
    (ckpt / "sharded").mkdir()
    from laminar_trainer.checkpoint import checkpoint_paths

    with pytest.raises(LaminarError, match="sharded/ has no .metadata"):
        checkpoint_paths(ckpt)


def test_activation_checkpointing_gives_the_same_gradients(model_dir):
    grads = {}
    for checkpointing in (False, True):
        cfg = TrainerConfig(model_dir=model_dir, batch_groups=4, seed=3,
                            activation_checkpointing=checkpointing,
                            optim={"lr": 1e-2, "grad_clip": 1e9})
        torch.manual_seed(3)
        training = build_training(cfg, None)
        assert _checkpointing(training.model) == checkpointing
        train_step(training.model, training.optimizer, training.scheduler, _groups(0), cfg)
        grads[checkpointing] = _grads(training)
    for name, grad in grads[False].items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(grads[True][name], grad, atol=1e-6), name
