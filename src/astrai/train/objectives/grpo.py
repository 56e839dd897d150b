"""GRPO and its relatives (``grpo`` on recorded samples, ``online_grpo`` on rollouts of the live
policy, the same class with ``online=True``): the clipped surrogate on advantages from scored
samples, with an optional KL term.

The advantage estimator (``advantage_estimator``) is an entry of ``train/advantages.py``'s table:
``grpo`` (group-relative, ``scale_rewards`` choosing Dr. GRPO's unscaled form), ``rloo``
(leave-one-out baseline) or ``reinforce_pp`` (REINFORCE++: the KL folded into per-token rewards,
reward-to-go, normalised over the whole batch of all ranks); ``prepare`` calls its function and
reads from the table whether the KL is in the rewards. ``importance_sampling_level: sequence`` is
GSPO: one ratio per sample, the exponentiated mean of its tokens' log-ratios, clipped per
sequence. Batch keys: input_ids, attention_mask, labels (response tokens, -100 elsewhere),
old_logps (the sampler's, aligned with labels; NaN = the policy's own at the start of the step)
and advantages (one per sequence, or per token for reinforce_pp; offline records give rewards and
group ids instead). Shared steps: ``logps.py`` and ``rollout_steps.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.train import dist
from astrai.train.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, reward_kl, with_kl_in_scores
from astrai.train.losses import (
    IGNORE_INDEX,
    aggregate_token_loss,
    clipped_surrogate,
    grpo_advantages,
    kl_estimate,
    sequence_log_ratio,
    sequence_token_log_ratio,
)
from astrai.train.objectives.base import Batch, Companion, LossOutput, frozen_reference, wants
from astrai.train.objectives.logps import (
    PolicyLogps,
    at_labels,
    behaviour,
    reference_logps,
    token_logps,
    unknown_trainer_logps,
)
from astrai.train.objectives.rollout_steps import (
    DEFAULT_LAYOUT,
    common_metrics,
    loss_mask,
    micro_batches,
    num_units,
    per_turn,
    per_unit,
    pin_keep,
    policy_surrogate,
)
from astrai.train.rl.sampler import rollout_sampling

if TYPE_CHECKING:
    from astrai.train.build import Run
    from astrai.train.rl.data import Rollout


class GRPOObjective:
    """GRPO: PPO clipping (per token, or per sequence for GSPO) on advantages from the group's
    rewards, optional KL to a reference (``kl_estimator``; in the rewards for REINFORCE++).
    ``online``: the samples are rollouts of the live policy, so no old model is kept: the ratio's
    old log-probs are the trainer's own on the rollout's first step, and the sampler's enter only
    through the importance weights. Offline, the records' log-probs are the old ones (weights 1)."""

    requested_metrics: frozenset[str] | None = None
    companions: tuple[Companion, ...] = ()
    layout = DEFAULT_LAYOUT  # how micro-batches go through the model (rollout_steps.py)

    def __init__(self, cfg: Config, model: nn.Module, online: bool = False):
        rl = self.rl = cfg.rl
        self.online = online
        self.level = rl.importance_sampling_level
        # GSPO's loss is one value per sample: averaged per sequence, as the paper, verl and TRL do
        # (token_mean would weigh a sample by its length)
        self.agg = rl.rl_loss_agg if self.level == "token" else "seq_mean"
        self.max_len = rl.rollout_max_tokens
        self.clip_eps, self.clip_eps_high, self.kl_coef = rl.clip_eps, rl.clip_eps_high, rl.kl_coef
        self.scale = rl.scale_rewards == "group"
        self.estimator = ADVANTAGE_ESTIMATORS[rl.advantage_estimator]
        self.device = next(model.parameters()).device
        self.reference = frozen_reference(cfg.objective.ref_model_path, model) if rl.kl_coef > 0 else None
        # REINFORCE++ folds the KL into its per-token rewards, kl_in_reward into each sample's score:
        # no KL term in the loss then
        self.kl_in_reward = self.estimator.kl_in_rewards or rl.kl_in_reward
        self.kl_in_loss = self.reference is not None and not self.kl_in_reward

    def setup(self, run: Run, total_steps: int) -> None:
        """Nothing is trained beside the policy."""

    def num_units(self, batch: Batch) -> Tensor:
        return num_units(batch, self.agg)

    def logps(self, model: nn.Module, batch: Batch, entropy: bool = False, entropy_grad: bool = False) -> PolicyLogps:
        """``token_logps`` at the rollout's sampling, in this objective's layout."""
        return token_logps(model, batch, rollout_sampling(self.rl), entropy, self.layout, entropy_grad)

    def _group_advantages(self, batch: Batch) -> Tensor:
        """Offline records: advantages per record's group (groups may differ in size)."""
        rewards, groups = batch["rewards"], batch["group_ids"]
        advantages = torch.empty_like(rewards)
        for g in groups.unique():
            rows = (groups == g).nonzero().squeeze(1)
            advantages[rows] = grpo_advantages(rewards[rows], len(rows), scale=self.scale,
                                              std_floor=self.rl.reward_std_floor)
        return advantages

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        bonus = self.rl.entropy_coef > 0  # the entropy bonus needs the entropy with its gradient
        grad = {"entropy_grad": True} if bonus else {}  # (only then: a replaced logps may not take it)
        pol = self.logps(model, batch, entropy=bonus or wants(self.requested_metrics, "entropy"), **grad)
        logps, idx = pol.logps, pol.idx
        mask = loss_mask(batch, pol.mask)
        # the ratio's old log-probs and the importance weights
        beh = behaviour(batch, logps, mask, idx, self.online, self.rl)
        advantages = batch["advantages"] if "advantages" in batch else self._group_advantages(batch)
        if advantages.dim() == 2 and idx is not None:
            advantages = advantages[:, idx]  # REINFORCE++: per-token advantages at the labelled positions
        if self.level != "token":  # GSPO: one ratio per sample, exp(mean log-ratio), clipped per sequence
            if self.level == "sequence":
                seq = sequence_log_ratio(logps, beh.old, mask).expand_as(logps)
            else:  # GSPO-token: the same value per token, each token's gradient its own
                seq = sequence_token_log_ratio(logps, beh.old, mask)
            loss, clipped = clipped_surrogate(seq, torch.zeros_like(seq), advantages, self.clip_eps,
                                              self.clip_eps_high, self.rl.clip_ratio_c)
        else:
            loss, clipped = policy_surrogate(self.rl, logps, beh.old, advantages)
        loss = loss * beh.weights  # the sampler-trainer mismatch correction (1 in fp32 on a fresh rollout)
        if bonus:
            loss = loss - self.rl.entropy_coef * pol.entropy
        metrics: dict[str, Tensor] = {}
        if self.kl_in_loss:
            with torch.no_grad():
                # the reference routes on its own: the sampler's experts are the policy's (routing_replay)
                ref_batch = {k: v for k, v in batch.items() if k != "routing"}
                ref_logps = self.logps(self.reference, ref_batch).logps
            kl = kl_estimate(logps, ref_logps, self.rl.kl_estimator)  # (B, K)
            loss = loss + self.kl_coef * kl
            if wants(self.requested_metrics, "kl"):
                metrics["kl"] = per_unit(kl.detach(), mask, self.agg)
        total, _ = aggregate_token_loss(loss, mask, self.agg, self.max_len)
        recorded = at_labels(batch, "old_logps", idx)
        sampler = torch.where(torch.isnan(recorded), logps.detach(), recorded)
        metrics.update(common_metrics(pol, mask, beh, clipped, sampler, self.agg, self.requested_metrics))
        return LossOutput(total, metrics, beh.pins)

    def prepare(self, rollout: Rollout) -> None:
        """Online: pin the rollout's advantages (computed once, reused by every step on it)."""
        mask = rollout.labels != IGNORE_INDEX
        with_ref = self.kl_in_reward and self.reference is not None
        ref = reference_logps(self.reference, rollout, rollout_sampling(self.rl), self.device) if with_ref else None
        scores, turns = per_turn(rollout)
        inputs = AdvantageInputs(scores, mask, rollout.old_logps, ref, self.scale, self.rl.reward_std_floor,
                                 self.kl_coef, self.rl.kl_estimator,
                                 dist.all_reduce_sum if dist.is_distributed() else None, turns)
        if with_ref:
            rollout.stats["kl"] = reward_kl(inputs)
            if not self.estimator.kl_in_rewards:  # kl_in_reward: the KL leaves each score before the baseline
                inputs = with_kl_in_scores(inputs)
        rollout.pinned["advantages"] = self.estimator.function(inputs)
        pin_keep(rollout, self.rl.mask_truncated_completions)
        unknown_trainer_logps(rollout)

    def batches(self, rollout: Rollout, num_micro: int, samples: Tensor | None = None) -> list[Batch]:
        return micro_batches(rollout, num_micro, self.layout, samples)

    def filler_batch(self, rollout: Rollout, batches: list[Batch]) -> Batch:
        """Every rank has samples: its last micro-batch again (the loop zeroes its loss)."""
        return batches[-1]
