"""GRPO and its relatives (``grpo`` on recorded samples, ``online_grpo`` on rollouts of the live
policy): the clipped surrogate on advantages from scored samples, with an optional KL term.

The advantage estimator (``advantage_estimator``) is a pure function of ``train/losses.py``:
``grpo`` (group-relative, ``scale_rewards`` choosing Dr. GRPO's unscaled form), ``rloo``
(leave-one-out baseline) or ``reinforce_pp`` (REINFORCE++: the KL folded into per-token rewards,
reward-to-go, normalised over the whole batch of all ranks); ``advantages`` and ``prepare`` are
the one place that picks it. ``importance_sampling_level: sequence`` is GSPO: one ratio per
sample, the exponentiated mean of its tokens' log-ratios, clipped per sequence.
Batch keys: input_ids, attention_mask, labels (response tokens, -100 elsewhere), old_logps (the
sampler's, aligned with labels; NaN = the policy's own at the start of the step) and advantages
(one per sequence; offline records give rewards and group ids instead).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.train import dist
from astrai.train.losses import (
    IGNORE_INDEX,
    aggregate_token_loss,
    clipped_surrogate,
    grpo_advantages,
    kl_estimate,
    reward_to_go,
    rloo_advantages,
    sequence_log_ratio,
    token_rewards,
    whiten_with_sums,
)
from astrai.train.objectives.base import (
    Batch,
    LossOutput,
    RolloutObjective,
    frozen_reference,
    reference_logps,
)


class GRPOObjective(RolloutObjective):
    """GRPO: PPO clipping (per token, or per sequence for GSPO) on advantages from the group's
    rewards, optional KL to a reference (``kl_estimator``; in the rewards for REINFORCE++)."""

    def __init__(self, cfg: Config, model: nn.Module):
        rl = self.rl = cfg.rl
        super().__init__(rl)
        self.clip_eps, self.clip_eps_high = rl.clip_eps, rl.clip_eps_high
        self.temperature, self.kl_coef = rl.rollout_temperature, rl.kl_coef
        self.max_len = rl.rollout_max_tokens
        self.scale = rl.scale_rewards == "group"
        self.group_size, self.estimator = rl.group_size, rl.advantage_estimator
        self.device = next(model.parameters()).device
        self.sequence_ratio = rl.importance_sampling_level == "sequence"
        self.reference = frozen_reference(cfg.objective.ref_model_path, model) if rl.kl_coef > 0 else None
        # REINFORCE++ folds the KL into its per-token rewards: no KL term in the loss then
        self.kl_in_loss = self.reference is not None and self.estimator != "reinforce_pp"

    def advantages(self, rewards: Tensor) -> Tensor:
        """(B, G) rewards -> (B * G,) advantages, groups contiguous (grpo, rloo)."""
        if self.estimator == "rloo":
            return rloo_advantages(rewards.reshape(-1), rewards.size(-1))
        return grpo_advantages(rewards.reshape(-1), rewards.size(-1), scale=self.scale)

    def reinforce_pp_advantages(self, rollout: Any) -> Tensor:
        """REINFORCE++: per-token rewards (the score on the last response token, minus kl_coef times
        the KL estimate to the reference on every one), reward-to-go, whitened over every response
        token of the batch on all ranks. (N, T), 0 outside the response."""
        mask = rollout.labels != IGNORE_INDEX
        ref = reference_logps(self.reference, rollout, self.rl, self.device) if self.reference is not None else None
        rewards = token_rewards(rollout.rewards.reshape(-1), mask, rollout.old_logps, ref, self.kl_coef,
                                self.rl.kl_estimator)
        returns = reward_to_go(rewards, mask)
        return whiten_with_sums(returns, mask, dist.all_reduce_sum if dist.is_distributed() else None)

    def _group_advantages(self, batch: Batch) -> Tensor:
        """Offline records: advantages per record's group (groups may differ in size)."""
        rewards, groups = batch["rewards"], batch["group_ids"]
        advantages = torch.empty_like(rewards)
        for g in groups.unique():
            rows = (groups == g).nonzero().squeeze(1)
            advantages[rows] = grpo_advantages(rewards[rows], len(rows), scale=self.scale)
        return advantages

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        pol = self.logps(model, batch, entropy=self.wants("entropy"))
        logps, idx = pol.logps, pol.idx
        mask = self.loss_mask(batch, pol.mask)
        beh = self.behaviour(batch, logps, mask, idx)  # the ratio's old log-probs, importance weights
        advantages = batch["advantages"] if "advantages" in batch else self._group_advantages(batch)
        if advantages.dim() == 2 and idx is not None:
            advantages = advantages[:, idx]  # REINFORCE++: per-token advantages at the labelled positions
        if self.sequence_ratio:  # GSPO: one ratio per sample, exp(mean log-ratio), clipped per sequence
            seq = sequence_log_ratio(logps, beh.old, mask).expand_as(logps)
            loss, clipped = clipped_surrogate(seq, torch.zeros_like(seq), advantages, self.clip_eps, self.clip_eps_high)
        else:
            loss, clipped = clipped_surrogate(logps, beh.old, advantages, self.clip_eps, self.clip_eps_high)
        loss = loss * beh.weights  # the sampler-trainer mismatch correction (1 in fp32 on a fresh rollout)
        metrics: dict[str, Tensor] = {}
        if self.kl_in_loss:
            with torch.no_grad():
                ref_logps = self.logps(self.reference, batch).logps
            kl = kl_estimate(logps, ref_logps, self.rl.kl_estimator)  # (B, K)
            loss = loss + self.kl_coef * kl
            if self.wants("kl"):
                metrics["kl"] = self.per_unit(kl.detach(), mask)
        total, _ = aggregate_token_loss(loss, mask, self.agg, self.max_len)
        sampler = batch["old_logps"] if idx is None else batch["old_logps"][:, idx]
        sampler = torch.where(torch.isnan(sampler), logps.detach(), sampler)
        metrics.update(self.common_metrics(pol, mask, beh, clipped, sampler))
        return LossOutput(total, metrics, beh.pins)

    def prepare(self, rollout: Any) -> None:
        """Online: pin the rollout's advantages (computed once, reused by every step on it)."""
        if self.estimator == "reinforce_pp":
            rollout.pinned["advantages"] = self.reinforce_pp_advantages(rollout)
        else:
            rollout.pinned["advantages"] = self.advantages(rollout.rewards)
        self.prepare_truncation(rollout)
        self.prepare_behaviour(rollout)


class OnlineGRPOObjective(GRPOObjective):
    """GRPO on rollouts of the live policy: no old model is kept; the ratio's old log-probs are
    the trainer's own on the rollout's first step, and the sampler's enter only through the
    importance weights."""

    online = True
