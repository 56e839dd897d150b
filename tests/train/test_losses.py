"""Every function of astrai.train.losses against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.train import losses as L

LN2 = math.log(2.0)


def _logits_for_probs(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly the given probability rows (log of the probabilities)."""
    return torch.log(torch.tensor(rows, dtype=torch.float64)).float()


# ------------------------------------------------------------------------------------------
# masked reductions


def test_masked_sum_and_mean_ignore_masked_nan():
    x = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
    m = torch.tensor([[1, 1], [1, 0]])
    assert L.masked_sum(x, m).item() == 6.0
    assert L.masked_mean(x, m).item() == 2.0
    assert torch.equal(L.masked_mean(x, m, dim=-1), torch.tensor([1.5, 3.0]))
    assert torch.equal(L.masked_sum(x, m, dim=0), torch.tensor([4.0, 2.0]))
    # an all-masked row has mean 0, not NaN
    assert L.masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_masked_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1, 1, 1, 0])
    # mean 2, unbiased variance (1 + 0 + 1) / 2 = 1
    w = L.masked_whiten(x, m)
    torch.testing.assert_close(w[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6, rtol=0)
    w = L.masked_whiten(x, m, shift_mean=False)
    torch.testing.assert_close(w[:3], torch.tensor([1.0, 2.0, 3.0]), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------
# cross entropy and sequence log-probs


def test_token_cross_entropy_sum_and_count():
    # probabilities [1/4, 1/2, 1/4] at both loss positions; the third position is ignored and
    # carries extreme logits that would dominate if it were counted
    logits = _logits_for_probs([0.25, 0.5, 0.25], [0.25, 0.5, 0.25]).view(1, 2, 3)
    logits = torch.cat([logits, torch.tensor([[[1e4, -1e4, 0.0]]])], dim=1)  # (1, 3, 3)
    labels = torch.tensor([[1, 0, -100]])
    loss_sum, n = L.token_cross_entropy(logits, labels)
    assert n.item() == 2
    # -ln(1/2) - ln(1/4) = 3 ln 2
    assert loss_sum.item() == pytest.approx(3 * LN2, abs=1e-6)


def test_token_cross_entropy_label_smoothing():
    logits = _logits_for_probs([0.25, 0.5, 0.25]).view(1, 1, 3)
    labels = torch.tensor([[1]])
    loss_sum, n = L.token_cross_entropy(logits, labels, label_smoothing=0.1)
    # 0.9 * ln 2 + 0.1 * mean(ln 4, ln 2, ln 4) = 0.9 ln2 + 0.1 * 5 ln2 / 3
    assert loss_sum.item() == pytest.approx(0.9 * LN2 + 0.1 * 5 * LN2 / 3, abs=1e-6)
    assert n.item() == 1
    with pytest.raises(ValueError, match="label_smoothing"):
        L.token_cross_entropy(logits, labels, label_smoothing=1.0)


def test_token_cross_entropy_is_float32_for_bf16_logits():
    logits = torch.randn(2, 3, 5).to(torch.bfloat16)
    loss_sum, _ = L.token_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long))
    assert loss_sum.dtype == torch.float32


def test_sequence_logps_sum_and_average():
    logits = _logits_for_probs([0.25, 0.5, 0.25], [0.25, 0.5, 0.25], [0.1, 0.1, 0.8]).view(1, 3, 3)
    labels = torch.tensor([[1, 0, -100]])
    # ln(1/2) + ln(1/4) = -3 ln 2, over 2 loss tokens
    assert L.sequence_logps(logits, labels).item() == pytest.approx(-3 * LN2, abs=1e-6)
    assert L.sequence_logps(logits, labels, average=True).item() == pytest.approx(-1.5 * LN2, abs=1e-6)
    batch = L.sequence_logps(logits.expand(2, 3, 3), torch.tensor([[1, 0, -100], [-100, -100, 2]]))
    torch.testing.assert_close(batch, torch.tensor([-3 * LN2, math.log(0.8)]), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------
# DPO


def _pair(beta: float, loss_type: str, label_smoothing: float = 0.0):
    # h = (pi_c - ref_c) - (pi_r - ref_r) = (-1 + 2) - (-3 + 2) = 2
    t = torch.tensor
    return L.dpo_loss(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]), beta, loss_type, label_smoothing)


def test_dpo_sigmoid_hand_computed():
    losses, chosen, rejected = _pair(0.5, "sigmoid")
    assert losses.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)  # -log sigmoid(0.5 * 2)
    assert chosen.item() == pytest.approx(0.5) and rejected.item() == pytest.approx(-0.5)
    # conservative DPO: 0.9 log(1+e^-1) + 0.1 log(1+e) = log(1+e^-1) + 0.1
    losses, _, _ = _pair(0.5, "sigmoid", label_smoothing=0.1)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-1.0)) + 0.1, abs=1e-6)


def test_dpo_ipo_and_hinge_hand_computed():
    assert _pair(0.5, "ipo")[0].item() == pytest.approx((2 - 1 / (2 * 0.5)) ** 2)  # = 1
    assert _pair(0.1, "ipo")[0].item() == pytest.approx((2 - 5) ** 2)  # = 9
    assert _pair(0.5, "hinge")[0].item() == pytest.approx(0.0)  # relu(1 - 1)
    assert _pair(0.1, "hinge")[0].item() == pytest.approx(0.8)  # relu(1 - 0.2)


def test_dpo_reference_equals_policy_gives_ln2():
    g = torch.Generator().manual_seed(0)
    chosen, rejected = -50 * torch.rand(64, generator=g), -50 * torch.rand(64, generator=g)
    losses, cr, rr = L.dpo_loss(chosen, rejected, chosen.clone(), rejected.clone(), beta=0.1)
    assert abs(losses.mean().item() - LN2) < 1e-6
    assert torch.all(cr == 0) and torch.all(rr == 0)


def test_dpo_reference_free_equals_zero_reference():
    pc, pr = torch.tensor([-4.0, -2.0]), torch.tensor([-5.0, -1.0])
    free = L.dpo_loss(pc, pr, None, None, beta=0.2)
    zero = L.dpo_loss(pc, pr, torch.zeros(2), torch.zeros(2), beta=0.2)
    for a, b in zip(free, zero):
        assert torch.equal(a, b)
    # h = (-4 + 5, -2 + 1) = (1, -1)
    torch.testing.assert_close(free[0], -torch.nn.functional.logsigmoid(torch.tensor([0.2, -0.2])))


def test_dpo_rewards_are_detached_and_loss_has_grad():
    pc = torch.tensor([-1.0], requires_grad=True)
    losses, cr, _ = L.dpo_loss(pc, torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]))
    losses.sum().backward()
    assert not cr.requires_grad and pc.grad is not None and pc.grad.item() < 0


def test_dpo_rejects_bad_arguments():
    t = torch.zeros(1)
    with pytest.raises(ValueError, match="loss_type"):
        L.dpo_loss(t, t, t, t, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        L.dpo_loss(t, t, t, t, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta"):
        L.dpo_loss(t, t, t, t, beta=0.0)


# ------------------------------------------------------------------------------------------
# RL maths


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: constant -> 0
    std = math.sqrt(1 / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / torch.tensor([std + 1e-4] * 4 + [1e-4] * 4)
    # TRL's choice, kept as an explicit option
    torch.testing.assert_close(L.grpo_advantages(rewards, 4, eps=1e-4, unbiased=True), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        L.grpo_advantages(rewards, 4, scale=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    )
    with pytest.raises(ValueError, match="group_size"):
        L.grpo_advantages(rewards, 3)


def test_kl_estimators_hand_computed():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    # log r = ln(0.25 / 0.5) = -ln 2
    assert L.kl_estimate(logp, ref, "k1").item() == pytest.approx(LN2, abs=1e-6)
    assert L.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * LN2**2, abs=1e-6)
    assert L.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN2, abs=1e-6)
    same = L.kl_estimate(logp, logp, "k3")
    assert same.item() == 0.0
    with pytest.raises(ValueError, match="k3"):
        L.kl_estimate(logp, ref, "k4")


def test_kl_estimator_gradients_against_the_true_reverse_kl():
    """On a 4-way categorical pi = softmax(theta) and a fixed reference: the expected gradient of
    each estimator used as a loss, E_{x ~ pi}[grad kl(x)] (summed exactly over x, pi detached: the
    samples are drawn, not differentiated), against autograd of the true KL. k2, k1+ and k3+ give
    the reverse KL's gradient; k1 gives 0; k3 gives the forward KL(ref || pi)'s. The values of k1+
    and k3+ are k1's and k3's exactly, and E[k1] = E[k3] = KL(pi || ref)."""
    theta = torch.tensor([0.3, -0.2, 1.0, 0.1], dtype=torch.float64)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.4, 0.2], dtype=torch.float64), dim=0)

    def grad(f):
        t = theta.clone().requires_grad_(True)
        f(torch.log_softmax(t, dim=0)).backward()
        return t.grad

    reverse = grad(lambda logp: (logp.exp() * (logp - ref)).sum())
    forward = grad(lambda logp: (ref.exp() * (ref - logp)).sum())

    def expected(kind):
        return grad(lambda logp: (logp.exp().detach() * L.kl_estimate(logp, ref, kind)).sum())

    for kind in ("k2", "k1+", "k3+"):
        torch.testing.assert_close(expected(kind), reverse)
    torch.testing.assert_close(expected("k1"), torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(expected("k3"), forward)
    assert not torch.allclose(forward, reverse)  # the case tells the two apart
    logp = torch.log_softmax(theta, dim=0)
    true_kl = (logp.exp() * (logp - ref)).sum()
    for kind in ("k1", "k3", "k1+", "k3+"):
        torch.testing.assert_close((logp.exp() * L.kl_estimate(logp, ref, kind)).sum(), true_kl)
    for kind in ("k1", "k3"):  # the straight-through value is the plain one, bit for bit
        assert torch.equal(L.kl_estimate(logp, ref, kind + "+"), L.kl_estimate(logp, ref, kind))


def test_clipped_surrogate_hand_computed():
    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
    loss, clipped = L.clipped_surrogate(torch.log(ratio), torch.zeros_like(ratio), adv, clip_eps=0.2)
    # min(1.5, 1.2) = 1.2; min(-1.5, -1.2) = -1.5; min(0.5, 0.8) = 0.5; min(-0.5, -0.8) = -0.8; 2
    torch.testing.assert_close(loss, -torch.tensor([[1.2, -1.5, 0.5, -0.8, 2.0]]))
    assert clipped.tolist() == [[True, False, False, True, False]]
    # asymmetric clip (DAPO): the high side allows 1.28
    loss, _ = L.clipped_surrogate(torch.log(ratio), torch.zeros_like(ratio), adv, 0.2, clip_eps_high=0.28)
    assert loss[0, 0].item() == pytest.approx(-1.28)
    # one advantage per sequence broadcasts over its tokens
    loss, _ = L.clipped_surrogate(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -2.0]))
    torch.testing.assert_close(loss, torch.tensor([[-1.0] * 3, [2.0] * 3]))


def test_gae_hand_computed():
    rewards = torch.tensor([[9.0, 0.0, 0.0, 1.0], [0.0, 2.0, 5.0, 5.0]])
    values = torch.tensor([[5.0, 0.5, 0.6, 0.7], [1.0, 1.0, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    adv, ret = L.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: A3 = 1 - .7 = .3; A2 = (.7 - .6) + .5 * .3 = .25; A1 = (.6 - .5) + .5 * .25 = .225
    # row 1: A1 = 2 - 1 = 1; A0 = (1 - 1) + .5 * 1 = .5
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.225, 0.25, 0.3], [0.5, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.725, 0.85, 1.0], [1.5, 2.0, 0.0, 0.0]]))
    adv, _ = L.gae(rewards[:1], values[:1], mask[:1], gamma=0.9, lam=0.5)
    # A3 = .3; A2 = (.9 * .7 - .6) + .45 * .3 = .165; A1 = (.9 * .6 - .5) + .45 * .165 = .11425
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.11425, 0.165, 0.3]]))


def test_value_loss_hand_computed():
    values, old, returns = torch.tensor([1.0, 0.9]), torch.tensor([0.5, 0.0]), torch.tensor([0.0, 1.0])
    loss, clipped = L.value_loss(values, old, returns, clip_eps=0.2)
    # elem 0: max((1-0)^2, (0.7-0)^2) = 1; elem 1: max(0.1^2, (0.2-1)^2) = 0.64
    torch.testing.assert_close(loss, torch.tensor([0.5, 0.32]))
    assert clipped.tolist() == [False, True]
    loss, clipped = L.value_loss(values, old, returns, clip_eps=None)
    torch.testing.assert_close(loss, torch.tensor([0.5, 0.005]))
    assert not clipped.any()


# ------------------------------------------------------------------------------------------
# parity with TRL's DPOTrainer loss


def _trl_dpo_loss(per_token_logps, ref_chosen, ref_rejected, completion_mask, beta, loss_type):
    """Run TRL's own DPOTrainer._compute_loss on given per-token log-probs through a stub model."""
    from collections import defaultdict
    from types import SimpleNamespace

    trl = pytest.importorskip("trl")
    n2, t1 = per_token_logps.shape  # (2B, T - 1): chosen rows then rejected rows

    def fake_model(**_kwargs):
        return SimpleNamespace(
            log_probs=per_token_logps,
            entropy=torch.zeros(n2, t1),
            mean_logits=torch.zeros(n2, t1),
            is_top1=torch.zeros(n2, t1, dtype=torch.bool),
        )

    fake_model.training = True
    stub = SimpleNamespace(
        model=fake_model,
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(n2, t1 + 1, dtype=torch.long),
        "attention_mask": torch.ones(n2, t1 + 1, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    loss = trl.DPOTrainer._compute_loss(stub, fake_model, inputs, return_outputs=False)
    return loss, stub._metrics["train"]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_trl(loss_type, beta):
    g = torch.Generator().manual_seed(1)
    B, T = 4, 7
    completion_mask = torch.ones(2 * B, T, dtype=torch.long)
    completion_mask[:, :2] = 0  # prompt tokens
    completion_mask[1, 5:] = 0  # a shorter chosen completion
    completion_mask[B + 2, 4:] = 0  # a shorter rejected completion
    shift_mask = completion_mask[:, 1:]  # (2B, T - 1)
    per_token = -3 * torch.rand(2 * B, T - 1, generator=g) * shift_mask  # 0 off the completion
    ref = -3 * torch.rand(2 * B, T - 1, generator=g) * shift_mask

    # IPO compares per-token means (TRL's length normalisation); the others compare sums
    n = shift_mask.sum(dim=1).clamp(min=1)
    logps = per_token.sum(1) / n if loss_type == "ipo" else per_token.sum(1)
    ref_logps = ref.sum(1) / n if loss_type == "ipo" else ref.sum(1)
    ours, chosen_r, rejected_r = L.dpo_loss(
        logps[:B], logps[B:], ref_logps[:B], ref_logps[B:], beta, loss_type
    )

    trl_loss, metrics = _trl_dpo_loss(
        per_token, ref.sum(1)[:B], ref.sum(1)[B:], completion_mask, beta, loss_type
    )
    assert ours.mean().item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    # the reported rewards use the summed log-ratios in TRL; compare for the summed types
    if loss_type != "ipo":
        assert chosen_r.mean().item() == pytest.approx(metrics["rewards/chosen"][0], rel=1e-5, abs=1e-6)
        assert rejected_r.mean().item() == pytest.approx(metrics["rewards/rejected"][0], rel=1e-5, abs=1e-6)


def test_grpo_advantages_default_is_population_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, population std 0.5 -> +-1 (up to eps 1e-8); group 2: identical rewards -> 0
    expected = torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0, 0])
    torch.testing.assert_close(L.grpo_advantages(rewards, 4), expected, atol=1e-6, rtol=0)
    assert L.grpo_advantages(torch.tensor([3.0, 3.0]), 2).eq(0).all()


def test_aggregation_modes_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    total, units = L.aggregate_token_loss(per_token, mask, "token_mean")
    assert total.item() == 10.0 and units.item() == 4  # (1 + 2 + 3 + 4) / 4 tokens = 2.5
    total, units = L.aggregate_token_loss(per_token, mask, "seq_mean")
    assert total.item() == 6.0 and units.item() == 2  # (mean 2 + mean 4) / 2 sequences = 3
    total, units = L.aggregate_token_loss(per_token, mask, "seq_mean_token_sum_norm", max_len=4)
    assert total.item() == 2.5 and units.item() == 2  # (6 / 4 + 4 / 4) / 2 = 1.25
    with pytest.raises(ValueError, match="rl_loss_agg"):
        L.aggregate_token_loss(per_token, mask, "sum")


def test_fully_masked_response_gives_zero_loss_and_zero_gradient():
    logps = torch.zeros(2, 3, requires_grad=True)
    loss, _ = L.clipped_surrogate(logps, torch.zeros(2, 3), torch.tensor([1.0, -1.0]))
    total, _ = L.aggregate_token_loss(loss, torch.zeros(2, 3), "token_mean")
    total.backward()
    assert total.item() == 0.0 and logps.grad.abs().sum().item() == 0.0


def test_clipping_on_both_sides():
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, clipped = L.clipped_surrogate(logps, old, adv, clip_eps=0.2)
    # A > 0, ratio 1.5: clipped to 1.2; A < 0, ratio 1.5: unclipped 1.5 (min picks the worse);
    # A > 0, ratio 0.5: unclipped 0.5; A < 0, ratio 0.5: clipped to 0.8
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.5, -0.5, 0.8]]))
    assert clipped.tolist() == [[True, False, False, True]]
    loss_high, _ = L.clipped_surrogate(logps, old, adv, clip_eps=0.2, clip_eps_high=0.28)
    torch.testing.assert_close(loss_high[0, 0], torch.tensor(-1.28))  # DAPO's wider upper clip


def test_k3_kl_is_never_negative():
    logps = torch.randn(100)
    ref = torch.randn(100)
    assert (L.kl_estimate(logps, ref, "k3") >= 0).all()


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    """clip_ratio_c 3: with A = -1 the ratio 5 gives loss min(max(5, 1.2), 3) = 3 and no gradient;
    ratio 0.5 keeps max(0.5, 0.8) = 0.8; positive advantages are untouched (ratio 5, A = 1: -1.2)."""
    logps = torch.log(torch.tensor([[5.0, 0.5, 5.0]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, clipped = L.clipped_surrogate(logps, torch.zeros(1, 3), adv, 0.2, clip_ratio_c=3.0)
    assert loss.tolist()[0] == pytest.approx([3.0, 0.8, -1.2])
    assert clipped.tolist() == [[True, True, True]]
    loss.sum().backward()
    assert logps.grad.tolist() == [[0.0, 0.0, 0.0]]  # every branch here is a constant
    plain, was = L.clipped_surrogate(logps.detach(), torch.zeros(1, 3), adv, 0.2)
    assert plain.tolist()[0] == pytest.approx([5.0, 0.8, -1.2]) and was.tolist() == [[False, True, True]]


def test_cispo_clips_the_weight_not_the_gradient():
    """CISPO, eps 0.2: ratios 1.5, 1.0, 0.5 with A = 1, -1, 1 get weights 1.2, 1.0, 0.8; the loss is
    -w A logp and its gradient -w A on every token, the clipped ones included (PPO's clip gives the
    first token none)."""
    logps = torch.log(torch.tensor([[0.3, 0.2, 0.1]]))
    old = logps - torch.log(torch.tensor([[1.5, 1.0, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    x = logps.clone().requires_grad_(True)
    loss, clipped = L.cispo_loss(x, old, adv, 0.2)
    assert loss.tolist()[0] == pytest.approx([-1.2 * math.log(0.3), math.log(0.2), -0.8 * math.log(0.1)], rel=1e-5)
    assert clipped.tolist() == [[True, False, True]]
    loss.sum().backward()
    assert x.grad.tolist()[0] == pytest.approx([-1.2, 1.0, -0.8], rel=1e-5)
    y = logps.clone().requires_grad_(True)
    L.clipped_surrogate(y, old, adv, 0.2)[0].sum().backward()
    assert y.grad[0, 0] == 0


def test_importance_weights_hand_computed():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5, 0.0]])  # log-ratios 0.5, -1.0, 0.0; the last is padding
    mask = torch.tensor([[1, 1, 1, 0]])
    w, capped = L.importance_weights(trainer, sampler, mask, "token", cap=1.5)
    # exp(0.5) = 1.6487 is capped at 1.5; exp(-1) = 0.3679; exp(0) = 1; padding 0
    assert w.tolist()[0] == pytest.approx([1.5, math.exp(-1.0), 1.0, 0.0])
    assert capped.tolist() == [[True, False, False, False]]
    w, capped = L.importance_weights(trainer, sampler, mask, "sequence", cap=2.0)
    # one weight per sample: exp(0.5 - 1.0 + 0.0) = exp(-0.5) = 0.6065 on every token
    assert w.tolist()[0] == pytest.approx([math.exp(-0.5)] * 3 + [0.0])
    assert not capped.any()
    w, capped = L.importance_weights(trainer, sampler, mask, "none")
    assert w.tolist() == [[1.0, 1.0, 1.0, 0.0]] and not capped.any()
    with pytest.raises(ValueError, match="rollout_is_level"):
        L.importance_weights(trainer, sampler, mask, "tokens")


def test_importance_weights_mask_mode_by_hand():
    """rollout_is_mode mask: ratios e^0.5 = 1.65, e^-1 = 0.37, 1 and e^-0.6 = 0.55 against the band
    [1/1.5, 1.5]: the first two leave it and weigh 0, the others keep their ratio; with the lower
    bound 0.5 the last stays in; at sequence level the sample's ratio e^-1.1 = 0.33 leaves it."""
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -0.6, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w, out = L.importance_weights(trainer, sampler, mask, "token", cap=1.5, mode="mask")
    assert w.tolist()[0] == pytest.approx([0.0, 0.0, 1.0, 0.0, 0.0])
    assert out.tolist() == [[True, True, False, True, False]]
    w, out = L.importance_weights(trainer, sampler, mask, "token", cap=1.5, mode="mask", low=0.5)
    assert w.tolist()[0] == pytest.approx([0.0, 0.0, 1.0, math.exp(-0.6), 0.0])
    assert out.tolist() == [[True, True, False, False, False]]
    w, out = L.importance_weights(trainer, sampler, mask, "sequence", cap=2.0, mode="mask")
    assert w.tolist() == [[0.0] * 5] and out.tolist() == [[True] * 4 + [False]]
    with pytest.raises(ValueError, match="rollout_is_mode"):
        L.importance_weights(trainer, sampler, mask, "token", mode="clip")


def test_token_entropy_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.5, 0.0 + 1e-30], [1.0, 1e-30, 1e-30]]))
    assert L.token_entropy(logits).tolist() == pytest.approx([math.log(2), 0.0], abs=1e-6)
