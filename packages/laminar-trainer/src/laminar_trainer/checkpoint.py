"""Checkpoints: model, optimizer, step, weight version, consumed ids — written atomically.

Layout of ``<dir>/step-<NNNNNNNN>/``: the model and tokenizer
(``save_pretrained``), ``optimizer.safetensors`` (every optimizer state tensor)
with ``optimizer.json`` (param groups and scalar state), and ``trainer.json``
(step, version, the ids consumed up to this step, RNG seed). A checkpoint is
written into ``step-N.tmp`` and renamed into place, then ``LATEST`` is
replaced (also by rename), so a crash leaves the previous checkpoint intact
and never a partial one. Nothing is pickled.

The ids consumed after the latest checkpoint are rolled back with it: the
resumed trainer does not contain their update, may train them again, and the
manager only ever received acks for checkpointed ids.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from laminar_common.errors import LaminarError

__all__ = ["TrainerState", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "read_optimizer_state"]


@dataclass
class TrainerState:
    step: int
    version: int
    consumed: list[str]
    seed: int = 0


def _flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state dict (keyed by parameter index, or by name when gathered
    from FSDP) as safetensors tensors ``"<param>/<state>"`` plus JSON metadata."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float]] = {}
    int_keys = all(isinstance(k, int) for k in sd["state"])
    for param, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(param), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars, "int_keys": int_keys}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    key_of = int if meta.get("int_keys", True) else str
    state: dict[int | str, dict[str, object]] = {}
    for name, tensor in tensors.items():
        param, key = name.rsplit("/", 1)
        state.setdefault(key_of(param), {})[key] = tensor
    for param, values in meta["scalars"].items():
        state.setdefault(key_of(param), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(root: str | os.PathLike[str], model, tokenizer,
                    optimizer: torch.optim.Optimizer | None, state: TrainerState,
                    keep: int = 2, *, model_state: dict | None = None,
                    optimizer_state: dict | None = None) -> Path:
    """Write one checkpoint atomically; keep the newest ``keep``. Returns its dir.

    ``model``, ``tokenizer`` and ``optimizer`` may be None (simulated training step).
    ``model_state`` / ``optimizer_state``: full state dicts to write instead of
    the objects' own (an FSDP trainer gathers them to rank 0 first).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:08d}"
    tmp = root / f"step-{state.step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if model is not None:
        model.save_pretrained(tmp, state_dict=model_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if optimizer_state is None and optimizer is not None:
        optimizer_state = optimizer.state_dict()
    if optimizer_state is not None:
        tensors, meta = _flatten_optimizer(optimizer_state)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(meta))
    (tmp / "trainer.json").write_text(json.dumps(state.__dict__))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / "LATEST.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "LATEST")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    marker = Path(root) / "LATEST"
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    if not (path / "trainer.json").is_file():
        raise LaminarError(f"checkpoint {path} named by {marker} is incomplete")
    return path


def load_checkpoint(path: str | os.PathLike[str],
                    optimizer: torch.optim.Optimizer | None) -> TrainerState:
    """Restore the optimizer (if any) from ``path`` and return the trainer state.

    The model is loaded by the caller with ``from_pretrained(path)``.
    """
    path = Path(path)
    try:
        state = TrainerState(**json.loads((path / "trainer.json").read_text()))
        if optimizer is not None:
            optimizer.load_state_dict(read_optimizer_state(path))
    except (OSError, ValueError, TypeError) as exc:
        raise LaminarError(f"checkpoint {path} cannot be read: {exc}") from exc
    return state


def read_optimizer_state(path: str | os.PathLike[str]) -> dict:
    """The optimizer state dict stored in checkpoint ``path`` (as it was saved)."""
    path = Path(path)
    try:
        meta = json.loads((path / "optimizer.json").read_text())
        return _unflatten_optimizer(load_file(str(path / "optimizer.safetensors")), meta)
    except (OSError, ValueError, KeyError) as exc:
        raise LaminarError(f"checkpoint {path}: optimizer state cannot be read: {exc}") from exc
