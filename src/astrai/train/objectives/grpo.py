"""GRPO (``grpo`` on recorded samples, ``online_grpo`` on rollouts of the live policy): the token-
level clipped surrogate on group-relative advantages, with an optional KL term to a reference.

An advantage estimator is a pure function of the rewards in ``train/losses.py`` (``grpo_advantages``
today, with ``scale_rewards`` choosing Dr. GRPO's unscaled form); ``advantages`` is the one place
that picks it, so further estimators are a function there and a line here, not a new class.
Batch keys: input_ids, attention_mask, labels (response tokens, -100 elsewhere), old_logps (the
sampler's, aligned with labels; NaN = the policy's own at the start of the step) and advantages
(one per sequence; offline records give rewards and group ids instead).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.train.losses import aggregate_token_loss, clipped_surrogate, grpo_advantages, kl_estimate
from astrai.train.objectives.base import Batch, LossOutput, RolloutObjective, frozen_reference, token_logps


class GRPOObjective(RolloutObjective):
    """GRPO: token-level PPO clipping on group-relative advantages, optional k3 KL to a reference."""

    def __init__(self, cfg: Config, model: nn.Module):
        rl = self.rl = cfg.rl
        super().__init__(rl)
        self.clip_eps, self.clip_eps_high = rl.clip_eps, rl.clip_eps_high
        self.temperature, self.kl_coef = rl.rollout_temperature, rl.kl_coef
        self.max_len = rl.rollout_max_tokens
        self.scale = rl.scale_rewards == "group"
        self.group_size = rl.group_size
        self.reference = frozen_reference(cfg.objective.ref_model_path, model) if rl.kl_coef > 0 else None

    def advantages(self, rewards: Tensor) -> Tensor:
        """(B, G) rewards -> (B * G,) advantages, groups contiguous."""
        return grpo_advantages(rewards.reshape(-1), rewards.size(-1), scale=self.scale)

    def _group_advantages(self, batch: Batch) -> Tensor:
        """Offline records: advantages per record's group (groups may differ in size)."""
        rewards, groups = batch["rewards"], batch["group_ids"]
        advantages = torch.empty_like(rewards)
        for g in groups.unique():
            rows = (groups == g).nonzero().squeeze(1)
            advantages[rows] = grpo_advantages(rewards[rows], len(rows), scale=self.scale)
        return advantages

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        logps, mask, (out, idx) = token_logps(model, batch, self.rl)
        beh = self.behaviour(batch, logps, mask, idx)  # the ratio's old log-probs, importance weights
        advantages = batch["advantages"] if "advantages" in batch else self._group_advantages(batch)
        loss, clipped = clipped_surrogate(logps, beh.old, advantages, self.clip_eps, self.clip_eps_high)
        loss = loss * beh.weights  # the sampler-trainer mismatch correction (1 in fp32 on a fresh rollout)
        metrics: dict[str, Tensor] = {}
        if self.reference is not None:
            with torch.no_grad():
                ref_logps, _, _ = token_logps(self.reference, batch, self.rl)
            kl = kl_estimate(logps, ref_logps, "k3")  # (B, K), >= 0
            loss = loss + self.kl_coef * kl
            if self.wants("kl"):
                metrics["kl"] = self.per_unit(kl.detach(), mask)
        total, _ = aggregate_token_loss(loss, mask, self.agg, self.max_len)
        sampler = batch["old_logps"] if idx is None else batch["old_logps"][:, idx]
        sampler = torch.where(torch.isnan(sampler), logps.detach(), sampler)
        metrics.update(self.common_metrics(logps, out, mask, beh, clipped, sampler, self.temperature))
        return LossOutput(total, metrics, beh.pins)

    def prepare(self, rollout: Any) -> None:
        """Online: pin the rollout's advantages (computed once, reused by every step on it)."""
        rollout.pinned["advantages"] = self.advantages(rollout.rewards)
        self.prepare_behaviour(rollout)


class OnlineGRPOObjective(GRPOObjective):
    """GRPO on rollouts of the live policy: no old model is kept; the ratio's old log-probs are
    the trainer's own on the rollout's first step, and the sampler's enter only through the
    importance weights."""

    online = True
