"""Run by test_distributed.py under ``torchrun --nproc-per-node 2`` (gloo, CPU).

First every rank takes one ``train_step`` itself on the first step's groups with
``grads_config.json`` (no clipping) and rank 0 writes the full gradient it left
(``grads.safetensors``). Then rank 0 drives the followers with the same ``DistContext`` calls as
``TrainerService`` (send_step, gather_for_publish, gather_for_checkpoint,
send_eval, then STOP); ranks > 0 run ``run_follower``. Rank 0 writes what
the test compares: the gathered weights after the steps, the losses, the eval
accuracy and a checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

from laminar_trainer.checkpoint import TrainerState, save_checkpoint
from laminar_trainer.config import TrainerConfig
from laminar_trainer.distributed import Command, decode_groups, init_distributed
from laminar_trainer.policy import build_training, evaluate_records, run_follower
from laminar_trainer.step import train_step


def main(model_dir: str, groups_file: str, out: str) -> int:
    cfg = TrainerConfig(**json.loads(Path(out, "config.json").read_text()))
    ctx = init_distributed("cpu", cfg.batch_groups, 300, cfg.optim.mini_batches)
    assert ctx is not None and ctx.world_size == 2
    steps = [decode_groups(p) for p in msgspec.msgpack.decode(Path(groups_file).read_bytes())]
    try:
        grads_cfg = TrainerConfig(**json.loads(Path(out, "grads_config.json").read_text()))
        torch.manual_seed(grads_cfg.seed)
        probe = build_training(grads_cfg, ctx)
        train_step(probe.model, probe.optimizer, probe.scheduler, steps[0], grads_cfg, dist=ctx)
        grads = {name: p.grad.full_tensor() for name, p in probe.model.named_parameters()}
        if ctx.is_main:
            save_file({k: v.contiguous() for k, v in grads.items()},
                      str(Path(out, "grads.safetensors")))
        del probe
        if not ctx.is_main:
            return run_follower(cfg, ctx)
        torch.manual_seed(cfg.seed)
        training = build_training(cfg, ctx)
        ctx.broadcast_int(-1)  # no checkpoint to restore (what restore_training sends)
        losses = []
        for groups in steps:
            result = train_step(training.model, training.optimizer, training.scheduler,
                                ctx.send_step(groups), cfg, dist=ctx)
            losses.append(result.loss)
        full = ctx.gather_for_publish(training.model)
        save_file({k: v.contiguous() for k, v in full.items()}, str(Path(out, "gathered.safetensors")))
        model_state, optim_state = ctx.gather_for_checkpoint(training.model, training.optimizer)
        save_checkpoint(Path(out, "ckpt"), training.model, training.tokenizer, training.optimizer,
                        TrainerState(len(steps), len(steps), []), model_state=model_state,
                        optimizer_state=optim_state)
        records = json.loads(Path(out, "eval.json").read_text())
        ctx.send_eval(records, 8)
        accuracy = evaluate_records(training, records, cfg).accuracy
        ctx.send_command(Command.STOP)
        Path(out, "result.json").write_text(json.dumps({"losses": losses, "accuracy": accuracy}))
        return 0
    finally:
        ctx.close()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
