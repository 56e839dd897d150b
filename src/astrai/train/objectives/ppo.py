"""PPO with a critic (``online_ppo``): per-token GAE advantages under the clipped surrogate, plus
the critic's ``ppo_vf_coef * (V - R)^2``; the KL to the reference is folded into per-token rewards.

The objective owns its critic: ``setup`` wraps it for DDP/FSDP like the policy and gives it its own
optimizer, schedule and gradient step (``CriticTraining``, the objective's one companion), so the
loop trains it without knowing its names. ``prepare`` pins values, rewards, advantages and returns
on a fresh rollout (critic forward without gradients); ``__call__`` returns policy + value loss
sums. Checkpoints carry the critic as ``value_model.pt`` and its optimizer and schedule as
``value_optimizer.pt`` (upstream names).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.model.lora import has_lora
from astrai.train import dist
from astrai.train.losses import (
    IGNORE_INDEX,
    aggregate_token_loss,
    explained_variance,
    gae,
    kl_estimate,
    masked_mean,
    masked_whiten,
    token_rewards,
    value_loss,
)
from astrai.train.objectives.base import Batch, Companion, LossOutput, computed, frozen_reference, wants
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


class CriticTraining:
    """The critic's side of a PPO run: its wrapped module, optimizer, schedule and gradient step.
    Its gradients come from the same backward as the policy's (the objective's loss includes the
    value loss); it steps after the policy, outside the policy version's publication."""

    name = "critic"

    def __init__(self, critic: nn.Module, run: Run, total_steps: int):
        cfg = run.config
        self.critic = critic
        self.module = run.wrap(critic)
        optim = dataclasses.replace(cfg.optim, max_lr=cfg.rl.critic_lr or cfg.optim.max_lr)
        self.optimizer, self.scheduler, self.grad_step = run.optimization(critic, optim, total_steps, name="critic")

    def add(self, out: LossOutput, units: Tensor | int) -> None:
        self.grad_step.add(out.metrics.get("value_loss", out.loss), units, 0)

    def step(self, number: int) -> dict[str, Any]:
        result = self.grad_step.step(number)
        return {"critic_lr": result["lr"], "critic_grad_norm": result["grad_norm"],
                "critic_skipped": result["skipped"]}

    def state_dict(self) -> dict[str, int]:
        return self.grad_step.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.grad_step.load_state_dict(state)

    def extra_state(self) -> dict[str, dict[str, Any]]:
        """value_model.pt (under LoRA only the trained adapters and head: the base is the policy's,
        already on disk) and value_optimizer.pt."""
        full = dist.is_fsdp(self.module)
        value_model = dist.full_model_state_dict(self.module) if full else self.critic.state_dict()
        trained = {n for n, p in self.critic.named_parameters() if p.requires_grad}
        if has_lora(self.critic):
            value_model = {k: v for k, v in value_model.items() if k in trained}
        return {"value_model": value_model,
                "value_optimizer": {"optimizer": dist.full_optimizer_state_dict(self.module, self.optimizer),
                                    "scheduler": self.scheduler.state_dict()}}

    def load_extra_state(self, states: dict[str, dict[str, Any]]) -> None:
        saved = states["value_model"]
        if has_lora(self.critic):  # adapters and head only; the base is the policy's
            saved = {**self.critic.state_dict(), **saved}
        dist.load_full_model_state_dict(self.module, saved)
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        dist.load_full_optimizer_state_dict(self.module, self.optimizer, states["value_optimizer"]["optimizer"])
        for group, values in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(values)  # the config's critic_lr and betas win, as for the policy
        self.scheduler.load_state_dict(states["value_optimizer"]["scheduler"])


class PPOObjective:
    """PPO with a critic, on rollouts of the live policy: per-token GAE advantages under the clipped
    surrogate, plus the critic's ``ppo_vf_coef * (V - R)^2``; the KL to the reference is folded
    into the per-token rewards. As online GRPO's, the ratio's old log-probs are the trainer's own
    on the rollout's first step, and the sampler's enter only through the importance weights."""

    requested_metrics: frozenset[str] | None = None
    layout = DEFAULT_LAYOUT  # how micro-batches go through the model (rollout_steps.py)

    def __init__(self, cfg: Config, model: nn.Module):
        from astrai.model.value import ValueModel

        rl = self.rl = cfg.rl
        self.agg = rl.rl_loss_agg
        self.reference = frozen_reference(cfg.objective.ref_model_path, model) if rl.kl_coef > 0 else None
        device = next(model.parameters()).device
        if rl.critic_model_path is not None:
            self.critic = ValueModel.from_pretrained(rl.critic_model_path, device)
        else:
            self.critic = ValueModel.from_policy(model)  # the policy's trunk, zero head: first values are 0
        self.critic.gradient_checkpointing = getattr(model, "gradient_checkpointing", False)
        self.critic_module: nn.Module = self.critic  # the wrapped critic once ``setup`` ran
        self.companions: tuple[Companion, ...] = ()  # the critic's training once ``setup`` ran

    def setup(self, run: Run, total_steps: int) -> None:
        training = CriticTraining(self.critic, run, total_steps)
        self.critic_module, self.companions = training.module, (training,)

    def num_units(self, batch: Batch) -> Tensor:
        return num_units(batch, self.agg)

    def logps(self, model: nn.Module, batch: Batch, entropy: bool = False, entropy_grad: bool = False) -> PolicyLogps:
        """``token_logps`` at the rollout's sampling, in this objective's layout."""
        return token_logps(model, batch, rollout_sampling(self.rl), entropy, self.layout, entropy_grad)

    @torch.no_grad()
    def prepare(self, rollout: Rollout) -> None:
        """Values (critic, no gradients), per-token rewards, GAE advantages and returns, pinned."""
        rl, device = self.rl, next(self.critic.parameters()).device
        mask = rollout.labels != IGNORE_INDEX  # (N, T): the positions that predict response tokens
        values = torch.zeros(mask.shape)
        for rows in torch.arange(rollout.num_samples).split(16):
            ids, att = rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device)
            values[rows] = self.critic(ids, attention_mask=att).float().cpu()
        sampling = rollout_sampling(rl)
        ref_logps = reference_logps(self.reference, rollout, sampling, device) if self.reference is not None else None
        values = values * mask
        if ref_logps is not None:  # the KL sits in the rewards: its mean estimate is the kl metric
            rollout.stats["kl"] = masked_mean(kl_estimate(rollout.old_logps.float(), ref_logps, rl.kl_estimator), mask).item()
        scores, turns = per_turn(rollout)
        rewards = token_rewards(scores.reshape(-1), mask, rollout.old_logps, ref_logps, rl.kl_coef, rl.kl_estimator)
        if turns is not None:
            rewards = rewards + turns
        advantages, returns = gae(rewards, values, mask, rl.ppo_gamma, rl.ppo_gae_lambda)
        if rl.whiten_advantages:
            advantages = masked_whiten(advantages, mask) * mask
        rollout.pinned.update({"advantages": advantages, "returns": returns, "old_values": values})
        pin_keep(rollout, rl.mask_truncated_completions)
        unknown_trainer_logps(rollout)
        rollout.stats.update({
            "explained_variance": explained_variance(values, returns, mask).item(),
            "value_mean": masked_mean(values, mask).item(), "return_mean": masked_mean(returns, mask).item(),
        })

    def batches(self, rollout: Rollout, num_micro: int, samples: Tensor | None = None) -> list[Batch]:
        return micro_batches(rollout, num_micro, self.layout, samples)

    def filler_batch(self, rollout: Rollout, batches: list[Batch]) -> Batch:
        """Every rank has samples: its last micro-batch again (the loop zeroes its loss)."""
        return batches[-1]

    def _check(self, batch: Batch, idx: Tensor | None, mask: Tensor) -> None:
        for key in ("old_logps", "advantages", "returns", "old_values"):
            value = batch[key]
            if value.shape != batch["labels"].shape:
                raise ValueError(f"PPO batch field {key!r} has shape {tuple(value.shape)}; expected "
                                 f"{tuple(batch['labels'].shape)}, the shape of labels")
            if not bool(torch.isfinite(at_labels(batch, key, idx)[mask]).all()):
                raise ValueError(f"PPO batch field {key!r} holds NaN or inf on response tokens; it must be finite")

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        rl, requested = self.rl, self.requested_metrics
        bonus = rl.entropy_coef > 0  # the entropy bonus needs the entropy with its gradient
        grad = {"entropy_grad": True} if bonus else {}  # (only then: a replaced logps may not take it)
        pol = self.logps(model, batch, entropy=bonus or wants(requested, "entropy"), **grad)
        logps, idx, rows = pol.logps, pol.idx, pol.rows
        mask = loss_mask(batch, pol.mask)

        def at(key: str) -> Tensor:  # a pinned (B, T) tensor at the labelled positions (B, K)
            return at_labels(batch, key, idx)

        self._check(batch, idx, mask)
        # the ratio's old log-probs and the importance weights
        beh = behaviour(batch, logps, mask, idx, True, rl)
        policy, clipped = policy_surrogate(rl, logps, beh.old, at("advantages"))
        policy = policy * beh.weights
        if bonus:
            policy = policy - rl.entropy_coef * pol.entropy
        values = self.critic_module(**rows.inputs(batch["input_ids"], batch["attention_mask"]))  # (R, W), as the policy ran
        values = rows.scatter(values[rows.dst], idx)  # (B, K)
        vloss, vclipped = value_loss(values, at("old_values"), at("returns"), rl.value_clip, coef=1.0)
        policy_sum, _ = aggregate_token_loss(policy, mask, self.agg, rl.rollout_max_tokens)
        value_sum, _ = aggregate_token_loss(vloss, mask, self.agg, rl.rollout_max_tokens)
        metrics = computed({
            "policy_loss": lambda: policy_sum.detach(),
            "value_loss": lambda: value_sum.detach(),
            "value_clip_fraction": lambda: per_unit(vclipped.float(), mask, self.agg),
        }, requested)
        metrics.update(common_metrics(pol, mask, beh, clipped, at("old_logps"), self.agg, requested))
        return LossOutput(policy_sum + rl.ppo_vf_coef * value_sum, metrics, beh.pins)
