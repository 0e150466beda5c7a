"""Checkpoints: a clean Hugging Face ``model/`` beside ``trainer_state/``, resume from it,
the earlier flat layout still loads, and what is not a checkpoint is refused by path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from laminar_common.errors import LaminarError
from laminar_examples.demo_model import build_tiny_model, build_tokenizer
from laminar_trainer.checkpoint import (
    TrainerState,
    checkpoint_paths,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from laminar_trainer.config import TrainerConfig
from laminar_trainer.policy import build_training, restore_training

CHAT_TEMPLATE = "{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2,
                     intermediate_size=64).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _trained(model_dir):
    """A Training whose weights and optimizer state differ from model_dir's."""
    training = build_training(TrainerConfig(model_dir=model_dir, device="cpu"), None)
    ids = torch.tensor([[1, 10, 11, 12, 2]])
    loss = training.model(input_ids=ids, labels=ids).loss
    loss.backward()
    training.optimizer.step()
    training.scheduler.step()
    return training


def test_the_layout_is_a_clean_model_dir_beside_the_trainer_state(model_dir, tmp_path):
    training = _trained(model_dir)
    path = save_checkpoint(tmp_path / "ckpt", training.model, training.tokenizer,
                           training.optimizer, TrainerState(1, 1, ["a#0"], consumed_seqs=[0]))
    assert path == latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step-00000001"
    model_files = {p.name for p in (path / "model").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= model_files
    assert not any("optimizer" in name or name == "trainer.json" for name in model_files)
    assert json.loads((path / "model" / "tokenizer_config.json").read_text())[
        "chat_template"] == CHAT_TEMPLATE
    assert {p.name for p in (path / "trainer_state").iterdir()} == {
        "trainer.json", "optimizer.json", "optimizer.safetensors", "rng.safetensors"}
    loaded = AutoModelForCausalLM.from_pretrained(str(path / "model"))
    for name, tensor in training.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert AutoTokenizer.from_pretrained(str(path / "model")).chat_template == CHAT_TEMPLATE


def test_resume_restores_weights_optimizer_schedule_and_rng(model_dir, tmp_path):
    training = _trained(model_dir)
    torch.manual_seed(123)
    save_checkpoint(tmp_path, training.model, training.tokenizer, training.optimizer,
                    TrainerState(1, 4, ["a#0"], seed=5))
    expected_draw = torch.rand(3)
    torch.manual_seed(0)
    resumed = build_training(TrainerConfig(model_dir=model_dir, device="cpu"), None,
                             weights=latest_checkpoint(tmp_path))
    state = restore_training(resumed, latest_checkpoint(tmp_path), None)
    assert (state.step, state.version, state.consumed, state.seed) == (1, 4, ["a#0"], 5)
    assert torch.equal(torch.rand(3), expected_draw)
    for name, tensor in training.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    mine, theirs = training.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for idx in mine:
        assert torch.equal(mine[idx]["exp_avg"], theirs[idx]["exp_avg"])
    assert resumed.scheduler.last_epoch == training.scheduler.last_epoch == 1
    # Restoring into a model built from model_dir reads the checkpoint's weights too.
    fresh = build_training(TrainerConfig(model_dir=model_dir, device="cpu"), None)
    restore_training(fresh, latest_checkpoint(tmp_path), None)
    for name, tensor in training.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name


def test_a_checkpoint_of_the_flat_layout_still_loads(model_dir, tmp_path):
    training = _trained(model_dir)
    new = save_checkpoint(tmp_path / "new", training.model, training.tokenizer,
                          training.optimizer, TrainerState(3, 3, ["x#1"]))
    flat = tmp_path / "old" / "step-00000003"
    flat.mkdir(parents=True)
    for part in ("model", "trainer_state"):
        for file in (new / part).iterdir():
            if file.name != "rng.safetensors":  # the flat layout had none
                shutil.copy(file, flat / file.name)
    (tmp_path / "old" / "LATEST").write_text(flat.name)
    ckpt = latest_checkpoint(tmp_path / "old")
    paths = checkpoint_paths(ckpt)
    assert paths.model == paths.state == flat
    resumed = build_training(TrainerConfig(model_dir=model_dir, device="cpu"), None, weights=ckpt)
    state = restore_training(resumed, ckpt, None)
    assert state.step == 3 and state.consumed == ["x#1"]
    for name, tensor in training.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_what_is_not_a_checkpoint_is_refused_naming_its_path(tmp_path):
    (tmp_path / "step-00000001" / "model").mkdir(parents=True)
    (tmp_path / "LATEST").write_text("step-00000001")
    with pytest.raises(LaminarError, match=r"step-00000001 named by .*LATEST is incomplete"):
        latest_checkpoint(tmp_path)
    with pytest.raises(LaminarError, match=r"step-00000001 is incomplete or not a checkpoint"):
        load_checkpoint(tmp_path / "step-00000001", None)
    (tmp_path / "step-00000001" / "trainer_state").mkdir()
    (tmp_path / "step-00000001" / "trainer_state" / "trainer.json").write_text("[1]")
    with pytest.raises(LaminarError, match=r"trainer_state/trainer.json: expected an object"):
        load_checkpoint(tmp_path / "step-00000001", None)


def test_a_simulated_checkpoint_has_no_model(tmp_path):
    path = save_checkpoint(tmp_path, None, None, None, TrainerState(2, 2, []))
    assert not (path / "model").exists()
    assert checkpoint_paths(path).model is None
    assert load_checkpoint(path, None).step == 2
