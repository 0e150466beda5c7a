"""Checkpoints and model directories: written atomically, nothing pickled.

Layout of ``<dir>/step-<NNNNNNNN>/``:

- ``model/``: a clean Hugging Face directory (``save_pretrained``: safetensors,
  config.json, generation_config.json; the tokenizer: tokenizer.json,
  tokenizer_config.json with its chat template). It loads with
  ``from_pretrained`` as it is; the float32 master weights.
- ``trainer_state/``: ``optimizer.safetensors`` (every optimizer state tensor)
  with ``optimizer.json`` (param groups and scalar state), ``rng.safetensors``
  (torch's RNG states) and ``trainer.json`` (step, version, the ids consumed up
  to this step above the manager's watermark with their group numbers, the
  watermark, the seed). The LR schedule is a function of the step: a resume
  fast-forwards it.

A sharded checkpoint (``checkpoint.format: sharded``, for trainers on many
ranks) has ``sharded/`` instead of ``model/`` and the optimizer files:
``torch.distributed.checkpoint`` files that every rank writes its own shard of
(model under ``model.``, optimizer state under ``optim.``, keyed by parameter
name), and ``model_config/`` (config.json, generation_config.json, the
tokenizer; no weights). Nothing is gathered to one rank, and it resumes on any
number of ranks, one process included (the checkpoint reader reshards);
``laminar-trainer export`` turns it into a Hugging Face directory.

A checkpoint of the earlier flat layout (model files, ``trainer.json`` and the
optimizer files side by side in ``step-N/``) still loads. A checkpoint is
written into ``step-N.tmp`` and renamed into place, then ``LATEST`` is
replaced (also by rename), so a crash leaves the previous checkpoint intact
and never a partial one. :func:`save_model_dir` writes a bare model directory
(the trainer's final model) the same way.

The ids consumed after the latest checkpoint are rolled back with it: the
resumed trainer does not contain their update, may train them again, and the
manager only ever received acks for checkpointed ids.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from laminar_common.errors import LaminarError

__all__ = ["CheckpointPaths", "TrainerState", "checkpoint_paths", "latest_checkpoint",
           "load_checkpoint", "read_optimizer_state", "restore_rng", "save_checkpoint",
           "save_model_dir"]

MODEL_DIR = "model"
STATE_DIR = "trainer_state"
SHARDED_DIR = "sharded"
CONFIG_DIR = "model_config"


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


@dataclass(frozen=True)
class CheckpointPaths:
    """Where the parts of one checkpoint live."""

    root: Path
    """The ``step-N`` directory."""
    model: Path | None
    """The Hugging Face model directory (None: a simulated step saved no model)."""
    state: Path
    """The directory of ``trainer.json`` and the optimizer and RNG files."""
    sharded: Path | None = None
    """A sharded checkpoint's ``torch.distributed.checkpoint`` directory (model and
    optimizer); its ``model_config`` is beside it (None: a full checkpoint)."""


def checkpoint_paths(path: str | os.PathLike[str]) -> CheckpointPaths:
    """The parts of the checkpoint ``path`` (this layout or the earlier flat one).

    Raises:
        LaminarError: ``path`` holds no ``trainer_state/trainer.json`` (nor a
            flat ``trainer.json``): not a complete checkpoint.
    """
    root = Path(path)
    if (root / STATE_DIR / "trainer.json").is_file() and (root / SHARDED_DIR).is_dir():
        if not (root / SHARDED_DIR / ".metadata").is_file():
            raise LaminarError(f"checkpoint {root}: {SHARDED_DIR}/ has no .metadata (not a "
                               "complete torch.distributed.checkpoint)")
        return CheckpointPaths(root, None, root / STATE_DIR, root / SHARDED_DIR)
    if (root / STATE_DIR / "trainer.json").is_file():
        model = root / MODEL_DIR
        return CheckpointPaths(root, model if (model / "config.json").is_file() else None,
                               root / STATE_DIR)
    if (root / "trainer.json").is_file():  # the flat layout
        return CheckpointPaths(root, root if (root / "config.json").is_file() else None, root)
    raise LaminarError(f"checkpoint {root} is incomplete or not a checkpoint: it has no "
                       f"{STATE_DIR}/trainer.json")


def save_model_dir(out: str | os.PathLike[str], model, tokenizer, *,
                   state_dict: dict | None = None) -> Path:
    """Write ``model`` (and ``tokenizer``) as a Hugging Face directory, atomically.

    The directory is written as ``<out>.tmp`` and renamed over ``out`` (an
    existing one is replaced). The chat template goes into tokenizer_config.json,
    where every loader finds it. ``state_dict``: the weights to write instead of
    the model's own (a full state gathered from FSDP ranks). Returns ``out``.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _write_model(tmp, model, tokenizer, state_dict)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _write_model(out: Path, model, tokenizer, state_dict: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if model is not None:
        model.save_pretrained(out, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(out, save_jinja_files=False)


def _write_config(out: Path, model, tokenizer) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if model is not None:
        model.config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out, save_jinja_files=False)


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
                    optimizer_state: dict | None = None,
                    write_sharded: Callable[[Path], None] | None = None) -> Path:
    """Write one checkpoint atomically; keep the newest ``keep``. Returns its dir.

    ``model``, ``tokenizer`` and ``optimizer`` may be None (simulated training step).
    ``model_state`` / ``optimizer_state``: full state dicts to write instead of
    the objects' own (an FSDP trainer gathers them to rank 0 first).
    ``write_sharded``: write a sharded checkpoint instead: called with the
    (temporary) ``sharded/`` directory, it has every rank write its shards there
    (:meth:`~laminar_trainer.distributed.DistContext.save_sharded`); the model's
    config and tokenizer go to ``model_config/``, and no full state is written.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:08d}"
    tmp = root / f"step-{state.step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if write_sharded is not None:
        write_sharded(tmp / SHARDED_DIR)
        _write_config(tmp / CONFIG_DIR, model, tokenizer)
    elif model is not None or tokenizer is not None:
        _write_model(tmp / MODEL_DIR, model, tokenizer, model_state)
    state_dir = tmp / STATE_DIR
    state_dir.mkdir()
    if optimizer_state is None and optimizer is not None and write_sharded is None:
        optimizer_state = optimizer.state_dict()  # (a sharded one is in sharded/)
    if optimizer_state is not None:
        tensors, meta = _flatten_optimizer(optimizer_state)
        save_file(tensors, str(state_dir / "optimizer.safetensors"))
        (state_dir / "optimizer.json").write_text(json.dumps(meta))
    save_file(_rng_state(), str(state_dir / "rng.safetensors"))
    (state_dir / "trainer.json").write_text(json.dumps(state.__dict__))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / "LATEST.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "LATEST")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _rng_state() -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def restore_rng(path: str | os.PathLike[str]) -> bool:
    """Restore torch's RNG states from checkpoint ``path``; False when it has none
    (the flat layout). A CUDA state is restored only where CUDA is in use.

    Raises:
        LaminarError: ``rng.safetensors`` is unreadable or malformed.
    """
    file = checkpoint_paths(path).state / "rng.safetensors"
    if not file.is_file():
        return False
    try:
        rng = load_file(str(file))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(rng["cuda"])
    except (OSError, SafetensorError, KeyError, RuntimeError, TypeError) as exc:
        raise LaminarError(f"checkpoint file {file} cannot be restored: {exc}") from exc
    return True


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    marker = Path(root) / "LATEST"
    if not marker.is_file():
        return None
    try:
        path = Path(root) / marker.read_text(encoding="utf-8").strip()
    except (OSError, ValueError) as exc:
        raise LaminarError(f"checkpoint marker {marker} cannot be read: {exc}") from exc
    if not ((path / STATE_DIR / "trainer.json").is_file() or (path / "trainer.json").is_file()):
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

    The model is loaded by the caller with ``from_pretrained(checkpoint_paths(path).model)``;
    a sharded checkpoint's model and optimizer both with
    :func:`~laminar_trainer.distributed.load_sharded`.

    Raises:
        LaminarError: not a checkpoint, or a file of it is missing, unreadable or
            malformed (the message names it), or the optimizer state does not fit
            ``optimizer``.
    """
    paths = checkpoint_paths(path)
    file = paths.state / "trainer.json"
    state = _trainer_state(file, _read_json(file))
    if optimizer is not None and paths.sharded is None:
        saved = read_optimizer_state(path)
        try:
            optimizer.load_state_dict(saved)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LaminarError(
                f"checkpoint {paths.state}: the optimizer state in optimizer.json / "
                f"optimizer.safetensors does not fit this optimizer: {exc!r}") from exc
    return state


def read_optimizer_state(path: str | os.PathLike[str]) -> dict:
    """The optimizer state dict stored in checkpoint ``path`` (as it was saved).

    Raises:
        LaminarError: ``optimizer.json`` or ``optimizer.safetensors`` is missing,
            unreadable or malformed (the message names the file).
    """
    path = checkpoint_paths(path).state
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
