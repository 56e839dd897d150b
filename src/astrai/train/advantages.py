"""The advantage estimators of the rollout objectives: one table, name -> what the estimator is.

``ADVANTAGE_ESTIMATORS`` maps each ``advantage_estimator`` to its function (a rollout's scores in,
advantages out, the arithmetic being ``train/losses.py``'s), whether it is group-relative (it
compares a prompt's samples with each other, so a group of identical samples teaches nothing),
the smallest ``group_size`` it accepts, and whether the KL to the reference is folded into its
per-token rewards (then the objective adds no KL term to the loss). The GRPO objective
(``objectives/grpo.py``) calls the function, the run builder (``train/build.py``) warns from
``group_relative``, and ``check_group_size`` refuses a group too small before the model exists.
The names are also the config's ``CHOICES["advantage_estimator"]`` (``astrai/config_values.py``:
the config imports nothing of ``train``), checked against this table by the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from astrai.config import RLConfig
from astrai.config_values import ConfigError
from astrai.train.losses import (
    grpo_advantages,
    kl_estimate,
    masked_mean,
    reward_to_go,
    rloo_advantages,
    token_rewards,
    whiten_with_sums,
)


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read: one rollout's scores and, for per-token estimators, its tokens."""

    rewards: Tensor  # (B, G) one score per sample, a prompt's G samples in a row
    mask: Tensor  # (N, T) bool, N = B * G: the response tokens (positions with a label)
    behaviour_logps: Tensor  # (N, T) the sampler's log-probs of those tokens (0 elsewhere)
    ref_logps: Tensor | None  # (N, T) the reference's, when the estimator folds the KL in and there is one
    scale: bool  # scale_rewards "group": divide by the group's std (grpo)
    std_floor: float  # reward_std_floor: the least std the scaling divides by
    kl_coef: float
    kl_estimator: str
    all_reduce: Callable[[Tensor], Tensor] | None  # sums a tensor over the ranks (None: one rank)
    # (N, T) turn_rewards: the environment's per-turn rewards at their turns' last tokens (then
    # `rewards` holds the scores without them); None: they are in `rewards`
    turn_rewards: Tensor | None = None


def grpo(x: AdvantageInputs) -> Tensor:
    """(N,) the group-relative advantage: reward minus the group's mean, over its std when scaled."""
    return grpo_advantages(x.rewards.reshape(-1), x.rewards.size(-1), scale=x.scale, std_floor=x.std_floor)


def rloo(x: AdvantageInputs) -> Tensor:
    """(N,) the leave-one-out advantage: reward minus the mean of the group's other rewards."""
    return rloo_advantages(x.rewards.reshape(-1), x.rewards.size(-1))


def reinforce_pp(x: AdvantageInputs) -> Tensor:
    """(N, T) REINFORCE++: per-token rewards (the score on the last response token, minus kl_coef
    times the KL estimate to the reference on every one), reward-to-go, whitened over every
    response token of the batch on all ranks; 0 outside the response."""
    rewards = token_rewards(x.rewards.reshape(-1), x.mask, x.behaviour_logps, x.ref_logps, x.kl_coef, x.kl_estimator)
    if x.turn_rewards is not None:
        rewards = rewards + x.turn_rewards
    return whiten_with_sums(reward_to_go(rewards, x.mask), x.mask, x.all_reduce)


def reinforce_pp_baseline(x: AdvantageInputs) -> Tensor:
    """(N, T) REINFORCE++-baseline (OpenRLHF's reinforce_baseline): each score minus its group's
    mean, then REINFORCE++ (KL per token, reward-to-go, whitened over the batch of all ranks)."""
    centred = x.rewards - x.rewards.float().mean(dim=-1, keepdim=True)  # (B, G)
    return reinforce_pp(dataclasses.replace(x, rewards=centred))


def with_kl_in_scores(x: AdvantageInputs) -> AdvantageInputs:
    """``kl_in_reward`` for a per-sample estimator: each sample's score becomes score - kl_coef *
    the sum over its response tokens of the KL estimate to the reference (verl's use_kl_in_reward,
    the per-token rewards of ``token_rewards`` summed), before the group baseline is taken."""
    if x.ref_logps is None:
        return x
    per_token = token_rewards(x.rewards.reshape(-1), x.mask, x.behaviour_logps, x.ref_logps, x.kl_coef,
                              x.kl_estimator)  # (N, T)
    return dataclasses.replace(x, rewards=per_token.sum(dim=-1).reshape(x.rewards.shape))


def reward_kl(x: AdvantageInputs) -> float:
    """The ``kl`` metric when the KL sits in the rewards: the mean estimate over the response tokens
    (the sampler's log-probs against the reference's); 0 without a reference."""
    if x.ref_logps is None:
        return 0.0
    return masked_mean(kl_estimate(x.behaviour_logps.float(), x.ref_logps.float(), x.kl_estimator), x.mask).item()


@dataclass(frozen=True)
class AdvantageEstimator:
    function: Callable[[AdvantageInputs], Tensor]  # (N,) per sample or (N, T) per token
    group_relative: bool  # compares a prompt's samples: every advantage is 0 when they are alike
    min_group_size: int
    why_min_group: str  # why it needs that many samples per prompt (the error says it)
    kl_in_rewards: bool = False  # the KL to the reference is in its per-token rewards, not the loss


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(grpo, group_relative=True, min_group_size=1, why_min_group="one sample"),
    "rloo": AdvantageEstimator(rloo, group_relative=True, min_group_size=2,
                               why_min_group="a baseline of the other samples"),
    "reinforce_pp": AdvantageEstimator(reinforce_pp, group_relative=False, min_group_size=1,
                                       why_min_group="one sample", kl_in_rewards=True),
    "reinforce_pp_baseline": AdvantageEstimator(reinforce_pp_baseline, group_relative=True, min_group_size=2,
                                                why_min_group="a group mean to remove", kl_in_rewards=True),
}


def check_group_size(rl: RLConfig | Any) -> None:
    """Before anything is built: ``group_size`` must give the estimator the samples it compares."""
    need = ADVANTAGE_ESTIMATORS[rl.advantage_estimator]
    if rl.group_size < need.min_group_size:
        raise ConfigError(f"advantage_estimator {rl.advantage_estimator} needs group_size >= {need.min_group_size} "
                          f"({need.why_min_group}), got {rl.group_size}; set --group_size {need.min_group_size} "
                          "or more")


def learns_from_group_differences(train_type: str, rl: RLConfig | Any) -> bool:
    """Whether a run's only learning signal is the difference between a prompt's samples: online
    DPO's pairs, or a group-relative estimator of online GRPO (a group whose samples all score alike
    then teaches nothing)."""
    return train_type == "online_dpo" or (
        train_type == "online_grpo" and ADVANTAGE_ESTIMATORS[rl.advantage_estimator].group_relative)
