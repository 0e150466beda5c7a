"""Run by test_distributed.py under ``torchrun --nproc-per-node 2`` (gloo, CPU).

The ranks build a tied-embedding Qwen2 model on the meta device (each reading its own
rows), with activation checkpointing, then:

1. resume from the sharded checkpoint ``<out>/one/step-*`` that ONE process wrote
   (another rank count) and gather the weights (``resumed.safetensors``);
2. take one training step, publish-gather in bfloat16 (``published.safetensors``) and
   in float32 (``gathered.safetensors``);
3. write a sharded checkpoint into ``<out>/two`` (each rank its own shards).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

from laminar_trainer.checkpoint import TrainerState, latest_checkpoint, save_checkpoint
from laminar_trainer.config import TrainerConfig
from laminar_trainer.distributed import Command, decode_groups, init_distributed
from laminar_trainer.policy import build_training, restore_training, run_follower
from laminar_trainer.step import train_step


def main(groups_file: str, out: str) -> int:
    cfg = TrainerConfig(**json.loads(Path(out, "config.json").read_text()))
    ctx = init_distributed("cpu", cfg.batch_groups, 300, cfg.optim.mini_batches)
    assert ctx is not None and ctx.world_size == 2
    steps = [decode_groups(p) for p in msgspec.msgpack.decode(Path(groups_file).read_bytes())]
    try:
        if not ctx.is_main:
            return run_follower(cfg, ctx)
        torch.manual_seed(cfg.seed)
        training = build_training(cfg, ctx)
        state = restore_training(training, latest_checkpoint(Path(out, "one")), ctx)
        assert state is not None and state.step == 1, state
        resumed = ctx.gather_for_publish(training.model)
        save_file({k: v.contiguous() for k, v in resumed.items()},
                  str(Path(out, "resumed.safetensors")))
        result = train_step(training.model, training.optimizer, training.scheduler,
                            ctx.send_step(steps[1]), cfg, dist=ctx)
        published = ctx.gather_for_publish(training.model, torch.bfloat16)
        save_file({k: v.contiguous() for k, v in published.items()},
                  str(Path(out, "published.safetensors")))
        gathered = ctx.gather_for_publish(training.model)
        save_file({k: v.contiguous() for k, v in gathered.items()},
                  str(Path(out, "gathered.safetensors")))
        model, optimizer = training.model, training.optimizer
        save_checkpoint(Path(out, "two"), model, training.tokenizer, optimizer,
                        TrainerState(2, 2, []),
                        write_sharded=lambda p: ctx.save_sharded(model, optimizer, p))
        ctx.send_command(Command.STOP)
        Path(out, "result.json").write_text(json.dumps({"loss": result.loss}))
        return 0
    finally:
        ctx.close()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
