"""RL objectives: GRPO (offline and online), online DPO and online PPO: scored samples -> LossOutput.

Sits where the offline objectives sit, between a loop and ``train/losses.py``, which holds every
formula (group advantages, the clipped surrogate, the k3 KL estimator, loss aggregation, the DPO
loss). An online objective first ``prepare``s a fresh rollout once (advantages pinned on it, so
steps that reuse the rollout optimise fixed targets), then ``batches`` splits it into
micro-batches, and ``__call__`` returns loss and metric *sums* over the batch's loss units, like
every objective; the gradient-step window normalises them.

GRPO batch keys: input_ids, attention_mask, labels (response tokens, -100 elsewhere), old_logps
(the sampler's, aligned with labels; NaN = use the policy's own at the start of the step) and
advantages (one per sequence). PPO pins per-token advantages, returns and the critic's rollout-
time values; its critic (``critic``) is trained by the loop's second gradient step.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.model.logprobs import selective_log_softmax
from astrai.train.losses import (
    IGNORE_INDEX,
    aggregate_token_loss,
    clipped_surrogate,
    explained_variance,
    gae,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    masked_whiten,
    token_rewards,
    value_loss,
)
from astrai.train.objectives import DPOObjective, LossOutput, Objective, labelled_positions

Batch = dict[str, Any]


def frozen_reference(cfg: Config, model: nn.Module) -> Any:
    """The KL reference: ref_model_path, else the initial policy: under LoRA the policy's own module
    with its adapters disabled (no copy of the weights), otherwise a frozen copy."""
    from astrai.model.lora import AdapterDisabled, has_lora

    if cfg.objective.ref_model_path is None and has_lora(model):
        return AdapterDisabled(model)
    if cfg.objective.ref_model_path is None:
        ref = copy.deepcopy(model)
    else:
        from astrai.model.hf import load_model

        ref = load_model(cfg.objective.ref_model_path, device=next(model.parameters()).device)
    return ref.eval().requires_grad_(False)


def token_logps(model: nn.Module, batch: Batch, temperature: float) -> tuple[Tensor, Tensor, Any]:
    """(log-probs (B, K), loss mask (B, K), model output) of the labelled tokens, under `temperature`
    (the rollout's: the sampler drew from logits / temperature)."""
    labels = batch["labels"]
    idx = labelled_positions(labels)
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], logits_indices=idx)  # (B, K, V)
    if idx is not None:
        labels = labels[:, idx]  # (B, K)
    mask = labels != IGNORE_INDEX
    logits = out.logits.float() / temperature if temperature > 0 else out.logits.float()
    logps = selective_log_softmax(logits, torch.where(mask, labels, torch.zeros_like(labels)))  # (B, K)
    return logps, mask, (out, idx)


class GRPOObjective(Objective):
    """GRPO: token-level PPO clipping on group-relative advantages, optional k3 KL to a reference."""

    record_kind = "rollout"
    online = False

    def __init__(self, cfg: Config, model: nn.Module):
        rl = cfg.rl
        self.clip_eps, self.clip_eps_high = rl.clip_eps, rl.clip_eps_high
        self.temperature, self.kl_coef = rl.rollout_temperature, rl.kl_coef
        self.agg, self.max_len = rl.rl_loss_agg, rl.rollout_max_tokens
        self.scale = rl.scale_rewards == "group"
        self.group_size = rl.group_size
        self.reference = frozen_reference(cfg, model) if rl.kl_coef > 0 else None

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

    def num_units(self, batch: Batch) -> Tensor:
        if self.agg == "token_mean":
            return (batch["labels"] != IGNORE_INDEX).sum()
        return torch.tensor(batch["labels"].size(0), device=batch["labels"].device)

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        logps, mask, (_, idx) = token_logps(model, batch, self.temperature)
        old = batch["old_logps"] if idx is None else batch["old_logps"][:, idx]  # (B, K)
        old = torch.where(torch.isnan(old), logps.detach(), old)  # no behaviour log-probs: the policy's own
        advantages = batch["advantages"] if "advantages" in batch else self._group_advantages(batch)
        loss, clipped = clipped_surrogate(logps, old, advantages, self.clip_eps, self.clip_eps_high)
        metrics: dict[str, Tensor] = {}
        if self.reference is not None:
            with torch.no_grad():
                ref_logps, _, _ = token_logps(self.reference, batch, self.temperature)
            kl = kl_estimate(logps, ref_logps, "k3")  # (B, K), >= 0
            loss = loss + self.kl_coef * kl
            if self.wants("kl"):
                metrics["kl"] = self._metric(kl.detach(), mask)
        total, _ = aggregate_token_loss(loss, mask, self.agg, self.max_len)
        diff = (logps.detach() - old)
        candidates = {
            "clip_fraction": lambda: clipped.float(),
            "approx_kl": lambda: 0.5 * diff**2,  # between the current and the behaviour policy
            "sampler_logp_diff": lambda: diff.abs(),  # |trainer - sampler| log-prob; ~0 on a fresh rollout
        }
        metrics.update({k: self._metric(f(), mask) for k, f in candidates.items() if self.wants(k)})
        return LossOutput(total, metrics)

    def _metric(self, per_token: Tensor, mask: Tensor) -> Tensor:
        # summed over this objective's loss units, so the window mean is per token or per sequence
        agg = "token_mean" if self.agg == "token_mean" else "seq_mean"
        return aggregate_token_loss(per_token, mask, agg)[0]

    # ---------------------------------------------------------------- online use of a rollout

    def prepare(self, rollout: Any) -> None:
        """Pin the rollout's advantages (computed once, reused by every step on it)."""
        rollout.pinned["advantages"] = self.advantages(rollout.rewards)

    def batches(self, rollout: Any, num_micro: int) -> list[Batch]:
        chunks = torch.arange(rollout.num_samples).tensor_split(min(num_micro, rollout.num_samples))
        return [rollout.rows(idx) for idx in chunks if len(idx)]


class OnlineGRPOObjective(GRPOObjective):
    """GRPO on rollouts of the live policy: logp_old is the sampler's, no old model is kept."""

    record_kind = "prompt"
    online = True


class OnlineDPOObjective(Objective):
    """Online DPO: per prompt, the best and the worst sample by reward become chosen / rejected."""

    record_kind = "prompt"
    online = True

    def __init__(self, cfg: Config, model: nn.Module):
        if cfg.rl.group_size < 2:
            raise ValueError(f"online_dpo needs group_size >= 2 (a best and a worst sample), got "
                             f"{cfg.rl.group_size}; set --group_size 2 or more")
        self.dpo = DPOObjective(cfg, model)
        self.num_skipped_groups = 0

    @property
    def requested_metrics(self) -> frozenset[str] | None:  # type: ignore[override]
        return self.dpo.requested_metrics

    @requested_metrics.setter
    def requested_metrics(self, value: frozenset[str] | None) -> None:
        self.dpo.requested_metrics = value

    def prepare(self, rollout: Any) -> None:
        """Pin (chosen, rejected) sample indices; groups whose rewards are all equal are skipped."""
        best, worst = rollout.rewards.argmax(dim=1), rollout.rewards.argmin(dim=1)  # (B,)
        distinct = rollout.rewards.max(dim=1).values > rollout.rewards.min(dim=1).values
        base = torch.arange(rollout.rewards.size(0)) * rollout.group_size
        rollout.pairs = torch.stack([base + best, base + worst], dim=1)[distinct]  # (P, 2)
        rollout.stats["skipped_groups"] = float((~distinct).sum())

    def batches(self, rollout: Any, num_micro: int) -> list[Batch]:
        pairs = rollout.pairs
        out = []
        for chunk in pairs.tensor_split(min(num_micro, max(len(pairs), 1))):
            if len(chunk) == 0:
                continue
            batch: Batch = {}
            for side, col in (("chosen", 0), ("rejected", 1)):
                rows = rollout.rows(chunk[:, col])
                T = rows["input_ids"].size(1)
                batch[f"{side}_input_ids"] = rows["input_ids"]
                batch[f"{side}_labels"] = rows["labels"]  # the prompt carries no label: masked out
                batch[f"{side}_attention_mask"] = rows["attention_mask"]
                batch[f"{side}_position_ids"] = torch.arange(T).expand(len(chunk), T)
            out.append(batch)
        return out

    def filler_batch(self, rollout: Any) -> Batch:
        """A batch for a rank without pairs under DDP: its loss is multiplied by 0 by the loop."""
        pairs, rollout.pairs = rollout.pairs, torch.zeros(1, 2, dtype=torch.long)
        try:
            return self.batches(rollout, 1)[0]
        finally:
            rollout.pairs = pairs

    def num_units(self, batch: Batch) -> Tensor:
        return self.dpo.num_units(batch)

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        return self.dpo(model, batch)


class OnlinePPOObjective(Objective):
    """PPO with a critic: per-token GAE advantages under the clipped surrogate, plus the critic's
    ``ppo_vf_coef * (V - R)^2``; the KL to the reference is folded into the per-token rewards."""

    record_kind = "prompt"
    online = True

    def __init__(self, cfg: Config, model: nn.Module):
        from astrai.model.value import ValueModel

        rl = cfg.rl
        self.rl, self.temperature = rl, rl.rollout_temperature
        self.reference = frozen_reference(cfg, model) if rl.kl_coef > 0 else None
        device = next(model.parameters()).device
        if rl.critic_model_path is not None:
            self.critic = ValueModel.from_pretrained(rl.critic_model_path, device)
        else:
            self.critic = ValueModel.from_policy(model)  # the policy's trunk, zero head: first values are 0
        self.critic.gradient_checkpointing = getattr(model, "gradient_checkpointing", False)
        self.critic_module: nn.Module = self.critic  # the loop swaps in the DDP/FSDP-wrapped critic

    def num_units(self, batch: Batch) -> Tensor:
        if self.rl.rl_loss_agg == "token_mean":
            return (batch["labels"] != IGNORE_INDEX).sum()
        return torch.tensor(batch["labels"].size(0), device=batch["labels"].device)

    @torch.no_grad()
    def prepare(self, rollout: Any) -> None:
        """Values (critic, no gradients), per-token rewards, GAE advantages and returns, pinned."""
        rl, device = self.rl, next(self.critic.parameters()).device
        mask = rollout.labels != IGNORE_INDEX  # (N, T): the positions that predict response tokens
        values, ref_logps = torch.zeros(mask.shape), None
        if self.reference is not None:
            ref_logps = torch.zeros(mask.shape)
        for rows in torch.arange(rollout.num_samples).split(16):
            ids, att = rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device)
            values[rows] = self.critic(ids, attention_mask=att).float().cpu()
            if self.reference is not None:
                batch = {"input_ids": ids, "attention_mask": att, "labels": rollout.labels[rows].to(device)}
                lp, _, (_, idx) = token_logps(self.reference, batch, self.temperature)
                full = torch.zeros(len(rows), mask.size(1))
                full[:, idx if idx is not None else slice(None)] = lp.cpu()
                ref_logps[rows] = full
        values = values * mask
        rewards = token_rewards(rollout.rewards.reshape(-1), mask, rollout.old_logps, ref_logps, rl.kl_coef)
        advantages, returns = gae(rewards, values, mask, rl.ppo_gamma, rl.ppo_gae_lambda)
        if rl.whiten_advantages:
            advantages = masked_whiten(advantages, mask) * mask
        rollout.pinned.update({"advantages": advantages, "returns": returns, "old_values": values})
        rollout.stats.update({
            "explained_variance": explained_variance(values, returns, mask).item(),
            "value_mean": masked_mean(values, mask).item(), "return_mean": masked_mean(returns, mask).item(),
        })

    def batches(self, rollout: Any, num_micro: int) -> list[Batch]:
        chunks = torch.arange(rollout.num_samples).tensor_split(min(num_micro, rollout.num_samples))
        return [rollout.rows(idx) for idx in chunks if len(idx)]

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        rl = self.rl
        logps, mask, (_, idx) = token_logps(model, batch, self.temperature)

        def at(key: str) -> Tensor:  # a pinned (B, T) tensor at the labelled positions (B, K)
            return batch[key] if idx is None else batch[key][:, idx]

        for key in ("old_logps", "advantages", "returns", "old_values"):
            value = batch[key]
            if value.shape != batch["labels"].shape:
                raise ValueError(f"PPO batch field {key!r} has shape {tuple(value.shape)}; expected "
                                 f"{tuple(batch['labels'].shape)}, the shape of labels")
            if not bool(torch.isfinite(at(key)[mask]).all()):
                raise ValueError(f"PPO batch field {key!r} holds NaN or inf on response tokens; it must be finite")
        old = at("old_logps")
        policy, clipped = clipped_surrogate(logps, old, at("advantages"), rl.clip_eps, rl.clip_eps_high)
        values = self.critic_module(batch["input_ids"], attention_mask=batch["attention_mask"])  # (B, T)
        values = values if idx is None else values[:, idx]
        vloss, vclipped = value_loss(values, at("old_values"), at("returns"), rl.value_clip, coef=1.0)
        policy_sum, _ = aggregate_token_loss(policy, mask, rl.rl_loss_agg, rl.rollout_max_tokens)
        value_sum, _ = aggregate_token_loss(vloss, mask, rl.rl_loss_agg, rl.rollout_max_tokens)
        agg = "token_mean" if rl.rl_loss_agg == "token_mean" else "seq_mean"
        diff = logps.detach() - old
        candidates = {
            "policy_loss": lambda: policy_sum.detach(),
            "value_loss": lambda: value_sum.detach(),
            "clip_fraction": lambda: aggregate_token_loss(clipped.float(), mask, agg)[0],
            "value_clip_fraction": lambda: aggregate_token_loss(vclipped.float(), mask, agg)[0],
            "approx_kl": lambda: aggregate_token_loss(0.5 * diff**2, mask, agg)[0],
            "sampler_logp_diff": lambda: aggregate_token_loss(diff.abs(), mask, agg)[0],
        }
        metrics = {k: f() for k, f in candidates.items() if self.wants(k)}
        return LossOutput(policy_sum + rl.ppo_vf_coef * value_sum, metrics)
