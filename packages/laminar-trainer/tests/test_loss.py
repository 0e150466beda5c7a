"""Tests for laminar_trainer.loss against values computed by hand."""

import math

import pytest
import torch

from laminar_trainer.loss import (
    aggregate_token_losses,
    aggregation_denominator,
    compute_advantages,
    compute_grpo_advantages,
    compute_kl_penalty,
    compute_policy_loss,
    compute_rloo_advantages,
)

LOG = math.log


def lp(*probs):
    """Log-probabilities as a [1, T] tensor."""
    return torch.tensor([[LOG(p) for p in probs]], dtype=torch.float64)


# --- GRPO advantages --------------------------------------------------------


def test_grpo_advantages_two_by_two_group():
    # mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735 -> 0.5 / 0.57735 = 0.866025
    adv = compute_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]]))


def test_grpo_advantages_one_success_in_four():
    # mean 0.25, unbiased var (0.5625 + 3 * 0.0625) / 3 = 0.25 -> std 0.5
    adv = compute_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]))


def test_grpo_advantages_all_equal_group_is_exactly_zero():
    rewards = torch.tensor([[0.7, 0.7, 0.7], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv = compute_grpo_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(3))
    assert torch.equal(adv[2], torch.zeros(3))
    assert adv[1].abs().sum() > 0


def test_grpo_advantages_with_group_ids_and_unsorted_members():
    rewards = torch.tensor([1.0, 3.0, 0.0, 3.0, 5.0])
    adv = compute_grpo_advantages(rewards, ["a", "b", "a", "b", "c"], eps=0.0)
    # group a: [1, 0], mean 0.5, unbiased std sqrt(0.5); b: equal; c: a single member
    expected = torch.tensor([0.5 / math.sqrt(0.5), 0.0, -0.5 / math.sqrt(0.5), 0.0, 0.0])
    assert torch.allclose(adv, expected)


def test_grpo_advantages_tensor_group_ids_match_row_layout():
    rewards = torch.tensor([[1.0, 0.0, 0.5], [2.0, 2.0, 4.0]])
    by_rows = compute_grpo_advantages(rewards)
    by_ids = compute_grpo_advantages(rewards.reshape(-1), torch.tensor([7, 7, 7, 3, 3, 3]))
    assert torch.allclose(by_rows.reshape(-1), by_ids)


def test_grpo_advantages_without_std_only_centre():
    adv = compute_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), normalise_std=False)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_grpo_advantages_reject_bad_arguments():
    with pytest.raises(ValueError, match="group_ids"):
        compute_grpo_advantages(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="1-D rewards"):
        compute_grpo_advantages(torch.ones(2, 2), [0, 0, 1, 1])
    with pytest.raises(ValueError, match="3 group ids for 2 rewards"):
        compute_grpo_advantages(torch.tensor([1.0, 0.0]), [0, 0, 1])


# --- aggregation ------------------------------------------------------------


def test_aggregations_by_hand():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert aggregate_token_losses(losses, mask, "token-mean").item() == pytest.approx(10 / 4)
    # the empty third row is left out of the sequence means
    assert aggregate_token_losses(losses, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate_token_losses(losses, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)


def test_aggregation_of_empty_mask_is_zero_and_differentiable():
    losses = torch.ones(2, 3, requires_grad=True)
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        out = aggregate_token_losses(losses, torch.zeros(2, 3, dtype=torch.bool), aggregation)
        out.backward()
        assert out.item() == 0.0
        assert torch.equal(losses.grad, torch.zeros(2, 3))
        losses.grad = None


def test_rloo_advantages_by_hand():
    adv = compute_rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    # r_i - mean of the other three: 1 - 1/3, 0 - 2/3
    assert torch.allclose(adv, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4]))
    flat = compute_advantages(torch.tensor([3.0, 1.0, 5.0]), ["a", "a", "b"], "rloo")
    assert torch.allclose(flat, torch.tensor([2.0, -2.0, 0.0]))  # a lone member: 0
    centred = compute_advantages(torch.tensor([3.0, 1.0]), ["a", "a"], "dr_grpo")
    assert torch.allclose(centred, torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(torch.tensor([1.0]), ["a"], "ppo")


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean",
                                         "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_split_batches_sum_to_the_whole_with_the_whole_denominator(aggregation):
    torch.manual_seed(1)
    losses = torch.randn(5, 7, dtype=torch.float64)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    for row, n in enumerate((7, 1, 0, 4, 2)):  # unequal lengths, one empty row
        mask[row, :n] = True
    whole = aggregate_token_losses(losses, mask, aggregation, norm_tokens=8)
    denominator = aggregation_denominator(mask, aggregation, norm_tokens=8)
    parts = sum(aggregate_token_losses(losses[i:j], mask[i:j], aggregation,
                                       denominator=denominator, norm_tokens=8)
                for i, j in ((0, 2), (2, 3), (3, 5)))
    assert float(parts) == pytest.approx(float(whole), abs=1e-12)
    # the parts' own means are not the whole's (the defect this replaces)
    naive = sum(aggregate_token_losses(losses[i:j], mask[i:j], aggregation, norm_tokens=8)
                * (j - i) / 5 for i, j in ((0, 2), (2, 3), (3, 5)))
    assert float(naive) != pytest.approx(float(whole), abs=1e-3)
    if aggregation == "seq-mean-token-sum-norm":
        assert denominator == 4 * 8  # four rows with a token, times the constant
        with pytest.raises(ValueError, match="needs norm_tokens"):
            aggregate_token_losses(losses, mask, aggregation)


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        aggregate_token_losses(torch.ones(1, 1), torch.ones(1, 1), "mean")


# --- policy loss --------------------------------------------------------------


def _two_rows():
    old = torch.cat([lp(0.5, 0.5), lp(0.4, 0.4)])
    new = torch.cat([lp(0.6, 0.5), lp(0.2, 0.4)]).requires_grad_(True)
    # ratios [[1.2, 1.0], [0.5, 1.0]]
    return new, old, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2, dtype=bool)


def test_plain_ppo_clip_by_hand():
    new, old, adv, mask = _two_rows()
    loss, stats = compute_policy_loss(new, old, adv, mask, correction="none")
    # surrogates: 1.2, 1.0, min(-0.5, -0.8) = -0.8 (clipped), -1.0 -> loss -(0.4) / 4
    assert loss.item() == pytest.approx(-0.1)
    assert stats["clip_fraction"] == pytest.approx(0.25)
    assert stats["ratio_mean"] == pytest.approx((1.2 + 1.0 + 0.5 + 1.0) / 4)
    assert stats["is_weight_mean"] == pytest.approx(1.0)
    assert stats["tokens"] == 4.0
    loss.backward()
    # d loss / d logprob = -A * r / N where not clipped, 0 where clipped
    expected = torch.tensor([[-0.3, -0.25], [0.0, 0.25]], dtype=torch.float64)
    assert torch.allclose(new.grad, expected)


def test_clip_higher_is_asymmetric():
    old = lp(0.5, 0.5, 0.5)
    # ratios 1.25 (inside 1 + 0.28), 1.5 (clipped at 1.28), 0.7 (below 1 - 0.2, positive A: kept)
    new = lp(0.625, 0.75, 0.35).requires_grad_(True)
    loss, stats = compute_policy_loss(
        new,
        old,
        torch.tensor([1.0], dtype=torch.float64),
        torch.ones(1, 3, dtype=bool),
        correction="none",
    )
    assert loss.item() == pytest.approx(-(1.25 + 1.28 + 0.7) / 3)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-1.25 / 3, 0.0, -0.7 / 3]], dtype=torch.float64))


def test_decoupled_with_proximal_by_hand():
    behaviour = lp(0.25, 0.1, 0.5)
    proximal = lp(0.5, 0.5, 0.4)
    new = lp(0.6, 0.5, 0.2).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, stats = compute_policy_loss(
        new,
        behaviour,
        adv,
        torch.ones(1, 3, dtype=bool),
        correction="decoupled",
        proximal_logprobs=proximal,
        tis_cap=2.0,
    )
    # weights pi_prox / mu = 2.0, 5.0 -> 2.0 (truncated), 0.8; ratios pi / pi_prox = 1.2, 1.0, 0.5
    # objectives: 2 * 1.2 = 2.4, 2 * -1 = -2, 0.8 * min(-0.5, -0.8) = -0.64
    assert loss.item() == pytest.approx(-(2.4 - 2.0 - 0.64) / 3)
    assert stats["is_weight_mean"] == pytest.approx((2.0 + 2.0 + 0.8) / 3)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    assert stats["is_truncated_fraction"] == pytest.approx(1 / 3)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    expected = torch.tensor([[-2.0 * 1.2 / 3, 2.0 / 3, 0.0]], dtype=torch.float64)
    assert torch.allclose(new.grad, expected)


def test_decoupled_default_proximal_is_current_policy():
    new = lp(0.5, 0.3).requires_grad_(True)
    behaviour = lp(0.25, 0.3)
    loss, stats = compute_policy_loss(
        new,
        behaviour,
        torch.tensor([1.0], dtype=torch.float64),
        torch.ones(1, 2, dtype=bool),
        tis_cap=1.5,
    )
    # ratio 1 everywhere; weights min(2, 1.5) = 1.5 and 1.0
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_fraction"] == 0.0
    assert loss.item() == pytest.approx(-(1.5 + 1.0) / 2)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-0.75, -0.5]], dtype=torch.float64))
    # KL(mu || pi) by k3 on the first token: r = 2 -> (2 - 1) - log 2; second token 0
    assert stats["behaviour_kl"] == pytest.approx((1.0 - LOG(2.0)) / 2)


def test_tis_truncates_the_weight_but_keeps_the_gradient():
    behaviour = lp(0.3, 0.5)
    new = lp(0.9, 0.6).requires_grad_(True)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=bool)
    loss, stats = compute_policy_loss(new, behaviour, adv, mask, correction="tis", tis_cap=2.0)
    # token 0: r = 3, A = -1, unclipped side -3 wins the min; weight truncated to 2 -> -2
    # token 1: r = 1.2, A = 1 -> 1.2 (below the cap, plain PPO)
    assert loss.item() == pytest.approx(-(-2.0 + 1.2) / 2)
    assert stats["is_truncated_fraction"] == pytest.approx(0.5)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[1.0, -0.6]], dtype=torch.float64))
    # without correction the same token would weigh 3
    plain = new.detach().clone().requires_grad_(True)
    plain_loss, _ = compute_policy_loss(plain, behaviour, adv, mask, correction="none")
    plain_loss.backward()
    assert plain_loss.item() == pytest.approx(-(-3.0 + 1.2) / 2)
    assert torch.allclose(plain.grad, torch.tensor([[1.5, -0.6]], dtype=torch.float64))


def test_on_policy_corrections_agree():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(3, 5, 7), -1)[..., 0]
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.rand(3, 5) > 0.3
    losses = [
        compute_policy_loss(logprobs, logprobs.clone(), adv, mask, correction=c)[0]
        for c in ("decoupled", "tis", "none")
    ]
    assert torch.allclose(losses[0], losses[1]) and torch.allclose(losses[1], losses[2])


@pytest.mark.parametrize("correction", ["decoupled", "tis", "none"])
def test_gradient_step_moves_logprobs_with_the_advantage(correction):
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 4))

    def token_logprobs():
        return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    before = token_logprobs().detach()
    behaviour = before + 0.05 * torch.randn(2, 4)
    loss, _ = compute_policy_loss(
        token_logprobs(),
        behaviour,
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 4, dtype=bool),
        correction=correction,
    )
    loss.backward()
    with torch.no_grad():
        logits -= 0.1 * logits.grad
    after = token_logprobs().detach()
    assert after[0].sum() > before[0].sum()
    assert after[1].sum() < before[1].sum()


def test_masked_positions_change_nothing_even_when_not_finite():
    new = torch.cat([lp(0.6, 0.5), lp(0.2, 0.4)]).requires_grad_(True)
    old = torch.cat([lp(0.5, 0.5), lp(0.4, 0.4)])
    old_garbage = old.clone()
    old_garbage[0, 1] = float("inf")
    old_garbage[1, 1] = float("nan")
    mask = torch.tensor([[True, False], [True, False]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    for correction in ("decoupled", "tis", "none"):
        loss, stats = compute_policy_loss(new, old_garbage, adv, mask, correction=correction)
        ref, _ = compute_policy_loss(
            new[:, :1], old[:, :1], adv, mask[:, :1], correction=correction
        )
        assert torch.isfinite(loss) and loss.item() == pytest.approx(ref.item())
        assert all(math.isfinite(v) for v in stats.values())
        (grad,) = torch.autograd.grad(loss, new)
        assert torch.equal(grad[:, 1], torch.zeros(2, dtype=torch.float64))


def test_per_token_advantages_are_accepted():
    new = lp(0.6, 0.5).requires_grad_(True)
    old = lp(0.5, 0.5)
    loss, _ = compute_policy_loss(
        new,
        old,
        torch.tensor([[2.0, -1.0]], dtype=torch.float64),
        torch.ones(1, 2, dtype=bool),
        correction="none",
    )
    assert loss.item() == pytest.approx(-(2.0 * 1.2 - 1.0) / 2)


def test_policy_loss_rejects_bad_arguments():
    new, old, adv, mask = _two_rows()
    with pytest.raises(ValueError, match="unknown correction 'ppo'"):
        compute_policy_loss(new, old, adv, mask, correction="ppo")
    with pytest.raises(ValueError, match="only used by correction='decoupled'"):
        compute_policy_loss(new, old, adv, mask, correction="tis", proximal_logprobs=old)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        compute_policy_loss(new, old[:, :1], adv, mask)
    with pytest.raises(ValueError, match="advantages must be"):
        compute_policy_loss(new, old, torch.ones(3), mask)
    with pytest.raises(ValueError, match="tis_cap"):
        compute_policy_loss(new, old, adv, mask, tis_cap=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        compute_policy_loss(new, old, adv, mask, clip_low=1.5)


# --- KL -----------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logprobs = lp(0.5, 0.9)
    ref = lp(0.25, 0.1)
    mask = torch.tensor([[True, False]])
    d = LOG(0.25) - LOG(0.5)
    assert compute_kl_penalty(logprobs, ref, mask, "k1").item() == pytest.approx(-d)
    assert compute_kl_penalty(logprobs, ref, mask, "k2").item() == pytest.approx(0.5 * d * d)
    assert compute_kl_penalty(logprobs, ref, mask, "k3").item() == pytest.approx(0.5 - d - 1.0)


def test_k3_is_zero_at_the_reference_and_pulls_towards_it():
    ref = lp(0.5, 0.2)
    same = ref.clone().requires_grad_(True)
    assert compute_kl_penalty(same, ref, torch.ones(1, 2, dtype=bool)).item() == 0.0
    above = lp(0.8, 0.2).requires_grad_(True)
    kl = compute_kl_penalty(above, ref, torch.ones(1, 2, dtype=bool))
    kl.backward()
    assert kl.item() > 0 and above.grad[0, 0] > 0  # descending lowers the inflated log-prob


def test_kl_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown KL kind 'k4'"):
        compute_kl_penalty(lp(0.5), lp(0.5), torch.ones(1, 1, dtype=bool), "k4")
