"""Precision: bf16 mixed precision keeps fp32 master weights and optimizer state, and the
weights are published in ``publish_dtype`` (half the bytes in bf16), cast floating only."""

from __future__ import annotations

import math

import pytest
import torch

from laminar_common.codec import Trajectory
from laminar_common.relay.client import FetchedWeights
from laminar_common.relay.manifests import build_manifest, flatten
from laminar_examples.demo_model import build_tiny_model, build_tokenizer
from laminar_trainer.buffer import Group
from laminar_trainer.config import TrainerConfig
from laminar_trainer.logprobs import compute_token_logprobs
from laminar_trainer.policy import build_training
from laminar_trainer.precision import autocast, mixed_precision_policy, torch_dtype
from laminar_trainer.publisher import snapshot_model
from laminar_trainer.publishing import load_into, state_dict_from
from laminar_trainer.step import train_step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2,
                     intermediate_size=64, seed=2).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _groups(reward_nan: bool = False) -> list[Group]:
    gen = torch.Generator().manual_seed(0)
    groups = []
    for g in range(2):
        trajs = {}
        for i in range(2):
            resp = tuple(int(x) for x in torch.randint(4, 30, (5,), generator=gen))
            reward = math.nan if reward_nan and g == i == 0 else float((g + i) % 2)
            trajs[i] = Trajectory(
                trajectory_id=f"g{g}#{i}", prompt_id=f"g{g}", group_size=2, sample_index=i,
                worker_id="w", policy_version=0, prompt_token_ids=(1, 10 + g, 11),
                response_token_ids=resp, behaviour_logprobs=(-3.0,) * 5, reward=reward,
                finish_reason="stop")
        groups.append(Group(f"g{g}", 2, trajs))
    return groups


def _step(model_dir, dtype, groups):
    torch.manual_seed(1)
    cfg = TrainerConfig(model_dir=model_dir, device="cpu", dtype=dtype, optim={"lr": 1e-2})
    training = build_training(cfg, None)
    result = train_step(training.model, training.optimizer, training.scheduler, groups, cfg)
    return training, result


def test_bf16_mixed_precision_keeps_fp32_master_weights_and_optimizer_state(model_dir):
    fp32, r32 = _step(model_dir, "float32", _groups())
    bf16, r16 = _step(model_dir, "bfloat16", _groups())
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    for state in bf16.optimizer.state_dict()["state"].values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert r16.stats["skipped_nonfinite"] == 0.0 and math.isfinite(r16.loss)
    # The same objective, computed from bf16 matmuls: close, not equal.
    assert r16.loss == pytest.approx(r32.loss, abs=0.05)
    assert r16.loss != r32.loss
    moved = sum(not torch.equal(a, b) for a, b in zip(
        fp32.model.state_dict().values(), bf16.model.state_dict().values()))
    assert moved > 0  # the two precisions took (slightly) different updates
    ids = torch.tensor([[1, 10, 11, 12, 13]])
    with autocast(torch.device("cpu"), "bfloat16"):
        logits = bf16.model(input_ids=ids).logits
        logprobs = compute_token_logprobs(bf16.model, ids, torch.ones_like(ids))
    assert logits.dtype == torch.bfloat16 and logprobs.dtype == torch.float32


def test_the_non_finite_guard_holds_in_bf16(model_dir):
    torch.manual_seed(1)
    cfg = TrainerConfig(model_dir=model_dir, device="cpu", dtype="bfloat16")
    training = build_training(cfg, None)
    before = {k: v.clone() for k, v in training.model.state_dict().items()}
    result = train_step(training.model, training.optimizer, training.scheduler,
                        _groups(reward_nan=True), cfg)
    assert result.stats["skipped_nonfinite"] == 1.0
    for name, tensor in training.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_the_fsdp_policy_follows_the_training_dtype():
    assert mixed_precision_policy("float32") is None
    policy = mixed_precision_policy("bfloat16")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert torch_dtype("bf16") is torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        torch_dtype("int8")


def test_a_bf16_publish_carries_half_the_bytes_and_loads_into_fp32(model_dir):
    """The demo model's default size, published as the trainer does (snapshot_model)."""
    tok = build_tokenizer()
    model = build_tiny_model(len(tok))
    model.register_buffer("steps_seen", torch.tensor([3], dtype=torch.int64))
    full = snapshot_model(model, 1, 1)
    half = snapshot_model(model, 1, 1, dtype=torch.bfloat16)
    floats = sum(t.numel() * 4 for t in model.state_dict().values() if t.is_floating_point())
    assert half.nbytes == full.nbytes - floats // 2
    dtypes = {name: dtype for name, dtype, _, _ in half.tensors}
    assert dtypes.pop("steps_seen") == "int64" and set(dtypes.values()) == {"bfloat16"}
    # Through the relay's byte layout and back into an fp32 model: the bf16 cast.
    manifest, buffers = build_manifest(1, half.tensors, chunk_bytes=1 << 16)
    fetched = FetchedWeights(manifest, memoryview(bytes(flatten(manifest, buffers))), "shm", "r")
    assert state_dict_from(fetched)["lm_head.weight"].dtype == torch.bfloat16
    target = build_tiny_model(len(tok), seed=9)
    target.register_buffer("steps_seen", torch.tensor([0], dtype=torch.int64))
    load_into(target, fetched)
    for name, tensor in model.state_dict().items():
        want = tensor.to(torch.bfloat16).to(tensor.dtype) if tensor.is_floating_point() else tensor
        assert torch.equal(target.state_dict()[name], want), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_bf16_step_on_cuda_keeps_fp32_master_weights(model_dir):
    runs = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(1)
        cfg = TrainerConfig(model_dir=model_dir, device="cuda", dtype=dtype, optim={"lr": 1e-2})
        training = build_training(cfg, None)
        runs[dtype] = train_step(training.model, training.optimizer, training.scheduler,
                                 _groups(), cfg)
        assert {p.dtype for p in training.model.parameters()} == {torch.float32}
    assert runs["bfloat16"].stats["skipped_nonfinite"] == 0.0
    assert runs["bfloat16"].loss == pytest.approx(runs["float32"].loss, abs=0.05)
