"""One trainer step on a list of complete groups: PPO mini-batches, exact aggregation.

The math lives in ``loss``; this module turns a step's groups into optimizer
updates. Per step:

1. Rewards are shaped (DAPO soft overlong punishment, ``loss.overlong_buffer``)
   and turned into advantages per group by the algorithm's estimator (GRPO,
   Dr. GRPO, GSPO's GRPO advantages, RLOO), scaled by each group's buffer
   weight. Completions cut at ``max_tokens`` are left out of the loss with
   ``loss.overlong_filter`` (they still count in their group's advantages).
2. The groups are split into ``optim.mini_batches`` equal mini-batches (in
   order); with several ranks each mini-batch is split again over the ranks
   (``mini_batch[rank::world]``), and each rank's part into micro-batches of
   ``optim.micro_batch_groups`` groups (gradient accumulation).
3. With more than one optimizer update per step (``mini_batches x epochs``)
   and the ``decoupled`` correction, the proximal log-probs (the weights
   before the step's first update) are computed once, without a graph, for
   every trajectory of the step, so the trust region of every later update is
   anchored there and the clip (Clip-Higher included) acts from the second
   update on. The first mini-batch's first update runs at those weights, so
   its own forward provides them (kept for its later epochs): the extra
   forward covers the other mini-batches only. With one update the proximal
   policy *is* the current one, so no extra forward is spent. The reference model's log-probs (KL penalty)
   are computed once per step too.
4. Each update: forward/backward per micro-batch, each micro-batch's loss
   divided by the *whole mini-batch's* count (tokens, rows, or rows x
   ``norm_tokens``; computed from the step's trajectories, which every rank
   holds), so any split over micro-batches and ranks gives the gradient of the
   unsplit mini-batch; then global-norm clipping and one optimizer step. A
   non-finite loss or gradient norm skips that update.
5. The LR schedule advances once per trainer step (not per update), so it
   stays tied to the step count and to the published versions.

Ranks: every rank is called with the step's *whole* list of groups (they all
decode rank 0's STEP payload) and takes its own share here. FSDP averages
gradients over the ranks during backward, so each rank's loss is multiplied
by the world size: the average of ``world x (local sum / global count)`` is
the global loss's gradient. Stats are reduced exactly: token-weighted means
are summed with their token counts over micro-batches, updates and ranks;
maxima take the maximum.

Precision (``cfg.dtype``): the forwards and backward run under
``laminar_trainer.precision.autocast`` (bfloat16 mixed precision, or nothing
for float32); the parameters, their gradients and the optimizer state stay
float32, and log-probs are computed in float32 from the logits, so the loss,
the gradient norm and the non-finite guard are float32 in both modes.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from laminar_common.codec import Trajectory

from .buffer import Group
from .logprobs import (
    compute_token_logprobs,
    compute_token_logprobs_and_entropy,
    model_device,
    pack_sequences,
)
from .loss import (
    aggregate_token_losses,
    aggregation_denominator,
    compute_advantages,
    compute_kl_penalty,
    compute_policy_loss,
)
from .precision import autocast

__all__ = ["StepResult", "make_optimizer", "overlong_penalty", "train_step",
           "trajectory_metrics"]

_ESTIMATOR = {"grpo": "grpo", "gspo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo"}
_MAX_STATS = ("ratio_max", "is_weight_max")
_NO_SOURCE = "none"


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


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (a value <= 0 added to the reward): 0 up to
    ``max_tokens - buffer`` tokens, then linear down to ``-penalty`` at ``max_tokens``
    (and beyond); 0 when ``buffer`` is 0."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)


def trajectory_metrics(trajs: list[Trajectory]) -> dict:
    """What a step's trajectories look like: response length (generated tokens) mean/max,
    the fraction cut at ``max_tokens`` (``truncation_rate``) and the mean reward per
    ``data_source`` (``reward_by_source``; trajectories without one under ``"none"``), and
    how many there were and how many of their rewards failed (``reward_errors``)."""
    lengths = [t.generated_tokens for t in trajs]
    by_source: dict[str, list[float]] = {}
    for t in trajs:
        by_source.setdefault(getattr(t, "data_source", "") or _NO_SOURCE, []).append(t.reward)
    return {
        "response_length_mean": statistics.fmean(lengths) if lengths else 0.0,
        "response_length_max": max(lengths, default=0),
        "truncation_rate": (sum(t.finish_reason == "length" for t in trajs) / len(trajs)
                            if trajs else 0.0),
        "reward_by_source": {k: statistics.fmean(v) for k, v in sorted(by_source.items())},
        "trajectories": len(trajs),
        "reward_errors": sum(t.reward_error is not None for t in trajs),
    }


@dataclass
class _Micro:
    """One micro-batch, packed once and reused by every epoch."""

    trajs: list[Trajectory]
    input_ids: torch.Tensor
    attention: torch.Tensor
    mask: torch.Tensor
    """Completion tokens that count in the loss (overlong-filtered rows: none)."""
    old: torch.Tensor
    advantages: torch.Tensor
    temperatures: torch.Tensor
    proximal: torch.Tensor | None = None
    reference: torch.Tensor | None = None


STALENESS_BUCKETS = 4
"""Staleness buckets of the per-bucket stats: 0, 1, 2 and 3 or more (``stale3p``)."""


def bucket_name(bucket: int) -> str:
    return f"stale{bucket}p" if bucket == STALENESS_BUCKETS - 1 else f"stale{bucket}"


class _Stats:
    """Token-weighted sums and maxima of loss stats, exact over any split."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add_buckets(self, sums: dict[int, tuple[float, float, float, float]],
                    staleness_tokens: float) -> None:
        """Per staleness bucket: tokens, clipped tokens, ratio and importance-weight sums
        (raw sums, kept apart from the token-weighted means); ``staleness_tokens``: the
        sum over tokens of their row's staleness."""
        for bucket in range(STALENESS_BUCKETS):  # every key on every rank (all_reduce)
            name = bucket_name(bucket)
            values = sums.get(bucket, (0.0, 0.0, 0.0, 0.0))
            for part, value in zip(("tokens", "clipped", "ratio", "weight"), values):
                key = f"{name}/{part}"
                self.sums[key] = self.sums.get(key, 0.0) + value
        key = "staleness/token_sum"
        self.sums[key] = self.sums.get(key, 0.0) + staleness_tokens

    def add(self, stats: dict[str, float], tokens: float) -> None:
        for key, value in stats.items():
            if key == "tokens" or "/" in key:
                continue
            if key in _MAX_STATS:
                self.maxes[key] = max(self.maxes.get(key, -math.inf), float(value))
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * tokens
        self.sums["tokens"] = self.sums.get("tokens", 0.0) + tokens

    def reduce(self, dist) -> dict[str, float]:
        sum_keys, max_keys = sorted(self.sums), sorted(self.maxes)
        sums = [self.sums[k] for k in sum_keys]
        maxes = [self.maxes[k] for k in max_keys]
        if dist is not None:
            sums = dist.all_reduce(sums, "sum")
            maxes = dist.all_reduce(maxes, "max")
        totals = dict(zip(sum_keys, sums))
        tokens = totals.pop("tokens", 0.0)
        raw = {k: totals.pop(k) for k in [k for k in totals if "/" in k]}
        out = {k: v / tokens if tokens else 0.0 for k, v in totals.items()}
        # Per staleness bucket: its share of the tokens, the fraction of its tokens whose
        # ratio was clipped away, its mean ratio and mean importance weight.
        counted = sum(v for k, v in raw.items() if k.endswith("/tokens"))
        if counted:
            out["staleness_token_mean"] = raw.get("staleness/token_sum", 0.0) / counted
        for bucket in range(STALENESS_BUCKETS):
            name = bucket_name(bucket)
            n = raw.get(f"{name}/tokens", 0.0)
            if n:
                out[f"{name}_token_frac"] = n / counted
                out[f"{name}_clip_frac"] = raw[f"{name}/clipped"] / n
                out[f"{name}_ratio_mean"] = raw[f"{name}/ratio"] / n
                out[f"{name}_is_weight_mean"] = raw[f"{name}/weight"] / n
        out.update({k: v if math.isfinite(v) else 0.0 for k, v in zip(max_keys, maxes)})
        return out


def _chunks(groups: list[Group], n: int) -> list[list[Group]]:
    size = len(groups) // n
    if size * n != len(groups) or size == 0:
        raise ValueError(f"{len(groups)} groups do not split into {n} equal mini-batches")
    return [groups[i * size:(i + 1) * size] for i in range(n)]


def _shuffled(groups: list[Group], seed: int) -> list[Group]:
    """``groups`` in an order drawn from ``seed`` and their prompt ids: the same on every
    rank (each gets the same list), another for every step's groups."""
    if len(groups) < 2:
        return list(groups)
    rng = random.Random(f"{seed}:" + "|".join(g.prompt_id for g in groups))
    return rng.sample(groups, len(groups))


def _micro_batches(groups: list[Group], size: int) -> list[list[Group]]:
    if size <= 0:
        return [groups]
    return [groups[i:i + size] for i in range(0, len(groups), size)]


def _length(traj: Trajectory) -> int:
    return len(traj.prompt_token_ids) + len(traj.response_token_ids)


def _by_tokens(chunk: list[Group], rank: int, world: int, budget: int) -> list[list[Trajectory]]:
    """This rank's trajectories of ``chunk`` in micro-batches of about ``budget`` padded
    token positions, sorted by length (each padded to its last row), and as many
    micro-batches on every rank (FSDP's collectives run once per forward/backward).

    Split by trajectory, not by group: the samples of one prompt differ in length (one
    sample that runs to the token limit would pad its seven short siblings to it), and the
    loss sums per-token terms over the mini-batch, so any split gives the same gradient."""
    ordered = sorted((t for g in chunk for t in g.trajectories()), key=_length)
    # Dealt in length order, so every rank gets a similar mix of lengths.
    ranks = [ordered[r::world] for r in range(world)]

    def greedy(trajs: list[Trajectory]) -> list[list[Trajectory]]:
        """Cut where one more row would pass the budget (sorted: a micro-batch is padded
        to its last row)."""
        out: list[list[Trajectory]] = [[]]
        for t in trajs:
            if out[-1] and (len(out[-1]) + 1) * _length(t) > budget:
                out.append([])
            out[-1].append(t)
        return out

    plans = [greedy(r) for r in ranks]
    parts = max(1, min(max(len(p) for p in plans), min(len(r) for r in ranks)))
    mine = plans[rank]
    # Ranks with fewer micro-batches split their largest (padded size) in two until all
    # run as many; ranks with more merge their smallest neighbours (rare: only when a
    # rank holds fewer rows than the others' count of micro-batches).
    while len(mine) < parts:
        i = max((k for k in range(len(mine)) if len(mine[k]) > 1),
                key=lambda k: len(mine[k]) * _length(mine[k][-1]))
        half = len(mine[i]) // 2
        mine[i:i + 1] = [mine[i][:half], mine[i][half:]]
    while len(mine) > parts:
        i = min(range(len(mine) - 1), key=lambda k: len(mine[k]) + len(mine[k + 1]))
        mine[i:i + 2] = [mine[i] + mine[i + 1]]
    return mine


def _advantages(groups: list[Group], cfg) -> dict[str, float]:
    """Advantage of every trajectory of the step, by id (shaped rewards, group weights)."""
    trajs = [t for g in groups for t in g.trajectories()]
    loss = cfg.loss
    rewards = torch.tensor([
        t.reward + overlong_penalty(t.generated_tokens, t.sampling.max_tokens,
                                    loss.overlong_buffer, loss.overlong_penalty)
        for t in trajs], dtype=torch.float32)
    adv = compute_advantages(rewards, [t.prompt_id for t in trajs], _ESTIMATOR[loss.algorithm])
    weights = [g.weight for g in groups for _ in g.trajectories()]
    return {t.trajectory_id: float(a) * w for t, a, w in zip(trajs, adv, weights)}


def _in_loss(traj: Trajectory, cfg) -> bool:
    return not (cfg.loss.overlong_filter and traj.finish_reason == "length")


def _pack(trajs: list[Trajectory], advantages: dict[str, float], cfg, device) -> _Micro:
    input_ids, attn, comp_mask = pack_sequences([list(t.prompt_token_ids) for t in trajs],
                                                [list(t.response_token_ids) for t in trajs])
    old = torch.zeros(comp_mask.shape, dtype=torch.float32)
    for row, t in enumerate(trajs):
        cols = comp_mask[row].nonzero().squeeze(-1)
        if t.observation_spans:
            # Environment tokens are context, never trained: out of the mask, and the
            # behaviour log-probs (one per generated token) go to the generated positions.
            observed = torch.zeros(len(cols), dtype=torch.bool)
            for start, end in t.observation_spans:
                observed[start:end] = True
            comp_mask[row, cols[observed]] = False
            cols = cols[~observed]
        old[row, cols] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
        if not _in_loss(t, cfg):
            comp_mask[row] = False
    adv = torch.tensor([advantages[t.trajectory_id] for t in trajs], dtype=torch.float32)
    # Each trajectory's own sampling temperature (validation refused any that differ
    # from a temperature fixed in the trainer's config).
    temps = torch.tensor([t.sampling.temperature for t in trajs], dtype=torch.float32)
    return _Micro(trajs, input_ids.to(device), attn.to(device), comp_mask.to(device),
                  old.to(device), adv.to(device), temps)


def _denominator(chunk: list[Group], cfg) -> tuple[float, float | None]:
    """The whole mini-batch's aggregation count (every rank computes the same one), and
    the -norm constant."""
    trajs = [t for g in chunk for t in g.trajectories()]
    lengths = torch.tensor([t.generated_tokens if _in_loss(t, cfg) else 0 for t in trajs])
    width = int(lengths.max()) if len(lengths) else 0
    mask = torch.arange(max(width, 1))[None, :] < lengths[:, None]
    norm = None
    if cfg.loss.aggregation == "seq-mean-token-sum-norm":
        norm = float(cfg.loss.norm_tokens or max(t.sampling.max_tokens for t in trajs))
    return aggregation_denominator(mask, cfg.loss.aggregation, norm), norm


def _no_grad_logprobs(model, micro: _Micro, cfg, device) -> torch.Tensor:
    with torch.no_grad(), autocast(device, cfg.dtype):
        return compute_token_logprobs(model, micro.input_ids, micro.attention, micro.temperatures)


def train_step(model, optimizer, scheduler, groups: list[Group], cfg, ref_model=None,
               dist=None, version: int | None = None,
               more: Callable[[int], list[Group]] | None = None) -> StepResult:
    """The step's optimizer updates over ``groups`` (see the module docstring).

    With ``dist`` (a ``laminar_trainer.distributed.DistContext`` of an FSDP model),
    ``groups`` is the whole step (every rank gets the same list) and each rank trains
    on its share; every rank returns the same numbers. ``version``: the weights' version
    at the step's start, which ``loss.proximal: loglinear`` measures staleness against.

    ``more`` streams the step (``optim.stream``; one process, no ``dist``): ``groups`` is
    its first mini-batch, trained at once, and ``more(n)`` is called when a later
    mini-batch's update is due, blocking until ``n`` more groups are ready; ``[]`` ends
    the step there, its updates so far kept. Mini-batches are then in arrival order
    (no shuffle) and advantages are computed within each mini-batch.

    Returns:
        ``StepResult``: ``loss`` is the mean of the updates' losses; ``stats`` holds the
        token-weighted means of the loss stats over every update (clip fractions,
        ratios, importance weights, KLs, ``entropy``), ``grad_norm`` (before clipping,
        mean over updates) and ``grad_norm_max``, ``updates``, ``skipped_nonfinite``
        (updates skipped), ``uniform_group_fraction`` and ``lr``; over every group the
        step took, streamed ones included.
    """
    device = model_device(model)
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    loss_cfg = cfg.loss
    mini_batches = cfg.optim.mini_batches
    updates = mini_batches * cfg.optim.epochs
    keep_proximal = updates > 1 and loss_cfg.correction == "decoupled"
    loglinear = keep_proximal and loss_cfg.proximal == "loglinear"
    if loglinear and version is None:
        raise ValueError("loss.proximal: loglinear needs the weights' version (version=)")
    if more is not None and (dist is not None or (keep_proximal and not loglinear)):
        raise ValueError("a streamed step runs in one process, with no proximal forward at "
                         "the step's start (loss.proximal loglinear, or no decoupled PPO)")
    use_kl = ref_model is not None and loss_cfg.kl_coef > 0

    def plan_of(chunk: list[Group], advantages: dict[str, float]):
        denominator, norm = _denominator(chunk, cfg)
        parts = _by_tokens(chunk, rank, world, cfg.optim.micro_batch_tokens) \
            if cfg.optim.micro_batch_tokens > 0 else \
            [[t for g in part for t in g.trajectories()]
             for part in _micro_batches(chunk[rank::world], cfg.optim.micro_batch_groups)]
        micros = [_pack(part, advantages, cfg, device) for part in parts]
        if use_kl:
            for micro in micros:
                micro.reference = _no_grad_logprobs(ref_model, micro, cfg, device)
        return micros, denominator, norm

    if more is None:
        advantages = _advantages(groups, cfg)
        shuffle = cfg.optim.shuffle and mini_batches > 1
        chunks = _chunks(_shuffled(groups, cfg.seed) if shuffle else groups, mini_batches)
        plan = [plan_of(chunk, advantages) for chunk in chunks]
        if keep_proximal and not loglinear:
            # The first mini-batch's first update runs at the proximal weights: its own
            # forward gives them (kept for its later epochs), so only the others need one.
            for micros, _, _ in plan[1:]:
                for micro in micros:
                    micro.proximal = _no_grad_logprobs(model, micro, cfg, device)
    else:
        chunks = [list(groups)]
        plan = [plan_of(chunks[0], _advantages(chunks[0], cfg))]
    stats = _Stats()
    losses: list[float] = []
    norms: list[float] = []
    skipped = 0
    ended = False
    for _epoch in range(cfg.optim.epochs):
        for index in range(mini_batches):
            if index == len(plan):  # streamed: this mini-batch's groups, once ready
                chunk = more(len(chunks[0]))
                if not chunk:
                    ended = True
                    break
                chunks.append(chunk)
                plan.append(plan_of(chunk, _advantages(chunk, cfg)))
            micros, denominator, norm = plan[index]
            # loglinear: the weights have moved len(losses) of the step's updates so far.
            at = (version, len(losses) / updates) if loglinear and losses else None
            update_loss, grad_norm, applied = _update(
                model, optimizer, micros, denominator, norm, world, cfg, device, stats,
                keep_proximal, at, version, dist)
            skipped += not applied
            losses.append(update_loss)
            norms.append(grad_norm)
        if ended:
            break
    scheduler.step()
    return _step_result([g for chunk in chunks for g in chunk], stats.reduce(dist), losses,
                        norms, skipped, scheduler.get_last_lr()[0])


def _update(model, optimizer, micros, denominator, norm, world, cfg, device, stats: _Stats,
            keep_proximal: bool, at, version, dist) -> tuple[float, float, bool]:
    """One optimizer update over a mini-batch's micro-batches: ``(loss, grad norm before
    clipping, applied)``. A non-finite loss or gradient never reaches the weights: the
    update is skipped (every rank sees the same global norm and loss, so all skip alike)."""
    optimizer.zero_grad(set_to_none=True)
    update_loss = 0.0
    for micro in micros:
        update_loss += _micro_step(model, micro, denominator, norm, world, cfg, device,
                                   stats, keep_proximal, at, version)
    if dist is not None:
        update_loss = dist.all_reduce([update_loss], "sum")[0]
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor: the norm over every shard
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm)
    if math.isfinite(update_loss) and math.isfinite(grad_norm):
        optimizer.step()
        return update_loss, grad_norm, True
    optimizer.zero_grad(set_to_none=True)
    return update_loss, grad_norm, False


def _step_result(taken: list[Group], out: dict, losses: list[float], norms: list[float],
                 skipped: int, lr: float) -> StepResult:
    """The step's figures over every group it took (``out``: the reduced loss stats)."""
    trajs_all = [t for g in taken for t in g.trajectories()]
    out["skipped_nonfinite"] = float(skipped)
    out["updates"] = float(len(losses))
    out["grad_norm"] = statistics.fmean(norms)
    out["grad_norm_max"] = max(norms)
    # A group whose samples all scored the same has zero advantage: it teaches nothing.
    uniform = sum(1 for g in taken if not g.informative)
    out["uniform_group_fraction"] = uniform / len(taken) if taken else 0.0
    out["lr"] = lr
    return StepResult(statistics.fmean(losses), sum(t.reward for t in trajs_all) / len(trajs_all),
                      sum(len(t.response_token_ids) for t in trajs_all), out)


def loglinear_proximal(old: torch.Tensor, current: torch.Tensor, staleness: torch.Tensor,
                       moved: float) -> torch.Tensor:
    """Decoupled PPO's proximal log-probs without a forward (AReaL's ``loglinear``):
    ``old + a (current - old)`` per row, ``a = s / (s + moved)``, where ``s`` (``[B]``)
    is how many versions (steps) before the step's start each row was generated and
    ``moved`` how far into the step (in steps, > 0) the ``current`` weights are. A row
    generated at the step's start weights (``s = 0``) gets its behaviour log-probs.
    """
    if moved <= 0:
        raise ValueError(f"moved must be > 0 (the first update has exact proximal "
                         f"log-probs), got {moved}")
    s = staleness.to(current.dtype).clamp(min=0)[:, None]
    alpha = s / (s + moved)
    return (old + alpha * (current.detach() - old)).detach()


def _micro_step(model, micro: _Micro, denominator: float, norm: float | None, world: int, cfg,
                device, stats: _Stats, keep_proximal: bool,
                loglinear_at: tuple[int, float] | None = None,
                version: int | None = None) -> float:
    """Forward and backward of one micro-batch; returns its share of the update's loss.
    ``keep_proximal``: a micro-batch without proximal log-probs is at the proximal
    weights now, and keeps this forward's for its later updates; with ``loglinear_at``
    (the step's start version, how far the weights have moved in steps), it is not,
    and keeps their interpolation (``loglinear_proximal``) instead."""
    loss_cfg = cfg.loss
    with autocast(device, cfg.dtype):
        logprobs, entropy = compute_token_logprobs_and_entropy(
            model, micro.input_ids, micro.attention, micro.temperatures,
            entropy_grad=loss_cfg.entropy_coef > 0)
    if keep_proximal and micro.proximal is None:
        if loglinear_at is None:
            micro.proximal = logprobs.detach()
        else:
            version, moved = loglinear_at
            staleness = torch.tensor([version - t.policy_version for t in micro.trajs],
                                     device=logprobs.device)
            micro.proximal = loglinear_proximal(micro.old, logprobs, staleness, moved)
    adv = micro.advantages[:, None].expand_as(logprobs)
    # Every rank adds the same stats keys (all_reduce): without a version, staleness 0.
    staleness = torch.tensor([0 if version is None else max(0, version - t.policy_version)
                              for t in micro.trajs], device=logprobs.device)
    loss, step_stats = compute_policy_loss(
        logprobs, micro.old, adv, micro.mask, clip_low=loss_cfg.clip_low,
        clip_high=loss_cfg.clip_high, correction=loss_cfg.correction, tis_cap=loss_cfg.tis_cap,
        proximal_logprobs=micro.proximal, aggregation=loss_cfg.aggregation,
        ratio_level="sequence" if loss_cfg.algorithm == "gspo" else "token",
        denominator=denominator, norm_tokens=norm,
        row_buckets=staleness.clamp(max=STALENESS_BUCKETS - 1))
    mask = micro.mask
    tokens = float(mask.sum())
    stats.add_buckets(step_stats.pop("bucket_sums"),
                      float((mask.sum(-1) * staleness.to(mask.device)).sum()))
    with torch.no_grad():
        step_stats["entropy"] = float(entropy[mask].sum()) / tokens if tokens else 0.0
    if micro.reference is not None:
        kl = compute_kl_penalty(logprobs, micro.reference, mask, aggregation=loss_cfg.aggregation,
                                denominator=denominator, norm_tokens=norm)
        loss = loss + loss_cfg.kl_coef * kl
        with torch.no_grad():
            step_stats["kl"] = float(compute_kl_penalty(logprobs.detach(), micro.reference, mask))
    if loss_cfg.entropy_coef > 0:
        bonus = aggregate_token_losses(entropy, mask, loss_cfg.aggregation,
                                       denominator=denominator, norm_tokens=norm)
        loss = loss - loss_cfg.entropy_coef * bonus
    # FSDP averages gradients over the ranks: world x (local share) averages to the sum.
    (loss * world).backward()
    stats.add(step_stats, tokens)
    return float(loss.detach())
