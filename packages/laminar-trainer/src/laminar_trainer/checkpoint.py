"""Checkpoints: model, optimizer, step, weight version, consumed ids — written atomically.

Layout of ``<dir>/step-<NNNNNNNN>/``: the model and tokenizer
(``save_pretrained``), ``optimizer.safetensors`` (every optimizer state tensor)
with ``optimizer.json`` (param groups and scalar state), and ``trainer.json``
(step, version, the ids consumed up to this step above the manager's
watermark with their group numbers, the watermark, RNG seed). A checkpoint is
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
from safetensors import SafetensorError
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
    consumed_seqs: list[int] | None = None
    """Group number of each id in ``consumed`` (same order); None in old checkpoints."""
    settled_below: int = -1
    """The manager's watermark: ids of groups below it are not listed (all settled)."""
    failed: dict[str, str] | None = None
    """Consumed ids that were given up on (rejected too often), with the reason."""


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
    try:
        path = Path(root) / marker.read_text(encoding="utf-8").strip()
    except (OSError, ValueError) as exc:
        raise LaminarError(f"checkpoint marker {marker} cannot be read: {exc}") from exc
    if not (path / "trainer.json").is_file():
        raise LaminarError(f"checkpoint {path} named by {marker} is incomplete")
    return path


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 or JSON
        raise LaminarError(f"checkpoint file {file} cannot be read: {exc}") from exc


def _trainer_state(file: Path, data: object) -> TrainerState:
    """``trainer.json``'s object as a TrainerState, every field of its type."""
    fields = {"step": int, "version": int, "consumed": list, "seed": int,
              "consumed_seqs": list, "settled_below": int, "failed": dict}
    required = {"step", "version", "consumed"}
    if not isinstance(data, dict) or not required <= data.keys() <= fields.keys():
        raise LaminarError(f"checkpoint file {file}: expected an object with step, version, "
                           f"consumed (and seed), got {str(data)[:200]}")
    for name, kind in fields.items():
        value = data.get(name, kind())
        if name in ("consumed_seqs", "failed") and value is None:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            raise LaminarError(f"checkpoint file {file}: {name} must be {kind.__name__}, "
                               f"got {value!r:.200}")
    if not all(isinstance(i, str) for i in data["consumed"]):
        raise LaminarError(f"checkpoint file {file}: consumed must list trajectory ids (strings)")
    seqs = data.get("consumed_seqs")
    if seqs is not None and (len(seqs) != len(data["consumed"]) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in seqs)):
        raise LaminarError(f"checkpoint file {file}: consumed_seqs must list one group number "
                           f"(an int) per consumed id")
    failed = data.get("failed") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in failed.items()):
        raise LaminarError(f"checkpoint file {file}: failed must map trajectory ids to reasons")
    return TrainerState(**data)


def load_checkpoint(path: str | os.PathLike[str],
                    optimizer: torch.optim.Optimizer | None) -> TrainerState:
    """Restore the optimizer (if any) from ``path`` and return the trainer state.

    The model is loaded by the caller with ``from_pretrained(path)``.

    Raises:
        LaminarError: a file of the checkpoint is missing, unreadable or malformed
            (the message names it), or the optimizer state does not fit ``optimizer``.
    """
    path = Path(path)
    state = _trainer_state(path / "trainer.json", _read_json(path / "trainer.json"))
    if optimizer is not None:
        saved = read_optimizer_state(path)
        try:
            optimizer.load_state_dict(saved)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LaminarError(
                f"checkpoint {path}: the optimizer state in optimizer.json / "
                f"optimizer.safetensors does not fit this optimizer: {exc!r}") from exc
    return state


def read_optimizer_state(path: str | os.PathLike[str]) -> dict:
    """The optimizer state dict stored in checkpoint ``path`` (as it was saved).

    Raises:
        LaminarError: ``optimizer.json`` or ``optimizer.safetensors`` is missing,
            unreadable or malformed (the message names the file).
    """
    path = Path(path)
    meta_file, tensor_file = path / "optimizer.json", path / "optimizer.safetensors"
    meta = _read_json(meta_file)
    if not (isinstance(meta, dict) and isinstance(meta.get("param_groups"), list)
            and isinstance(meta.get("scalars"), dict)
            and all(isinstance(v, dict) for v in meta["scalars"].values())
            and isinstance(meta.get("int_keys", True), bool)):
        raise LaminarError(f"checkpoint file {meta_file}: expected an object with param_groups "
                           f"(a list), scalars (parameter -> object) and int_keys (a bool), "
                           f"got {str(meta)[:200]}")
    try:
        tensors = load_file(str(tensor_file))
    except (OSError, SafetensorError) as exc:
        raise LaminarError(f"checkpoint file {tensor_file} cannot be read: {exc}") from exc
    try:
        return _unflatten_optimizer(tensors, meta)
    except ValueError as exc:  # a tensor or parameter name that is not "<param>/<state>"
        raise LaminarError(f"checkpoint {path}: optimizer.json and optimizer.safetensors do not "
                           f"match: {exc}") from exc
