"""The advantage-estimator table: its names are the config's choices, each function gives the numbers
of its pure formula in ``train/losses.py``, and its facts drive the group-size check and the
run builder's no-signal warning."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.config import ConfigError, load_config
from astrai.config_values import CHOICES
from astrai.train import losses as L
from astrai.train.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    check_group_size,
    reward_kl,
    with_kl_in_scores,
)
from astrai.train.build import warn_if_no_signal


def inputs(rewards, **kw):
    N = rewards.numel()
    mask = torch.tensor([[0, 1, 1]] * N, dtype=torch.bool)
    base = dict(mask=mask, behaviour_logps=torch.full((N, 3), -1.0), ref_logps=None, scale=True, std_floor=0.0, kl_coef=0.0,
                kl_estimator="k3", all_reduce=None)
    return AdvantageInputs(rewards, **{**base, **kw})


def test_the_table_names_the_config_choices():
    assert tuple(ADVANTAGE_ESTIMATORS) == CHOICES["advantage_estimator"]


def test_each_estimator_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 2.0, 3.0]])  # two prompts, three samples each
    rloo = ADVANTAGE_ESTIMATORS["rloo"].function(inputs(rewards))
    assert rloo.tolist() == pytest.approx([1.0, -0.5, -0.5, -1.5, 0.0, 1.5])
    grpo = ADVANTAGE_ESTIMATORS["grpo"].function(inputs(rewards, scale=False))
    assert grpo.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1.0, 0.0, 1.0])
    scaled = ADVANTAGE_ESTIMATORS["grpo"].function(inputs(rewards))
    torch.testing.assert_close(scaled, L.grpo_advantages(rewards.reshape(-1), 3))
    # REINFORCE++ without a KL: the score on the last response token, reward-to-go over both,
    # whitened over the batch's 12 response tokens (each sample's score twice)
    rpp = ADVANTAGE_ESTIMATORS["reinforce_pp"].function(inputs(rewards))
    scores = rewards.reshape(-1)
    mean, std = scores.mean(), scores.std(unbiased=False)
    assert rpp[:, 0].tolist() == [0.0] * 6
    torch.testing.assert_close(rpp[:, 1], (scores - mean) / std)
    torch.testing.assert_close(rpp[:, 2], (scores - mean) / std)


def test_reinforce_pp_baseline_by_hand():
    """REINFORCE++-baseline: scores 1, 0, 0 and 1, 2, 3 lose their group means (1/3, 2) -> 2/3, -1/3,
    -1/3, -1, 0, 1; then REINFORCE++: each on its sample's two response tokens, whitened over the
    batch's 12 tokens (mean 0; population std sqrt((4/9 + 1/9 + 1/9 + 1 + 0 + 1) / 6) = 2/3)."""
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    adv = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"].function(inputs(rewards))
    centred = [2 / 3, -1 / 3, -1 / 3, -1.0, 0.0, 1.0]
    assert adv[:, 1].tolist() == pytest.approx([c / (2 / 3) for c in centred], rel=1e-5, abs=1e-6)
    assert adv[:, 2].tolist() == adv[:, 1].tolist() and adv[:, 0].tolist() == [0.0] * 6


def test_the_per_token_estimators_are_the_configs():
    from astrai.config_values import PER_TOKEN_ESTIMATORS

    rewards = torch.tensor([[1.0, 0.0]])
    per_token = [n for n, e in ADVANTAGE_ESTIMATORS.items() if e.function(inputs(rewards)).dim() == 2]
    assert tuple(per_token) == PER_TOKEN_ESTIMATORS


def test_facts_drive_the_group_size_check_and_the_warning():
    assert [n for n, e in ADVANTAGE_ESTIMATORS.items() if e.group_relative] == ["grpo", "rloo", "reinforce_pp_baseline"]
    assert [n for n, e in ADVANTAGE_ESTIMATORS.items() if e.kl_in_rewards] == ["reinforce_pp", "reinforce_pp_baseline"]
    with pytest.raises(ConfigError, match=r"advantage_estimator rloo needs group_size >= 2 .* set --group_size 2"):
        check_group_size(load_config(None, ["--advantage_estimator", "rloo", "--group_size", "1"]).rl)
    check_group_size(load_config(None, ["--advantage_estimator", "rloo", "--group_size", "2"]).rl)
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        cfg = load_config(None, ["--train_type", "online_grpo", "--advantage_estimator", name,
                                 "--group_size", str(estimator.min_group_size), "--rollout_temperature", "0"])
        assert (warn_if_no_signal(cfg, is_main=False) is not None) == estimator.group_relative, name


def test_kl_in_reward_leaves_each_score_before_the_baseline():
    """kl_in_reward: sample 1's two response tokens have KL (k1) 0.5 each, sample 2's 0; kl_coef 0.1
    turns scores 1, 0 into 0.9, 0; Dr. GRPO's centring then gives +-0.45 (not +-0.5). The kl metric
    is the mean over the four response tokens, 0.25. A k3+ reward uses k3's value."""
    ref = torch.tensor([[0.0, -1.5, -1.5], [0.0, -1.0, -1.0]])
    x = inputs(torch.tensor([[1.0, 0.0]]), ref_logps=ref, kl_coef=0.1, kl_estimator="k1", scale=False)
    penalised = with_kl_in_scores(x)
    assert penalised.rewards.tolist() == [pytest.approx([0.9, 0.0])]
    assert ADVANTAGE_ESTIMATORS["grpo"].function(penalised).tolist() == pytest.approx([0.45, -0.45])
    assert reward_kl(x) == pytest.approx(0.25)
    k3 = math.exp(-0.5) - 1 + 0.5
    k3_plus = with_kl_in_scores(AdvantageInputs(**{**x.__dict__, "kl_estimator": "k3+"}))
    assert k3_plus.rewards.tolist() == [pytest.approx([1 - 0.2 * k3, 0.0])]
    assert with_kl_in_scores(inputs(torch.tensor([[1.0, 0.0]]))).rewards.tolist() == [[1.0, 0.0]]  # no reference
    with pytest.raises(ConfigError, match="kl_in_reward=true applies to online_grpo"):
        load_config(None, ["--train_type", "online_dpo", "--kl_in_reward", "true"])


def test_turn_rewards_sit_on_their_turns_for_reinforce_pp():
    """turn_rewards: a two-turn row (turn 1 at label 0, tool gap 1-2, turn 2 at 3-4); the environment
    gave 0.5 after turn 1 (its last token's label position 0) and the final score 1 lands on 4. The
    reward-to-go is 1.5 on turn 1 and 1 on turn 2 (one sample: whitening makes them +-1)."""
    from astrai.train.rl.data import turn_reward_rows

    turns = turn_reward_rows([[(1, 0.5)]], torch.Size([1, 6]))  # the turn's last sampled token at row position 1
    assert turns.tolist() == [[0.5, 0, 0, 0, 0, 0]]
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    x = AdvantageInputs(torch.tensor([[1.0]]), mask, torch.zeros(1, 6), None, True, 0.0, 0.0, "k3+", None, turns)
    rewards = L.token_rewards(torch.tensor([1.0]), mask) + turns
    assert L.reward_to_go(rewards, mask).tolist() == [[1.5, 0, 0, 1.0, 1.0, 0]]
    adv = ADVANTAGE_ESTIMATORS["reinforce_pp"].function(x)
    assert adv[0, 0] > 0 > adv[0, 3] and adv[0, 3] == adv[0, 4]  # turn 1 earned more than turn 2
    with pytest.raises(ConfigError, match="turn_rewards=true places each environment step's reward"):
        load_config(None, ["--train_type", "online_grpo", "--turn_rewards", "true", "--environment", "m:E"])
