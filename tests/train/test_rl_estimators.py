"""RL breadth: advantage estimators (grpo, rloo, reinforce_pp), GSPO's sequence-level ratio, the
KL estimators and masking of truncated completions, each against numbers worked out by hand and
in a short online run."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.config import ConfigError, load_config
from astrai.train import losses as L
from astrai.train.build import check_config
from astrai.train.cli import main
from tests.train.resume_data import read_metrics
from tests.train.rl_runs import write_rl_run


def test_rloo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])  # two groups of 3
    # group 1: 1 - (0 + 0)/2 = 1, 0 - (1 + 0)/2 = -0.5, -0.5; group 2: 1 - 2 = -1, 2 - 1.5 = 0.5, 0.5
    assert L.rloo_advantages(rewards, 3).tolist() == pytest.approx([1.0, -0.5, -0.5, -1.0, 0.5, 0.5])
    assert L.rloo_advantages(torch.ones(4), 2).tolist() == [0.0] * 4  # equal rewards: no signal
    with pytest.raises(ValueError, match="group_size >= 2"):
        L.rloo_advantages(torch.ones(3), 1)
    # the estimator table is train's: checked by the run builder (and `astrai train`) before any model
    with pytest.raises(ConfigError, match="advantage_estimator rloo needs group_size >= 2"):
        check_config(load_config(None, ["--advantage_estimator", "rloo", "--group_size", "1"]))
    assert main(["--advantage_estimator", "rloo", "--group_size", "1", "--dry_run"]) == 2


def test_reward_to_go_and_batch_whitening_by_hand():
    rewards = torch.tensor([[0.0, -0.1, -0.2, 1.0], [0.0, -0.1, 0.5, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    returns = L.reward_to_go(rewards, mask)
    assert returns.flatten().tolist() == pytest.approx([0.0, 0.7, 0.8, 1.0, 0.0, 0.4, 0.5, 0.0])
    white = L.whiten_with_sums(returns, mask)
    vals = [0.7, 0.8, 1.0, 0.4, 0.5]
    mean = sum(vals) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 5)  # population std over the batch's tokens
    assert white[mask.bool()].tolist() == pytest.approx([(v - mean) / std for v in vals], rel=1e-5)
    assert white[~mask.bool()].tolist() == [0.0] * 3
    # all ranks: the sums are reduced by the callable (here: as if a second rank held the same rows)
    doubled = L.whiten_with_sums(returns, mask, all_reduce=lambda t: 2 * t)
    assert doubled.flatten().tolist() == pytest.approx(white.flatten().tolist(), rel=1e-5)


def test_reward_to_go_carries_the_final_reward_across_the_gaps_between_turns():
    """REINFORCE++ on a multi-turn row: turn 1 is position 0, a tool result fills 1-2 (no mask),
    turn 2 is 3-4 with the score 1 on 4. Every model token's return is the episode's score (before
    the fix the return restarted at 0 in the gap, so turn 1 got 0 whatever the episode earned)."""
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]])
    rewards = L.token_rewards(torch.tensor([1.0]), mask)
    assert L.reward_to_go(rewards, mask).tolist() == [[1.0, 0, 0, 1.0, 1.0, 0]]
    # gamma 0.5: the discount counts model tokens, not the tool tokens between them (as gae's)
    assert L.reward_to_go(rewards, mask, gamma=0.5).tolist() == [[0.25, 0, 0, 0.5, 1.0, 0]]
    # a per-token KL reward in turn 1 adds to it; a reward in the gap (unmasked) is ignored
    rewards = torch.tensor([[-0.1, 5.0, 5.0, -0.2, 1.0, 0.0]])
    assert L.reward_to_go(rewards, mask).tolist()[0] == pytest.approx([0.7, 0, 0, 0.8, 1.0, 0])


def test_sequence_level_ratio_is_clipped_per_sample():
    logps = torch.tensor([[-1.0, -1.0, 0.0], [-0.5, -0.7, -0.2]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.4, 0.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    seq = L.sequence_log_ratio(logps, old, mask)
    # sample 1: mean(0.2, 0.4) = 0.3 -> ratio e^0.3 = 1.35; sample 2: mean(0, -0.2, 0.3) = 1/30
    assert seq.squeeze(1).tolist() == pytest.approx([0.3, 1 / 30])
    loss, clipped = L.clipped_surrogate(seq.expand_as(logps), torch.zeros(2, 3), torch.tensor([1.0, 1.0]), 0.2)
    assert loss[0, 0].item() == pytest.approx(-1.2)  # clipped at 1 + 0.2 for a positive advantage
    assert loss[1, 0].item() == pytest.approx(-math.exp(1 / 30))
    assert clipped[0].all() and not clipped[1].any()
    (loss * mask).sum().backward()  # the clipped sample sends no gradient; the other one through all tokens
    assert logps.grad[0].abs().sum() == 0 and (logps.grad[1] != 0).all()


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log r = ref - logp = -0.5
    assert L.kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert L.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert L.kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    scores, mask = torch.tensor([1.0]), torch.tensor([[1, 1]])
    r = L.token_rewards(scores, mask, torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -1.5]]), 0.1, "k2")
    assert r.tolist()[0] == pytest.approx([-0.0125, 1 - 0.0125])


@pytest.mark.parametrize("flags", [
    {"advantage_estimator": "rloo"},
    {"advantage_estimator": "reinforce_pp", "kl_coef": 0.05, "kl_estimator": "k2"},
    {"importance_sampling_level": "sequence", "clip_eps": 0.0003, "clip_eps_high": 0.0004},
    {"kl_coef": 0.05, "kl_estimator": "k1"},
    {"kl_coef": 0.05, "kl_in_reward": True, "policy_loss": "cispo", "clip_eps_high": 2.0, "rollout_is_mode": "mask"},
    {"advantage_estimator": "reinforce_pp_baseline", "kl_coef": 0.05, "entropy_coef": 0.01, "rollout_top_k": 20},
])
def test_each_estimator_trains_online(tmp_path, tok_dir, flags):  # noqa: F811
    config = write_rl_run(tmp_path, tok_dir, rollout_interval=2, **flags)
    assert main(["--config", str(config), "--max_steps", "2"]) == 0
    rows = read_metrics(tmp_path)
    assert [m["step"] for m in rows] == [1, 2]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in rows)
    assert rows[0]["sampler_logp_diff"] <= 1e-5
    assert ("kl" in rows[0]) == ("kl_coef" in flags)  # in the loss or in the rewards, the KL is reported


def test_masked_truncated_completions_carry_no_loss(tmp_path, tok_dir):  # noqa: F811
    """rollout_max_tokens 2 cuts every completion of this tiny model: with masking no loss token is
    left, so the step sends no gradient; without it the same run trains."""
    from safetensors.torch import load_file

    from astrai.train.publish import latest_checkpoint

    results = {}
    for mask in (True, False):
        run = tmp_path / str(mask)
        config = write_rl_run(run, tok_dir, rollout_max_tokens=2, mask_truncated_completions=mask,
                              rewards=["tests.train.rl_user_code:varied_reward"])
        assert main(["--config", str(config), "--max_steps", "1"]) == 0
        results[mask] = (read_metrics(run)[0], load_file(str(latest_checkpoint(run / "ckpt") / "model.safetensors")))
    masked, plain = results[True][0], results[False][0]
    assert masked["truncated_fraction"] == 1.0 and plain["truncated_fraction"] == 1.0
    assert masked["grad_norm"] == 0.0 < plain["grad_norm"]  # no loss token left: nothing to learn from
    assert masked["loss"] == 0.0
    same = [torch.equal(results[True][1][k], results[False][1][k]) for k in results[True][1]]
    assert not all(same)  # the unmasked run moved the weights, the masked one did not


def half_flat_reward(prompt, completion, record):
    """0 for every sample of about half the prompts (their groups carry no signal), varied otherwise."""
    return 0.0 if len(prompt) % 2 == 0 else float(len(completion) % 3)


def _dynamic_run(run_dir, tok_dir, steps: int):  # noqa: F811
    config = write_rl_run(run_dir, tok_dir, rollout_interval=2, dynamic_sampling=True, max_resample_batches=3,
                          rewards=["tests.train.test_rl_estimators:half_flat_reward"])
    config.write_text(config.read_text().replace("max_steps: 4", f"max_steps: {steps}"))
    return config


def test_dynamic_sampling_keeps_only_groups_with_signal(tmp_path, tok_dir, monkeypatch):  # noqa: F811
    from astrai.train.rl import loop as loop_mod

    seen = []
    real = loop_mod.OnlineLoop._next_rollout

    def spy(self):
        rollout = real(self)
        seen.append(rollout.rewards.clone())
        return rollout

    monkeypatch.setattr(loop_mod.OnlineLoop, "_next_rollout", spy)
    assert main(["--config", str(_dynamic_run(tmp_path, tok_dir, 4))]) == 0
    rows = read_metrics(tmp_path)
    fresh = [m for m in rows if "filtered_groups" in m]
    assert len(fresh) == 2 and sum(m["filtered_groups"] for m in fresh) > 0  # flat groups were dropped
    for rewards in seen:  # batch_per_device groups, each with distinct rewards
        assert rewards.size(0) == 4 and bool((rewards.max(dim=1).values > rewards.min(dim=1).values).all())
    # the dropped groups are traced too, flagged, after the trained samples of their step
    from astrai.train.traces import read_traces

    lines = read_traces(tmp_path / "log")
    dropped = [t for t in lines if t.get("filtered")]
    assert dropped and all(t["masked"] and not t["group_has_signal"] and "advantage" not in t for t in dropped)
    assert all(t["group_has_signal"] for t in lines if not t.get("filtered"))
    for step in {t["step"] for t in dropped}:
        kinds = [bool(t.get("filtered")) for t in lines if t["step"] == step]
        assert kinds == sorted(kinds) and kinds.count(True) <= 8  # trace_samples (default 8) of each kind
        groups = {}
        for t in dropped:
            if t["step"] == step:
                groups.setdefault(t["group"], set()).add(t["reward"])
        assert all(len(r) == 1 for r in groups.values())  # each dropped group's rewards all alike


@pytest.mark.slow
def test_dynamic_sampling_resumes_exactly(tmp_path, tok_dir):  # noqa: F811
    from safetensors.torch import load_file

    from astrai.train.publish import latest_checkpoint
    from tests.train.rl_runs import sigterm_after_step

    straight, stopped = (_dynamic_run(tmp_path / name, tok_dir, 6) for name in ("straight", "stopped"))
    assert main(["--config", str(straight)]) == 0
    sigterm_after_step(stopped, 3, tmp_path)  # inside the second rollout, which serves steps 3 and 4
    assert main(["--config", str(stopped), "--resume"]) == 0
    keys = ("step", "loss", "grad_norm", "reward_mean", "filtered_groups", "rollout_policy_version")
    assert [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "stopped")] == \
        [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "straight")]
    a, b = (load_file(str(latest_checkpoint(tmp_path / n / "ckpt") / "model.safetensors")) for n in ("stopped", "straight"))
    assert all(a[k].equal(b[k]) for k in a)


MASK = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # samples of 2 and 6 tokens
LOGPS = torch.tensor([[-0.5, -1.0, 0, 0, 0, 0], [-0.2, -0.4, -0.6, -0.8, -1.0, -1.2]])


def objective_step(flags: list[str], advantages, offset=0.0, sampler=None, entropy=None):
    """One online GRPO objective call under `flags` on two samples (MASK), the policy's log-probs
    LOGPS given (no model): (loss per loss unit, gradient of the loss sum w.r.t. the log-probs).
    `offset`: the pinned old log-probs sit this far below the current ones (ratio e^offset);
    `sampler`: the sampler's log-probs (default the old ones: importance weights 1); `entropy`:
    the policy's token entropy (a leaf, so the entropy bonus's gradient can be read off it)."""
    from astrai.train.objectives.grpo import GRPOObjective
    from astrai.train.objectives.logps import PolicyLogps

    cfg = load_config(None, ["--train_type", "online_grpo", *flags])
    objective = GRPOObjective(cfg, torch.nn.Linear(1, 1), online=True)
    objective.requested_metrics = frozenset()
    logps = LOGPS.clone().requires_grad_(True)
    objective.logps = lambda model, batch, entropy=False, entropy_grad=False: PolicyLogps(logps, MASK, None, ent)
    ent = entropy
    offset = torch.as_tensor(offset)
    old = torch.where(MASK, LOGPS - offset, 0.0)
    pinned = old if bool((offset != 0).any()) else torch.where(MASK, math.nan, 0.0)  # NaN: the rollout's first step
    batch = {"labels": torch.where(MASK, 1, -100), "old_logps": old if sampler is None else sampler,
             "trainer_logps": pinned, "advantages": advantages}
    out = objective(None, batch)
    out.loss.backward()
    return (out.loss / objective.num_units(batch)).item(), logps.grad


def gspo_step(level: str, advantages, offset: float = 0.0):
    return objective_step(["--importance_sampling_level", level], advantages, offset)


def test_gspo_averages_per_sequence_and_gspo_token_has_its_gradient():
    """GSPO's loss is -s_i A_i per sample: with advantages +1 (2 tokens) and -1 (6 tokens) at ratio 1
    the per-sequence mean is (-1 + 1) / 2 = 0; the token mean was (2 * -1 + 6 * 1) / 8 = 0.5, the
    long sample weighing 3x. GSPO-token (sequence_token) takes the same value and, with one
    advantage per sample, the same gradient; with per-token advantages each token's own."""
    adv = torch.tensor([1.0, -1.0])
    assert gspo_step("sequence", adv)[0] == pytest.approx(0.0)
    assert gspo_step("sequence_token", adv)[0] == pytest.approx(0.0)
    loss, grad = gspo_step("sequence", adv, offset=0.05)
    loss_tok, grad_tok = gspo_step("sequence_token", adv, offset=0.05)
    assert loss_tok == pytest.approx(loss)
    torch.testing.assert_close(grad_tok, grad)
    # by hand: d/dlogp_t of -s_i A_i / |y_i| summed over 2 sequences = -s A / |y|, s = e^0.05
    s = math.exp(0.05)
    assert grad[0, :2].tolist() == pytest.approx([-s / 2] * 2) and grad[1].tolist() == pytest.approx([s / 6] * 6)
    per_token = torch.tensor([[2.0, 0.0, 0, 0, 0, 0], [-1.0] * 6])
    _, grad_tok = gspo_step("sequence_token", per_token, offset=0.05)
    assert grad_tok[0, :2].tolist() == pytest.approx([-s * 2 / 2, 0.0])


@pytest.mark.parametrize("flags,match", [
    (["--importance_sampling_level", "sequence", "--advantage_estimator", "reinforce_pp"],
     "needs one advantage per sample, but reinforce_pp gives one per token"),
    (["--importance_sampling_level", "sequence", "--rl_loss_agg", "seq_mean_token_sum_norm"],
     "averages its loss per sequence"),
    (["--train_type", "online_ppo", "--advantage_estimator", "rloo"], "advantage_estimator='rloo' applies to the GRPO"),
    (["--train_type", "online_ppo", "--importance_sampling_level", "sequence"],
     "importance_sampling_level='sequence' applies to the GRPO"),
    (["--clip_eps_high", "-0.1"], r"clip_eps_high=-0.1 must be >= 0"),
    (["--policy_loss", "cispo", "--importance_sampling_level", "sequence"], "policy_loss='cispo' weighs each token"),
    (["--policy_loss", "cispo", "--clip_ratio_c", "3"], "clip_ratio_c=3.0 .* does not apply"),
])
def test_settings_an_objective_would_ignore_or_misread_are_refused(flags, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, flags)
    load_config(None, ["--importance_sampling_level", "sequence_token", "--advantage_estimator", "reinforce_pp"])


def test_near_equal_rewards_get_small_advantages():
    """reward_std_floor (1e-4): rewards 1e-6 apart got +-1 with the bare 1e-8 of before; now ~+-0.005.
    A group whose std is above the floor divides exactly as before (seeded runs keep their bits)."""
    from astrai.train.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs

    floor = load_config(None, []).rl.reward_std_floor
    x = AdvantageInputs(torch.tensor([[1.0, 1.000001]]), torch.ones(2, 1, dtype=torch.bool), torch.zeros(2, 1), None,
                        True, floor, 0.0, "k3+", None)
    adv = ADVANTAGE_ESTIMATORS["grpo"].function(x)
    assert adv.abs().max().item() < 0.01
    half_gap = (torch.tensor(1.000001) - 1).item() / 2  # the float32 rewards' distance from their mean
    assert adv.abs().max().item() == pytest.approx(half_gap / (1e-4 + 1e-8), rel=1e-3)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    assert torch.equal(L.grpo_advantages(rewards, 4, std_floor=floor), L.grpo_advantages(rewards, 4))


def test_entropy_coef_adds_a_bonus_with_its_gradient():
    """entropy_coef 0.1: at ratio 1 with advantages 0 the loss is -0.1 * the token mean of the
    entropy (tokens weigh alike under token_mean): -0.1 * (2 * 1.0 + 6 * 2.0) / 8; each token's
    entropy gets gradient -0.1 from the loss sum."""
    entropy = torch.where(MASK, torch.tensor([[1.0], [2.0]]), 0.0).requires_grad_(True)
    loss, _ = objective_step(["--entropy_coef", "0.1"], torch.zeros(2), entropy=entropy)
    assert loss == pytest.approx(-0.1 * (2 * 1.0 + 6 * 2.0) / 8)
    assert entropy.grad[MASK].tolist() == pytest.approx([-0.1] * 8) and entropy.grad[~MASK].abs().sum() == 0
    assert objective_step([], torch.zeros(2), entropy=entropy.detach())[0] == 0.0  # off by default


def test_is_mask_mode_drops_the_tokens_outside_the_band():
    """The objective's importance weights in mask mode: the sampler put log-prob 1 above the
    trainer on sample 2's third token (ratio e^-1, below 1/1.5): that token sends no gradient; in
    truncate mode it is weighted by e^-1."""
    sampler = torch.where(MASK, LOGPS, 0.0)
    sampler[1, 2] += 1.0
    adv = torch.tensor([1.0, 1.0])
    _, masked = objective_step(["--rollout_is_mode", "mask", "--rollout_is_cap", "1.5"], adv, sampler=sampler)
    _, truncated = objective_step([], adv, sampler=sampler)
    assert masked[1, 2] == 0 and masked[1, 3] == truncated[1, 3] != 0
    assert truncated[1, 2].item() == pytest.approx(math.exp(-1.0) * truncated[1, 3].item())


def test_the_reference_resets_and_follows_an_ema_by_hand():
    from astrai.train.objectives.base import update_reference

    policy, ref = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        policy.weight.copy_(torch.tensor([[1.0, 2.0]]))
        ref.weight.zero_()
    update_reference(ref, policy, 1, 0, 0.9)  # ema: 0.9 * 0 + 0.1 * policy
    assert ref.weight.tolist() == [pytest.approx([0.1, 0.2])]
    update_reference(ref, policy, 3, 2, None)  # step 3 is no multiple of 2: frozen
    assert ref.weight.tolist() == [pytest.approx([0.1, 0.2])]
    update_reference(ref, policy, 4, 2, 0.9)  # a reset wins over the ema on its steps
    assert ref.weight.tolist() == [[1.0, 2.0]]
    with pytest.raises(ConfigError, match="ref_reset_interval=2 moves the reference .* no KL"):
        load_config(None, ["--train_type", "online_grpo", "--ref_reset_interval", "2"])
    with pytest.raises(ConfigError, match="under LoRA the reference is the base model"):
        load_config(None, ["--train_type", "online_grpo", "--ref_ema", "0.9", "--kl_coef", "0.1", "--lora_r", "4"])


def test_a_reset_reference_is_the_policy_and_travels_in_checkpoints(tmp_path, tok_dir):
    """ref_reset_interval 2 with the KL in the loss (k3+): after step 2 the reference is the policy,
    so step 3's kl is 0 exactly, while step 2's (one update away from the initial reference) is not;
    the reference is saved beside the weights and loaded on resume."""
    config = write_rl_run(tmp_path, tok_dir, kl_coef=0.1, ref_reset_interval=2,
                          rewards=["tests.train.rl_user_code:varied_reward"])
    assert main(["--config", str(config), "--max_steps", "3", "--ckpt_interval", "3"]) == 0
    rows = read_metrics(tmp_path)
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0 and rows[2]["kl"] == 0.0
    from astrai.train.publish import latest_checkpoint

    assert (latest_checkpoint(tmp_path / "ckpt") / "reference_model.pt").is_file()

