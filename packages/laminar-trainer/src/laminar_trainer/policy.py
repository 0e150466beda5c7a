"""The policy a trainer rank holds: model, tokenizer, optimizer, schedule — and the follower loop.

``build_training`` is called the same way on every rank (rank 0 inside
``TrainerService``, ranks > 0 in ``run_follower``), so the FSDP shards, the
optimizer and the LR schedule line up. ``restore_training`` restores a
checkpoint: in one process from its files; across ranks rank 0 reads it and
the full state is sharded from there (only rank 0 needs the checkpoint
directory); a sharded checkpoint is read by every rank.

``run_follower`` is the whole life of a rank > 0: build, restore if rank 0
says so, then execute rank 0's commands (``laminar_trainer.distributed``)
until ``STOP``.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from laminar_common.errors import LaminarError

from .checkpoint import (
    TrainerState,
    checkpoint_paths,
    load_checkpoint,
    read_optimizer_state,
    restore_rng,
)
from .config import TrainerConfig
from .distributed import (
    Command,
    DistContext,
    decode_groups,
    enable_activation_checkpointing,
    load_sharded,
    resolve_device,
    save_sharded,
)
from .step import make_optimizer, train_step

__all__ = ["Training", "build_training", "evaluate_records", "restore_training", "run_follower"]

log = logging.getLogger(__name__)


@dataclass
class Training:
    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ref_model: Any
    device: torch.device
    weights_from: Path
    """The directory the model's weights were loaded from."""


def build_training(cfg: TrainerConfig, ctx: DistContext | None,
                   weights: Path | None = None) -> Training:
    """Load ``cfg.model_dir`` on this rank's device (sharded with FSDP2 under torchrun).

    The parameters are float32 whatever ``cfg.dtype`` says (the master weights;
    bfloat16 is autocast in the step, and FSDP2's mixed-precision policy).

    ``weights``: take the model's weights from this checkpoint instead (one
    about to be restored in one process, so it is read once).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = ctx.device if ctx is not None else resolve_device(cfg.device)
    if weights is not None and checkpoint_paths(weights).sharded is not None:
        weights = None  # restore_training loads it (model and optimizer together)
    source = Path(cfg.model_dir) if weights is None else _checkpoint_model(weights)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
    ref_model = None
    if ctx is not None:
        # Built on the meta device, each rank reading only its shard (no full copy).
        model = ctx.build_sharded(source, cfg.dtype, cfg.activation_checkpointing)
        if cfg.loss.kl_coef > 0:
            ref_model = ctx.build_sharded(cfg.model_dir, cfg.dtype)
            ref_model.eval().requires_grad_(False)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).to(device)
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        if cfg.loss.kl_coef > 0:
            ref_model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
            ref_model = ref_model.to(device).eval().requires_grad_(False)
    optimizer, scheduler = make_optimizer(model, cfg.optim, cfg.total_steps)
    return Training(model, tokenizer, optimizer, scheduler, ref_model, device, source)


def _checkpoint_model(ckpt: Path) -> Path:
    paths = checkpoint_paths(ckpt)
    model = paths.model
    if paths.sharded is not None:
        raise LaminarError(f"checkpoint {ckpt} is sharded: it has no model directory")
    if model is None:
        raise LaminarError(f"checkpoint {ckpt} holds no model (written by a simulated "
                           "training step)")
    return model


def restore_training(training: Training, ckpt: Path | None, ctx: DistContext | None
                     ) -> TrainerState | None:
    """Restore model, optimizer, schedule and RNG from ``ckpt`` (rank 0's choice on
    every rank; followers keep their own RNG).

    A sharded checkpoint is read by every rank, each its own shards (rank 0 sends
    the path, so the checkpoint directory must be on a filesystem they share).

    Returns the checkpoint's trainer state on rank 0 (None without a checkpoint,
    and on followers, which learn only the step).
    """
    if ctx is None:
        if ckpt is None:
            return None
        sharded = checkpoint_paths(ckpt).sharded
        if sharded is not None:
            state = load_checkpoint(ckpt, None)
            _restore_sharded(training, ckpt, sharded, state.step)
            return state
        model_dir = _checkpoint_model(ckpt)
        if training.weights_from != model_dir:
            from transformers import AutoModelForCausalLM

            saved = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            training.model.load_state_dict(saved.state_dict())
        state = load_checkpoint(ckpt, training.optimizer)
        restore_rng(ckpt)
        _advance(training, state.step)
        return state
    state = load_checkpoint(ckpt, None) if ctx.is_main and ckpt is not None else None
    step = ctx.broadcast_int(state.step if state is not None else -1)
    if step < 0:
        return None
    sharded = checkpoint_paths(ckpt).sharded if ctx.is_main else None
    where = ctx.broadcast_bytes(os.fsencode(sharded) if sharded is not None else b"")
    if where:
        _restore_sharded(training, ckpt if ctx.is_main else None, os.fsdecode(where), step)
        return state
    model_state: dict = {}
    optim_state: dict = {}
    if ctx.is_main:
        from transformers import AutoModelForCausalLM

        model_state = AutoModelForCausalLM.from_pretrained(
            str(_checkpoint_model(ckpt)), dtype=torch.float32).state_dict()
        optim_state = read_optimizer_state(ckpt)
        restore_rng(ckpt)
    ctx.load_full_state(training.model, training.optimizer, model_state, optim_state)
    _advance(training, step)
    return state


def _restore_sharded(training: Training, ckpt: Path | None, sharded: str | os.PathLike[str],
                     step: int) -> None:
    """Model and optimizer from a sharded checkpoint (this rank's shards, whatever the
    number of ranks that wrote it), the RNG from ``ckpt`` (None: a follower keeps its
    own), the schedule fast-forwarded to ``step``."""
    load_sharded(training.model, training.optimizer, sharded)
    if ckpt is not None:
        restore_rng(ckpt)
    _advance(training, step)


def _advance(training: Training, step: int) -> None:
    # Fast-forward the LR schedule to ``step``; torch warns about scheduler steps
    # without optimizer steps, which is exactly what a fast-forward is.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        for _ in range(step):
            training.scheduler.step()


def evaluate_records(training: Training, records: list[dict], cfg: TrainerConfig):
    """Held-out :class:`~laminar_trainer.evaluation.EvalResult` of ``records``
    (see :mod:`laminar_trainer.evaluation`; every rank of a sharded model must
    call it alike)."""
    from .evaluation import evaluate

    training.model.eval()
    try:
        with torch.no_grad():
            return evaluate(training.model, training.tokenizer, records, cfg.eval,
                            model_dir=cfg.model_dir)
    finally:
        training.model.train()


def run_follower(cfg: TrainerConfig, ctx: DistContext) -> int:
    """A rank > 0: mirror rank 0's collectives until it sends ``STOP``; returns 0."""
    if cfg.model_dir is None:
        raise LaminarError("trainer config: a multi-rank trainer needs model_dir "
                           "(the simulated step runs on one rank)")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    training = build_training(cfg, ctx)
    restore_training(training, None, ctx)
    steps = 0
    while True:
        command, payload, arg = ctx.recv_command()
        if command == Command.STEP:
            train_step(training.model, training.optimizer, training.scheduler,
                       decode_groups(payload), cfg, ref_model=training.ref_model, dist=ctx,
                       version=arg)
            steps += 1
        elif command == Command.GATHER:
            ctx.gather_tensors(training.model)
        elif command == Command.CHECKPOINT and arg == 1:
            save_sharded(training.model, training.optimizer, os.fsdecode(payload))
        elif command == Command.CHECKPOINT:
            ctx.full_model_state(training.model)
            ctx.full_optimizer_state(training.model, training.optimizer)
        elif command == Command.EVAL:
            records = msgspec.msgpack.decode(payload, type=list[dict])
            evaluate_records(training, records, cfg)
        elif command == Command.STOP:
            log.info("rank %d: stop after %d steps", ctx.rank, steps)
            return 0
