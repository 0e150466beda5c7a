"""One optimizer step on a list of complete GRPO groups (the math lives in ``loss``).

Builds the padded batch from the trajectories (prompt + response token ids),
recomputes the policy's log-probs at the workers' sampling temperature,
lines up the behaviour log-probs the workers recorded, and applies
``compute_policy_loss`` with group-normalised advantages (scaled by each
group's buffer weight), an optional KL to the reference model, gradient
accumulation over micro-batches of groups, and global-norm clipping.

Precision (``cfg.dtype``): the forwards and backward run under
``laminar_trainer.precision.autocast`` (bfloat16 mixed precision, or nothing
for float32); the parameters, their gradients and the optimizer state stay
float32, and log-probs are computed in float32 from the logits, so the loss,
the gradient norm and the non-finite guard are float32 in both modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .buffer import Group
from .logprobs import compute_token_logprobs, model_device, pack_sequences
from .loss import compute_grpo_advantages, compute_kl_penalty, compute_policy_loss
from .precision import autocast

__all__ = ["StepResult", "make_optimizer", "train_step"]


@dataclass
class StepResult:
    loss: float
    reward_mean: float
    tokens: int
    stats: dict[str, float] = field(default_factory=dict)

    @classmethod
    def simulated(cls, groups: list[Group]) -> StepResult:
        trajs = [t for g in groups for t in g.trajectories()]
        return cls(0.0, sum(t.reward for t in trajs) / len(trajs),
                   sum(len(t.response_token_ids) for t in trajs))


def make_optimizer(model: torch.nn.Module, cfg, total_steps: int):
    """AdamW with linear warm-up, then constant or cosine decay (stepped once per step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            span = max(1, total_steps - cfg.warmup_steps)
            progress = min(1.0, (step - cfg.warmup_steps) / span)
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _micro_batches(groups: list[Group], size: int) -> list[list[Group]]:
    if size <= 0:
        return [groups]
    return [groups[i:i + size] for i in range(0, len(groups), size)]


def train_step(model, optimizer, scheduler, groups: list[Group], cfg, ref_model=None,
               dist=None) -> StepResult:
    """Forward, backward and one optimizer step over ``groups``; returns loss and stats.

    With ``dist`` (a ``laminar_trainer.distributed.DistContext`` of an FSDP
    model), ``groups`` is this rank's shard: FSDP averages the gradients over
    the ranks during backward, and the loss and stats are averaged over them
    here, so every rank returns the same numbers. Equal shards make a step on
    N ranks the same update as one rank with N micro-batches.
    """
    device = model_device(model)
    trajs_all = [t for g in groups for t in g.trajectories()]
    total_tokens = sum(len(t.response_token_ids) for t in trajs_all)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    stats_sum: dict[str, float] = {}
    micro = _micro_batches(groups, cfg.optim.micro_batch_groups)
    for part in micro:
        trajs = [t for g in part for t in g.trajectories()]
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        group_ids = [t.prompt_id for t in trajs]
        weights = torch.tensor([g.weight for g in part for _ in g.members], dtype=torch.float32)
        adv = compute_grpo_advantages(rewards, group_ids) * weights
        input_ids, attn, comp_mask = pack_sequences([list(t.prompt_token_ids) for t in trajs],
                                                    [list(t.response_token_ids) for t in trajs])
        old = torch.zeros(comp_mask.shape, dtype=torch.float32)
        for row, t in enumerate(trajs):
            cols = comp_mask[row].nonzero().squeeze(-1)
            old[row, cols] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
        input_ids, attn, comp_mask = input_ids.to(device), attn.to(device), comp_mask.to(device)
        old, adv = old.to(device), adv.to(device)
        # Each trajectory's own sampling temperature (validation refused any that
        # differ from a temperature fixed in the trainer's config).
        temps = torch.tensor([t.sampling.temperature for t in trajs], dtype=torch.float32)
        with autocast(device, cfg.dtype):
            logprobs = compute_token_logprobs(model, input_ids, attn, temps)
        loss, stats = compute_policy_loss(
            logprobs, old, adv[:, None].expand_as(logprobs), comp_mask,
            clip_low=cfg.loss.clip_low, clip_high=cfg.loss.clip_high,
            correction=cfg.loss.correction, tis_cap=cfg.loss.tis_cap,
            aggregation=cfg.loss.aggregation)
        if ref_model is not None and cfg.loss.kl_coef > 0:
            with torch.no_grad(), autocast(device, cfg.dtype):
                ref = compute_token_logprobs(ref_model, input_ids, attn, temps)
            kl = compute_kl_penalty(logprobs, ref, comp_mask, aggregation=cfg.loss.aggregation)
            loss = loss + cfg.loss.kl_coef * kl
            stats["kl"] = float(kl)
        share = len(trajs) / len(trajs_all)
        (loss * share).backward()
        loss_sum += float(loss.detach()) * share
        for key, value in stats.items():
            stats_sum[key] = stats_sum.get(key, 0.0) + float(value) * share
    if dist is not None:
        loss_sum, stats_sum = dist.mean_over_ranks(loss_sum, stats_sum)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor: the norm over every shard
        grad_norm = grad_norm.full_tensor()
    # A non-finite loss or gradient never reaches the weights: the update is skipped
    # (every rank sees the same global norm and mean loss, so all skip together). The
    # schedule still advances, so the learning rate stays tied to the step count.
    finite = math.isfinite(loss_sum) and math.isfinite(float(grad_norm))
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    stats_sum["skipped_nonfinite"] = 0.0 if finite else 1.0
    # A group whose samples all scored the same has zero advantage: it teaches nothing.
    uniform = sum(1 for g in groups
                  if len({t.reward for t in g.trajectories()}) <= 1)
    stats_sum["uniform_group_fraction"] = uniform / len(groups) if groups else 0.0
    stats_sum["grad_norm"] = float(grad_norm)
    stats_sum["lr"] = scheduler.get_last_lr()[0]
    return StepResult(loss_sum, sum(t.reward for t in trajs_all) / len(trajs_all), total_tokens,
                      stats_sum)
