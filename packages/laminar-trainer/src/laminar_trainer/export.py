"""``laminar-trainer export``: a checkpoint's model as a clean Hugging Face directory.

The source is a checkpoint root (its ``LATEST``), one ``step-N`` checkpoint
(this layout, a sharded one, or the earlier flat one), or a model directory (the trainer's
``final`` one, a warm start). The output holds the weights in safetensors in
the asked dtype (config.json's ``dtype`` says the same), config.json,
generation_config.json and the tokenizer (tokenizer.json, tokenizer_config.json
with the chat template when the source has one); never optimizer or trainer
state. It is written beside ``out`` and renamed into place, so a failed export
leaves no partial directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from laminar_common.errors import LaminarError

from .checkpoint import (
    CONFIG_DIR,
    SHARDED_DIR,
    CheckpointPaths,
    checkpoint_paths,
    latest_checkpoint,
)

__all__ = ["export_model", "resolve_model_dir"]


def resolve_model_dir(source: str | os.PathLike[str]) -> Path:
    """The model directory of ``source`` (see module docstring); for a sharded
    checkpoint, the checkpoint's own directory (its weights are in ``sharded/``).

    Raises:
        LaminarError: ``source`` is none of those, or a checkpoint without a model
            (a simulated training step's); the message names the path.
    """
    path = Path(source)
    if not path.is_dir():
        raise LaminarError(f"{path} does not exist or is not a directory")
    if (path / "LATEST").is_file():
        ckpt = latest_checkpoint(path)
        assert ckpt is not None
        path = ckpt
    if (path / "config.json").is_file() and not (path / "trainer.json").is_file():
        return path
    if _sharded_checkpoint(path) is not None:
        return path
    try:
        model = checkpoint_paths(path).model
    except LaminarError as exc:
        raise LaminarError(f"{path} is neither a checkpoint nor a model directory (no "
                           "config.json, no trainer_state/)") from exc
    if model is None:
        raise LaminarError(f"checkpoint {path} holds no model (a simulated training step)")
    return model


def _sharded_checkpoint(path: Path) -> CheckpointPaths | None:
    """The paths of checkpoint ``path`` if it is a (complete) sharded one, else None."""
    if not (path / SHARDED_DIR).is_dir():
        return None
    paths = checkpoint_paths(path)
    if not (path / CONFIG_DIR / "config.json").is_file():
        raise LaminarError(f"sharded checkpoint {path} has no {CONFIG_DIR}/config.json")
    return paths


def export_model(source: str | os.PathLike[str], out: str | os.PathLike[str],
                 dtype: str = "bfloat16", *, force: bool = False) -> Path:
    """Write the model of ``source`` to ``out`` in ``dtype``; returns ``out``.

    Args:
        dtype: ``float32``, ``bfloat16`` or ``float16`` (or ``fp32``, ``bf16``, ``fp16``).
        force: replace an existing non-empty ``out``.

    Raises:
        LaminarError: a bad source (see :func:`resolve_model_dir`), ``out`` exists
            and is not empty (without ``force``), ``out`` is or holds the source, or
            the model cannot be loaded.
        ValueError: an unknown dtype.
    """
    from .precision import torch_dtype

    want = torch_dtype(dtype)
    model_dir = resolve_model_dir(source)
    sharded = _sharded_checkpoint(model_dir)
    if sharded is not None:
        model_dir = sharded.root / CONFIG_DIR  # config and tokenizer; weights in sharded/
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise LaminarError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise LaminarError(f"output directory {out} exists and is not empty "
                           "(--force replaces it)")
    here, there = model_dir.resolve(), out.resolve()
    if here == there or there in here.parents:
        raise LaminarError(f"output directory {out} is or holds the source {model_dir}")

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        if sharded is not None:
            import torch

            from .distributed import load_sharded

            config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            load_sharded(model, None, sharded.sharded)
            model = model.to(want)
            model.config.dtype = want
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=want,
                                                         local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise LaminarError(f"cannot load the model in {model_dir}: {exc}") from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    # The chat template in tokenizer_config.json, where every loader finds it.
    tokenizer.save_pretrained(tmp, save_jinja_files=False)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
