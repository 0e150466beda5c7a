"""``train_step`` against gradients computed by hand: PPO mini-batches and epochs with the
proximal log-probs of the step's start (the clip firing, and its gradient exactly zero),
GSPO, Dr. GRPO, RLOO, the entropy bonus and DAPO's overlong filter / penalty.

The policy is a bigram table (``logits = table[previous token]``): with one-token
completions the log-prob of a completion depends on one row only, so the gradient of
any of these losses has a closed form, ``d loss / d logits_row = sum_t g_t (onehot(y_t)
- softmax(row))`` with ``g_t = d loss / d log pi(y_t)``, written out below per case.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from laminar_common.codec import SamplingSpec, Trajectory
from laminar_trainer.buffer import Group
from laminar_trainer.config import TrainerConfig
from laminar_trainer.step import (
    _shuffled,
    loglinear_proximal,
    make_optimizer,
    overlong_penalty,
    train_step,
    trajectory_metrics,
)

V = 5


class Bigram(torch.nn.Module):
    """logits at position t = table[input_ids[t]] (a causal LM in its simplest form)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=gen, dtype=torch.float32))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids])


def _traj(prompt_tok: int, resp: tuple[int, ...], reward: float, i: int, group: str,
          behaviour: tuple[float, ...], finish: str = "stop", max_tokens: int = 64,
          source: str = "") -> Trajectory:
    return Trajectory(
        trajectory_id=f"{group}#{i}", prompt_id=group, group_size=2, sample_index=i,
        worker_id="w", policy_version=0, prompt_token_ids=(prompt_tok,),
        response_token_ids=resp, behaviour_logprobs=behaviour, reward=reward,
        finish_reason=finish, sampling=SamplingSpec(max_tokens=max_tokens),
        data_source=source)


def _logp(table: torch.Tensor, row: int, tok: int) -> float:
    return float(torch.log_softmax(table[row].double(), -1)[tok])


def _group(name: str, row: int, answers: list[tuple[int, float]], table, shift: float = 0.3,
           **kw) -> Group:
    # Behaviour log-probs a little below the start weights': importance weight e^0.3.
    members = {i: _traj(row, (tok,), r, i, name, (_logp(table, row, tok) - shift,), **kw)
               for i, (tok, r) in enumerate(answers)}
    return Group(name, len(members), members)


def _cfg(**over) -> TrainerConfig:
    loss = {"tis_cap": 2.0, **over.pop("loss", {})}
    optim = {"lr": 1.0, "grad_clip": 1e9, **over.pop("optim", {})}
    return TrainerConfig(simulate={}, batch_groups=over.pop("batch_groups", 2), loss=loss,
                         optim=optim, **over)


def _record_grads(optimizer, table) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weights, gradient) just before every optimizer update."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    optimizer.register_step_pre_hook(
        lambda *_: seen.append((table.detach().clone(), table.grad.detach().clone())))
    return seen


def _expected_ppo_grad(weights, start, groups, cfg, n_tokens: int, proximal=None
                       ) -> torch.Tensor:
    """Decoupled PPO token-mean gradient by hand, for one-token completions; ``proximal``
    (trajectory -> log-prob), or the start weights' log-prob."""
    grad = torch.zeros(V, V, dtype=torch.float64)
    low, high = 1 - cfg.loss.clip_low, 1 + cfg.loss.clip_high
    for g in groups:
        trajs = g.trajectories()
        rewards = [t.reward for t in trajs]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        for t in trajs:
            row, tok = t.prompt_token_ids[0], t.response_token_ids[0]
            adv = (t.reward - mean) / (std + 1e-6)
            prox = proximal(t) if proximal else _logp(start, row, tok)
            ratio = math.exp(_logp(weights, row, tok) - prox)
            weight = min(math.exp(prox - t.behaviour_logprobs[0]), cfg.loss.tis_cap)
            clipped = (adv > 0 and ratio > high) or (adv < 0 and ratio < low)
            g_t = 0.0 if clipped else -weight * ratio * adv / n_tokens
            probs = torch.softmax(weights[row].double(), -1)
            grad[row] += g_t * (torch.nn.functional.one_hot(torch.tensor(tok), V) - probs)
    return grad


@pytest.mark.parametrize(("lr", "clip_fires", "shuffle"),
                         [(1.0, True, False), (0.02, False, False), (0.02, False, True)])
def test_mini_batched_decoupled_ppo_matches_the_hand_gradient_at_every_update(
        lr, clip_fires, shuffle):
    model = Bigram()
    start = model.table.detach().clone()
    groups = [_group("a", 0, [(1, 1.0), (2, 0.0)], start),
              _group("b", 3, [(1, 0.0), (4, 1.0)], start)]
    # shuffled: a seed whose draw puts b first, so the order is the shuffle's
    seed = next(s for s in range(100) if _shuffled(groups, s)[0] is groups[1])
    cfg = _cfg(seed=seed, optim={"lr": lr, "mini_batches": 2, "epochs": 2, "shuffle": shuffle})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    result = train_step(model, opt, sched, groups, cfg)
    assert len(seen) == 4 and result.stats["updates"] == 4.0
    first = [groups[1], groups[0]] if shuffle else groups
    order = first * 2  # the two mini-batches in their order; two epochs
    for k, ((weights, grad), group) in enumerate(zip(seen, order)):
        expected = _expected_ppo_grad(weights, start, [group], cfg, n_tokens=2)
        assert torch.allclose(grad.double(), expected, atol=1e-6), k
    # The first pass over each mini-batch sees ratio 1 at its rows: a real gradient.
    if not shuffle:
        assert seen[0][1][0].abs().sum() > 0 and seen[1][1][3].abs().sum() > 0
    if clip_fires:
        # lr 1 moved rows 0 and 3 far past 1 +- clip: every token of the second epoch
        # is clipped, and its gradient is exactly zero.
        assert torch.count_nonzero(seen[2][1]) == 0 and torch.count_nonzero(seen[3][1]) == 0
        assert result.stats["clip_fraction"] == pytest.approx(0.5)  # 2 updates of 4, all tokens
        assert result.stats["clip_fraction_high"] == pytest.approx(0.25)
        assert result.stats["clip_fraction_low"] == pytest.approx(0.25)
        assert result.stats["proximal_kl"] > 0.1
    else:
        assert result.stats["clip_fraction"] == 0.0
        assert seen[2][1][3 if shuffle else 0].abs().sum() > 0  # the first mini-batch's row
        assert 0 < result.stats["proximal_kl"] < 0.01
    assert result.stats["is_weight_mean"] == pytest.approx(math.exp(0.3), rel=1e-5)
    # k3 of KL(mu || pi_prox) with log(pi_prox / mu) = 0.3 on every token
    assert result.stats["behaviour_kl"] == pytest.approx(math.exp(0.3) - 1 - 0.3, rel=1e-4)


def test_the_step_s_groups_are_shuffled_alike_on_every_rank_and_anew_each_step():
    table = Bigram().table.detach()
    groups = [_group(n, 0, [(1, 1.0), (2, 0.0)], table) for n in "abcdefgh"]
    ids = [g.prompt_id for g in groups]

    def order(gs, seed):
        return [g.prompt_id for g in _shuffled(gs, seed)]
    assert order(groups, 7) == order(list(groups), 7)  # a function of seed and groups only
    assert sorted(order(groups, 7)) == ids and order(groups, 7) != ids
    assert order(groups, 8) != order(groups, 7)
    other_step = [_group(n, 0, [(1, 1.0), (2, 0.0)], table) for n in "abcdefgi"]
    assert order(other_step, 7) != [x.replace("h", "i") for x in order(groups, 7)]


def test_one_update_per_step_keeps_the_ratio_at_one():
    model = Bigram()
    start = model.table.detach().clone()
    groups = [_group("a", 0, [(1, 1.0), (2, 0.0)], start),
              _group("b", 3, [(1, 0.0), (4, 1.0)], start)]
    cfg = _cfg()
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    result = train_step(model, opt, sched, groups, cfg)
    assert len(seen) == 1 and result.stats["clip_fraction"] == 0.0
    assert result.stats["ratio_mean"] == pytest.approx(1.0)
    expected = _expected_ppo_grad(start, start, groups, cfg, n_tokens=4)
    assert torch.allclose(seen[0][1].double(), expected, atol=1e-6)


def test_the_lr_schedule_advances_once_per_trainer_step():
    model = Bigram()
    groups = [_group("a", 0, [(1, 1.0), (2, 0.0)], model.table.detach()),
              _group("b", 3, [(1, 0.0), (4, 1.0)], model.table.detach())]
    cfg = _cfg(optim={"lr": 0.1, "mini_batches": 2, "epochs": 3, "warmup_steps": 4})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    train_step(model, opt, sched, groups, cfg)
    assert sched.last_epoch == 1 and opt.state[model.table]["step"] == 6


def test_gspo_clips_the_sequence_ratio_and_its_gradient_is_the_sequence_one():
    model = Bigram()
    start = model.table.detach().clone()
    # Two-token completions: row 0 then row = the first completion token.
    def traj(i, resp, reward):
        lps = [_logp(start, 0, resp[0]), _logp(start, resp[0], resp[1])]
        return _traj(0, resp, reward, i, "g", tuple(x - d for x, d in zip(lps, (0.2, -0.1))))
    groups = [Group("g", 2, {0: traj(0, (1, 2), 1.0), 1: traj(1, (3, 4), 0.0)})]
    cfg = _cfg(batch_groups=1, loss={"algorithm": "gspo", "correction": "none"},
               optim={"lr": 1e-3})
    assert (cfg.loss.clip_low, cfg.loss.clip_high) == (3e-4, 4e-4)
    assert cfg.loss.aggregation == "seq-mean-token-mean"
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    result = train_step(model, opt, sched, groups, cfg)
    grad = seen[0][1].double()
    # s_i = exp(mean_t log(pi / mu)): sample 0 exp((0.2 - 0.1) / 2) = e^0.05, past 1 + 4e-4
    # with A > 0: clipped, zero gradient. Sample 1: s = e^0.05 with A < 0: the unclipped
    # side is the min, gradient -(1/G) * A * s * (1/|y|) * sum_t dlogpi_t.
    assert result.stats["clip_fraction"] == pytest.approx(0.5)
    s = math.exp(0.05)
    adv = -0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO advantage of the 0-reward member
    expected = torch.zeros(V, V, dtype=torch.float64)
    for row, tok in ((0, 3), (3, 4)):
        probs = torch.softmax(start[row].double(), -1)
        expected[row] += -(1 / 2) * adv * s * 0.5 * (
            torch.nn.functional.one_hot(torch.tensor(tok), V) - probs)
    assert torch.allclose(grad, expected, atol=1e-6)
    assert torch.count_nonzero(grad[1]) == 0  # sample 0's second row: clipped away


def test_dr_grpo_centres_and_divides_token_sums_by_a_constant():
    model = Bigram()
    start = model.table.detach().clone()
    groups = [_group("a", 0, [(1, 1.0), (2, 0.0)], start, shift=0.0, max_tokens=8)]
    cfg = _cfg(batch_groups=1, loss={"algorithm": "dr_grpo"})
    assert cfg.loss.aggregation == "seq-mean-token-sum-norm"
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    train_step(model, opt, sched, groups, cfg)
    # advantages +-0.5 (no std); loss = -sum_t A_t r_t / (2 rows * 8 = max_tokens)
    probs = torch.softmax(start[0].double(), -1)
    one_hot = torch.eye(V, dtype=torch.float64)
    expected = -(0.5 * (one_hot[1] - probs) - 0.5 * (one_hot[2] - probs)) / 16
    assert torch.allclose(seen[0][1][0].double(), expected, atol=1e-7)
    # norm_tokens fixes the constant instead of the sampling budget
    fixed = _cfg(batch_groups=1, loss={"algorithm": "dr_grpo", "norm_tokens": 4})
    model2 = Bigram()
    opt2, sched2 = make_optimizer(model2, fixed.optim, 10)
    seen2 = _record_grads(opt2, model2.table)
    train_step(model2, opt2, sched2, groups, fixed)
    assert torch.allclose(seen2[0][1][0].double(), expected * 2, atol=1e-7)  # 2 rows x 4


def test_rloo_uses_the_leave_one_out_baseline():
    model = Bigram()
    start = model.table.detach().clone()
    members = {i: _traj(0, (tok,), r, i, "a", (_logp(start, 0, tok),))
               for i, (tok, r) in enumerate([(1, 1.0), (2, 0.0), (3, 0.0)])}
    members = {i: Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__},
                                "group_size": 3}) for i, t in members.items()}
    groups = [Group("a", 3, members)]
    cfg = _cfg(batch_groups=1, loss={"algorithm": "rloo"})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    train_step(model, opt, sched, groups, cfg)
    # r - mean(others): 1 - 0 = 1, 0 - 1/2 = -1/2 (twice); token-mean over 3 tokens
    probs = torch.softmax(start[0].double(), -1)
    one_hot = torch.eye(V, dtype=torch.float64)
    expected = -(1.0 * (one_hot[1] - probs) - 0.5 * (one_hot[2] - probs)
                 - 0.5 * (one_hot[3] - probs)) / 3
    assert torch.allclose(seen[0][1][0].double(), expected, atol=1e-7)


def test_the_entropy_bonus_adds_minus_coef_times_the_entropy_gradient():
    model = Bigram()
    start = model.table.detach().clone()
    # Equal rewards: zero advantages, so the gradient is the entropy term's alone.
    groups = [_group("a", 0, [(1, 1.0), (2, 1.0)], start, shift=0.0)]
    cfg = _cfg(batch_groups=1, loss={"entropy_coef": 0.1})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    result = train_step(model, opt, sched, groups, cfg)
    probs = torch.softmax(start[0].double(), -1)
    logp = probs.log()
    entropy = float(-(probs * logp).sum())
    assert result.stats["entropy"] == pytest.approx(entropy, rel=1e-5)
    # dH/dlogits = -p * (log p + H); both tokens read row 0: token-mean of 2 identical
    expected = -0.1 * (-probs * (logp + entropy))
    assert torch.allclose(seen[0][1][0].double(), expected, atol=1e-7)
    # and the step raised the entropy of row 0
    after = torch.softmax(model.table[0].detach().double(), -1)
    assert float(-(after * after.log()).sum()) > entropy


def test_overlong_filter_leaves_cut_completions_out_of_the_loss():
    model = Bigram()
    start = model.table.detach().clone()
    a = _group("a", 0, [(1, 1.0), (2, 0.0)], start, shift=0.0)
    cut = {0: a.members[0], 1: Trajectory(**{**{f: getattr(a.members[1], f)
                                                 for f in a.members[1].__struct_fields__},
                                              "finish_reason": "length"})}
    groups = [Group("a", 2, cut)]
    cfg = _cfg(batch_groups=1, loss={"overlong_filter": True})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    train_step(model, opt, sched, groups, cfg)
    # The cut member still sets the advantages (+-0.7071) but only token 1 is trained,
    # normalised by the one token that counts.
    probs = torch.softmax(start[0].double(), -1)
    adv = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = -adv * (torch.eye(V, dtype=torch.float64)[1] - probs)
    assert torch.allclose(seen[0][1][0].double(), expected, atol=1e-6)


def test_soft_overlong_penalty_by_hand():
    assert overlong_penalty(10, 20, 0, 1.0) == 0.0
    assert overlong_penalty(12, 20, 8, 1.0) == 0.0
    assert overlong_penalty(16, 20, 8, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(20, 20, 8, 2.0) == pytest.approx(-2.0)
    assert overlong_penalty(25, 20, 8, 1.0) == pytest.approx(-1.0)
    # Two correct answers, one deep in the buffer: the penalty makes the group informative.
    model = Bigram()
    start = model.table.detach().clone()
    groups = [Group("a", 2, {
        0: _traj(0, (1,), 1.0, 0, "a", (_logp(start, 0, 1),), max_tokens=4),
        1: _traj(0, (2, 2, 2, 2), 1.0, 1, "a", (-1.0,) * 4, max_tokens=4)})]
    opt, sched = make_optimizer(model, _cfg().optim, 10)
    off = train_step(model, opt, sched, groups, _cfg(batch_groups=1))
    assert off.stats["grad_norm"] == 0.0
    model = Bigram()
    opt, sched = make_optimizer(model, _cfg().optim, 10)
    on = train_step(model, opt, sched, groups, _cfg(batch_groups=1, loss={"overlong_buffer": 2}))
    assert on.stats["grad_norm"] > 0


def test_trajectory_metrics_by_hand():
    start = Bigram().table.detach()
    a = _group("a", 0, [(1, 1.0), (2, 0.0)], start, source="gsm8k")
    b = Group("b", 2, {0: _traj(3, (1, 2, 3), 0.5, 0, "b", (-1.0,) * 3, finish="length"),
                       1: _traj(3, (1,), 0.0, 1, "b", (-1.0,))})
    m = trajectory_metrics([t for g in (a, b) for t in g.trajectories()])
    assert m["response_length_mean"] == pytest.approx(6 / 4)
    assert m["response_length_max"] == 3
    assert m["truncation_rate"] == pytest.approx(0.25)
    assert m["reward_by_source"] == {"gsm8k": 0.5, "none": 0.25}


def test_mini_batches_must_divide_the_step():
    with pytest.raises(ValueError, match=r"optim.mini_batches \(3\) must divide batch_groups"):
        _cfg(batch_groups=4, optim={"mini_batches": 3})


def test_no_forward_is_wasted_on_the_proximal_log_probs():
    model = Bigram()
    start = model.table.detach()
    groups = [_group(n, r, [(1, 1.0), (2, 0.0)], start) for n, r in (("a", 0), ("b", 3),
                                                                       ("c", 4), ("d", 2))]
    calls: list[int] = []
    model.register_forward_hook(lambda _m, args, _out: calls.append(1))
    for mini, epochs, expected in ((1, 1, 1), (4, 1, 3 + 4), (2, 2, 1 + 4)):
        calls.clear()
        cfg = _cfg(batch_groups=4, optim={"lr": 0.01, "mini_batches": mini, "epochs": epochs})
        opt, sched = make_optimizer(model, cfg.optim, 10)
        train_step(model, opt, sched, groups, cfg)
        # one forward per update, plus one without a graph for every mini-batch but the
        # first (the first update's own forward is at the proximal weights)
        assert len(calls) == expected, (mini, epochs, len(calls))


@pytest.mark.parametrize(("staleness", "lr", "shift"),
                         [(1, 0.02, 0.3), (1, 1.0, 0.3), (0, 0.02, 0.3), (3, 0.3, 0.3),
                          (1, 0.02, 1.0), (3, 0.02, 1.0)])
def test_loglinear_proximal_matches_the_hand_gradient_without_a_proximal_forward(
        staleness, lr, shift):
    """AReaL's loglinear proximal: the first update's forward is exact; every other
    mini-batch interpolates, at its first update, between the behaviour log-prob and the
    current one with a = s / (s + u / U), and keeps that for its later epochs. (Below the
    cap and the clip, weight x ratio is pi / mu whatever the proximal: ``shift`` 1.0 puts
    the importance weight over its cap of 2, where the proximal shows.)"""
    model = Bigram()
    start = model.table.detach().clone()
    groups = [_group("a", 0, [(1, 1.0), (2, 0.0)], start, shift=shift),
              _group("b", 3, [(1, 0.0), (4, 1.0)], start, shift=shift)]
    cfg = _cfg(optim={"lr": lr, "mini_batches": 2, "epochs": 2},
               loss={"proximal": "loglinear"})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    calls: list[int] = []
    model.register_forward_hook(lambda _m, args, _out: calls.append(1))
    result = train_step(model, opt, sched, groups, cfg, version=staleness)  # trained at v0
    assert len(seen) == 4 and len(calls) == 4  # one forward per update, none for proximal
    alpha = staleness / (staleness + 1 / 4)  # group b's first update is update 1 of 4

    def b_proximal(t):
        row, tok = t.prompt_token_ids[0], t.response_token_ids[0]
        mu = t.behaviour_logprobs[0]
        return mu + alpha * (_logp(seen[1][0], row, tok) - mu)

    for k, ((weights, grad), group) in enumerate(zip(seen, groups * 2)):
        expected = _expected_ppo_grad(weights, start, [group], cfg, n_tokens=2,
                                      proximal=b_proximal if group is groups[1] else None)
        assert torch.allclose(grad.double(), expected, atol=1e-6), k
    assert all(math.isfinite(v) for v in result.stats.values())


def test_loglinear_proximal_by_hand():
    old = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    current = torch.tensor([[-0.5, -1.0], [-0.5, -1.0], [-0.5, -1.0]], requires_grad=True)
    out = loglinear_proximal(old, current, torch.tensor([0, 1, 3]), 0.5)
    assert not out.requires_grad  # a constant of the loss, like a recomputed one
    assert torch.allclose(out[0], old[0])  # generated at the step's start weights
    assert torch.allclose(out[1], old[1] + (1 / 1.5) * (current[1].detach() - old[1]))
    assert torch.allclose(out[2], old[2] + (3 / 3.5) * (current[2].detach() - old[2]))
    with pytest.raises(ValueError, match="moved must be > 0"):
        loglinear_proximal(old, current, torch.tensor([1, 1, 1]), 0.0)


def test_loglinear_proximal_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="loss.proximal: loglinear approximates decoupled"):
        _cfg(loss={"proximal": "loglinear", "correction": "tis"})
    with pytest.raises(ValueError, match="publish_every is 2, must be 1"):
        _cfg(loss={"proximal": "loglinear"}, publish_every=2)
    model = Bigram()
    groups = [_group("a", 0, [(1, 1.0), (2, 0.0)], model.table.detach()),
              _group("b", 3, [(1, 0.0), (4, 1.0)], model.table.detach())]
    cfg = _cfg(optim={"mini_batches": 2}, loss={"proximal": "loglinear"})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    with pytest.raises(ValueError, match="needs the weights' version"):
        train_step(model, opt, sched, groups, cfg)


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_streamed_step_equals_the_whole_step_and_waits_for_each_mini_batch(epochs):
    """optim.stream: the first mini-batch trains at once and each later one is asked for
    only when its update is due; given the same groups in the same order, the weights
    and numbers are those of the whole step (shuffle off, loglinear proximal)."""
    start = Bigram().table.detach().clone()
    groups = [_group(n, r, [(1, 1.0), (2, 0.0)], start, shift=1.0)
              for n, r in (("a", 0), ("b", 3), ("c", 4), ("d", 2))]
    optim = {"lr": 0.3, "mini_batches": 2, "epochs": epochs, "shuffle": False}
    whole_model, streamed_model = Bigram(), Bigram()
    cfg = _cfg(batch_groups=4, optim=optim, loss={"proximal": "loglinear"})
    opt, sched = make_optimizer(whole_model, cfg.optim, 10)
    whole = train_step(whole_model, opt, sched, groups, cfg, version=1)

    cfg = _cfg(batch_groups=4, optim={**optim, "stream": True},
               loss={"proximal": "loglinear"})
    opt, sched = make_optimizer(streamed_model, cfg.optim, 10)
    updates_before: list[int] = []
    opt.register_step_post_hook(lambda *_: updates_before.append(0))

    def more(n):
        asked.append((n, len(updates_before)))
        return groups[2:2 + n]
    asked: list[tuple[int, int]] = []
    streamed = train_step(streamed_model, opt, sched, groups[:2], cfg, version=1, more=more)
    # asked once, for the second mini-batch's 2 groups, after the first update only
    assert asked == [(2, 1)]
    assert torch.allclose(streamed_model.table, whole_model.table, atol=1e-6)
    assert streamed.loss == pytest.approx(whole.loss, abs=1e-6)
    assert streamed.tokens == whole.tokens == 8
    assert streamed.reward_mean == whole.reward_mean
    assert streamed.stats["updates"] == 2 * epochs
    for key in ("grad_norm", "clip_fraction", "is_weight_mean", "uniform_group_fraction"):
        assert streamed.stats[key] == pytest.approx(whole.stats[key], abs=1e-6), key


def test_a_streamed_step_ends_early_when_no_more_groups_come():
    """A trainer stopping mid-step: ``more`` answers []; the step keeps the updates it
    made and reports the groups it took."""
    model = Bigram()
    start = model.table.detach().clone()
    groups = [_group(n, r, [(1, 1.0), (2, 0.0)], start) for n, r in (("a", 0), ("b", 3))]
    cfg = _cfg(batch_groups=4, optim={"lr": 0.3, "mini_batches": 2, "shuffle": False,
                                      "stream": True}, loss={"proximal": "loglinear"})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    result = train_step(model, opt, sched, groups, cfg, version=0, more=lambda n: [])
    assert result.stats["updates"] == 1
    assert result.tokens == 4
    assert not torch.equal(model.table, start)  # the first update stands


def test_streaming_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="set optim.shuffle false"):
        _cfg(batch_groups=4, optim={"mini_batches": 2, "stream": True},
             loss={"proximal": "loglinear"})
    with pytest.raises(ValueError, match="set loss.proximal loglinear"):
        _cfg(batch_groups=4, optim={"mini_batches": 2, "stream": True, "shuffle": False})
    # no proximal to compute: one update a step, or no decoupled PPO
    _cfg(optim={"stream": True, "shuffle": False})
    _cfg(batch_groups=4, optim={"mini_batches": 2, "stream": True, "shuffle": False},
         loss={"correction": "tis"})
    model = Bigram()
    groups = [_group("a", 0, [(1, 1.0), (2, 0.0)], model.table.detach())]
    cfg = _cfg(batch_groups=2, optim={"mini_batches": 2, "shuffle": False})
    opt, sched = make_optimizer(model, cfg.optim, 10)
    with pytest.raises(ValueError, match="a streamed step runs in one process"):
        train_step(model, opt, sched, groups, cfg, version=0, more=lambda n: [])


def test_tool_tokens_are_context_never_trained():
    """A two-turn trajectory: the model's token, two environment tokens (a tool result),
    the model's token again. The environment tokens' rows get exactly no gradient; the
    generated ones get the hand gradient with their behaviour log-probs in place and
    the token-mean over generated tokens only (2 + 1)."""
    model = Bigram()
    start = model.table.detach().clone()
    turns = _traj(0, (1, 3, 4, 2), 1.0, 0, "a", (_logp(start, 0, 1), _logp(start, 4, 2)))
    turns = Trajectory(**{**{f: getattr(turns, f) for f in turns.__struct_fields__},
                          "observation_spans": ((1, 3),)})
    single = _traj(0, (2,), 0.0, 1, "a", (_logp(start, 0, 2),))
    assert turns.generated_tokens == 2
    cfg = _cfg(batch_groups=1)
    opt, sched = make_optimizer(model, cfg.optim, 10)
    seen = _record_grads(opt, model.table)
    train_step(model, opt, sched, [Group("a", 2, {0: turns, 1: single})], cfg)
    grad = seen[0][1].double()
    adv = 0.5 / (math.sqrt(0.5) + 1e-6)
    eye = torch.eye(V, dtype=torch.float64)

    def term(row: int, tok: int, a: float) -> torch.Tensor:
        return -a / 3 * (eye[tok] - torch.softmax(start[row].double(), -1))

    assert torch.allclose(grad[0], term(0, 1, adv) + term(0, 2, -adv), atol=1e-6)
    assert torch.allclose(grad[4], term(4, 2, adv), atol=1e-6)
    # Rows 1 and 3 would predict the tool tokens 3 and 4: nothing trains them.
    assert torch.count_nonzero(grad[1]) == 0 and torch.count_nonzero(grad[3]) == 0
    assert trajectory_metrics([turns, single])["response_length_max"] == 2
