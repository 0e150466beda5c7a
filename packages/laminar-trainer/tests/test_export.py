"""``laminar-trainer export``: a checkpoint's model as a clean Hugging Face directory that
``from_pretrained`` loads and that generates what the trainer's model generates."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from laminar_examples.demo_model import build_tiny_model, build_tokenizer
from laminar_trainer.checkpoint import TrainerState, save_checkpoint
from laminar_trainer.cli import main

CHAT_TEMPLATE = "{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint directory of a (perturbed) tiny model, and that model."""
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(len(tok), hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=4)
    with torch.no_grad():  # as if trained: weights a fresh build does not have
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[1, 10, 11]]), labels=torch.tensor([[1, 10, 11]])).loss.backward()
    optimizer.step()
    root = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(root, model, tok, optimizer, TrainerState(7, 7, []))
    return root, model.eval(), tok


def _greedy(model, tok, prompt: str) -> list[int]:
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_an_fp32_export_loads_and_generates_as_the_trainers_model(trained, tmp_path, capsys):
    root, model, tok = trained
    out = tmp_path / "hf"
    assert main(["export", str(root), "--out", str(out), "--dtype", "fp32"]) == 0
    assert f"to {out}" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not any("optimizer" in n or "trainer" in n or n == "rng.safetensors" for n in names)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    exported_tok = AutoTokenizer.from_pretrained(str(out))
    assert exported_tok.chat_template == CHAT_TEMPLATE
    for prompt in ("sort 3142=", "add 12+7=", "reverse 915="):
        assert exported_tok(prompt)["input_ids"] == tok(prompt)["input_ids"]
        assert _greedy(exported, exported_tok, prompt) == _greedy(model, tok, prompt)


def test_a_bf16_export_holds_the_bf16_cast_of_the_weights(trained, tmp_path):
    root, model, _ = trained
    out = tmp_path / "bf16"
    # A step checkpoint as the source (the root's LATEST names the same one).
    assert main(["export", str(root / "step-00000007"), "--out", str(out)]) == 0  # bf16 default
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert (out / "model.safetensors").stat().st_size < \
        (root / "step-00000007" / "model" / "model.safetensors").stat().st_size * 0.6


def test_an_existing_non_empty_out_is_refused_unless_forced(trained, tmp_path, capsys):
    root, _, _ = trained
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(root), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laminar-trainer export: ") and f"{out} exists and is not empty" in err
    assert (out / "notes.txt").read_text() == "mine"
    assert main(["export", str(root), "--out", str(out), "--force", "--dtype", "fp16"]) == 0
    assert not (out / "notes.txt").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    # An empty directory is fine; the export replaces it.
    (tmp_path / "empty").mkdir()
    assert main(["export", str(root), "--out", str(tmp_path / "empty")]) == 0


def test_bad_sources_are_refused_naming_the_path(trained, tmp_path, capsys):
    root, _, _ = trained
    missing = tmp_path / "nowhere"
    assert main(["export", str(missing), "--out", str(tmp_path / "o")]) == 2
    assert f"{missing} does not exist" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert f"{tmp_path} is neither a checkpoint nor a model directory" in \
        capsys.readouterr().err
    sim = tmp_path / "sim"
    save_checkpoint(sim, None, None, None, TrainerState(1, 1, []))
    assert main(["export", str(sim), "--out", str(tmp_path / "o")]) == 2
    assert "holds no model (a simulated training step)" in capsys.readouterr().err
    model_dir = root / "step-00000007" / "model"
    assert main(["export", str(model_dir), "--out", str(model_dir), "--force"]) == 2
    assert "is or holds the source" in capsys.readouterr().err
    assert main(["export", str(root), "--out", str(tmp_path / "o"), "--dtype", "int8"]) == 2
    assert not (tmp_path / "o").exists()
