"""Train types -> objectives: a batch and the model in, ``LossOutput(loss, metrics)`` out.

Sits between the trainer and ``train/losses.py``: an objective runs the model forward on a
batch from ``astrai.data`` and hands the outputs to the pure loss functions, which hold all the
arithmetic. The trainer normalises by the whole accumulation window, so every objective reports
*sums* over its loss units (loss tokens for seq/sft, preference pairs for dpo): ``loss`` and
each metric are divided by the window's unit count (all ranks) by the trainer. For MoE models
the objective adds ``router_aux_loss_coef * aux_loss`` and reports the router statistics.
Metrics are computed only when requested: the trainer sets ``requested_metrics`` to the names its
callbacks read (None = all), and an objective skips the rest.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.train.losses import IGNORE_INDEX, dpo_loss, sequence_logps, token_cross_entropy

Batch = dict[str, Any]


@dataclass
class LossOutput:
    loss: Tensor  # scalar, summed over this micro-batch's loss units (graph attached)
    # detached scalars, each summed over the same units (the trainer turns them into window means)
    metrics: dict[str, Tensor] = field(default_factory=dict)


def num_tokens(batch: Batch) -> Tensor | int:
    """Non-padding input tokens of a batch (every ``*attention_mask``), for throughput metrics."""
    masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
    if masks:
        return sum(m.sum() for m in masks)
    return sum(t.numel() for k, t in batch.items() if k.endswith("input_ids"))


class Objective:
    """What every objective shares: which of its metrics anyone asked for, and the record kind
    (``astrai.data.records``) its dataset reads."""

    record_kind = "seq"
    requested_metrics: frozenset[str] | None = None  # None: compute every metric

    def wants(self, name: str) -> bool:
        return self.requested_metrics is None or name in self.requested_metrics

    def _add_moe_terms(self, out: Any, loss: Tensor, units: Tensor, coef: float, metrics: dict[str, Tensor]) -> Tensor:
        """loss + coef * aux_loss (aux is a per-micro-batch mean, so it is weighted by the units)."""
        if out.aux_loss is None:
            return loss
        aux = out.aux_loss.float() * units
        candidates = {
            "task_loss": lambda: loss.detach(),
            "aux_loss": lambda: aux.detach(),
            "aux_loss_weighted": lambda: coef * aux.detach(),
        }
        for name, value in out.router_stats.items():
            value = value.detach().float()
            if value.ndim:  # per-expert loads: the busiest expert's share says how balanced routing is
                candidates[f"router/{name}_max"] = lambda v=value: v.max() * units
                candidates[f"router/{name}_min"] = lambda v=value: v.min() * units
            else:
                candidates[f"router/{name}"] = lambda v=value: v * units
        metrics.update({name: compute() for name, compute in candidates.items() if self.wants(name)})
        return loss + coef * aux


def labelled_positions(labels: Tensor) -> Tensor | None:
    """Positions (K,) where at least one row has a label, or None when that is every position.

    Logits are only needed there: SFT prompts (and DPO prompts) carry no loss, so skipping their
    LM-head projection and softmax over the vocabulary saves work without changing the loss or
    its gradient.
    """
    keep = (labels != IGNORE_INDEX).any(dim=0)  # (T,)
    if bool(keep.all()):
        return None
    return keep.nonzero().squeeze(1)


def _aux_coef(cfg: Config, model: nn.Module) -> float:
    # the model section overrides the loaded model's own config.json value
    default = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0)
    return float(cfg.model.get("router_aux_loss_coef", default))


class SeqObjective(Objective):
    """Next-token cross entropy on every labelled token (pre-training), with label smoothing."""

    def __init__(self, cfg: Config, model: nn.Module):
        self.label_smoothing = cfg.objective.label_smoothing
        self.aux_coef = _aux_coef(cfg, model)

    def num_units(self, batch: Batch) -> Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        labels = batch["labels"]  # (B, T)
        idx = labelled_positions(labels)
        out = model(batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    position_ids=batch.get("position_ids"), logits_indices=idx)  # logits (B, K, V)
        if idx is not None:
            labels = labels[:, idx]  # (B, K)
        loss_sum, num_tokens = token_cross_entropy(out.logits, labels, self.label_smoothing)
        metrics: dict[str, Tensor] = {}
        loss = self._add_moe_terms(out, loss_sum, num_tokens, self.aux_coef, metrics)
        return LossOutput(loss, metrics)


class SFTObjective(SeqObjective):
    """Masked cross entropy: the dataset sets labels to -100 outside assistant turns."""

    record_kind = "sft"


def _concat_pairs(batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chosen and rejected rows padded to one length and stacked: one forward for both."""
    parts = []
    for key, pad in (("input_ids", 0), ("labels", IGNORE_INDEX), ("attention_mask", 0), ("position_ids", 0)):
        c, r = batch[f"chosen_{key}"], batch[f"rejected_{key}"]  # (B, Tc), (B, Tr)
        T = max(c.size(1), r.size(1))
        c = nn.functional.pad(c, (0, T - c.size(1)), value=pad)
        r = nn.functional.pad(r, (0, T - r.size(1)), value=pad)
        parts.append(torch.cat([c, r], dim=0))  # (2B, T)
    return parts[0], parts[1], parts[2], parts[3]


class DPOObjective(Objective):
    """Direct preference optimisation against a frozen reference (or none, reference-free). Under
    LoRA the reference is the policy's own module with its adapters disabled (no second model)."""

    record_kind = "dpo"

    def __init__(self, cfg: Config, model: nn.Module, reference: nn.Module | None = None):
        o = cfg.objective
        self.beta, self.loss_type, self.label_noise = o.beta, o.loss_type, o.dpo_label_noise
        self.aux_coef = _aux_coef(cfg, model)
        self.reference: Any = None  # a frozen module, or a LoRA model's AdapterDisabled view
        if not o.reference_free:
            self.reference = reference if reference is not None else self._build_reference(o.ref_model_path, model)
            if isinstance(self.reference, nn.Module):
                self.reference.eval().requires_grad_(False)

    @staticmethod
    def _build_reference(ref_model_path: str | None, model: nn.Module) -> Any:
        from astrai.model.lora import AdapterDisabled, has_lora

        if ref_model_path is None and has_lora(model):
            return AdapterDisabled(model)  # the frozen base is the initial policy: no copy of the weights
        if ref_model_path is None:
            return copy.deepcopy(model)  # the initial policy, frozen
        from astrai.model.hf import load_model

        device = next(model.parameters()).device
        return load_model(ref_model_path, device=device)

    def num_units(self, batch: Batch) -> Tensor:
        return torch.tensor(batch["chosen_input_ids"].size(0), device=batch["chosen_input_ids"].device)

    def _logps(self, model: nn.Module, ids: Tensor, labels: Tensor, mask: Tensor, pos: Tensor) -> tuple[Any, Tensor]:
        idx = labelled_positions(labels)
        out = model(ids, attention_mask=mask, position_ids=pos, logits_indices=idx)  # logits (2B, K, V)
        if idx is not None:
            labels = labels[:, idx]  # (2B, K)
        # IPO compares per-token mean log-probs (its length normalisation)
        return out, sequence_logps(out.logits, labels, average=self.loss_type == "ipo")  # (2B,)

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        ids, labels, mask, pos = _concat_pairs(batch)  # (2B, T) each
        B = ids.size(0) // 2
        out, logps = self._logps(model, ids, labels, mask, pos)
        ref_c = ref_r = None
        if self.reference is not None:
            with torch.no_grad():
                _, ref_logps = self._logps(self.reference, ids, labels, mask, pos)
            ref_c, ref_r = ref_logps[:B], ref_logps[B:]
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            logps[:B], logps[B:], ref_c, ref_r, self.beta, self.loss_type, self.label_noise
        )  # (B,) each
        candidates = {
            "rewards/chosen": lambda: chosen_rewards.sum(),
            "rewards/rejected": lambda: rejected_rewards.sum(),
            "rewards/margins": lambda: (chosen_rewards - rejected_rewards).sum(),
            "rewards/accuracies": lambda: (chosen_rewards > rejected_rewards).float().sum(),
            "logps/chosen": lambda: logps[:B].detach().sum(),
            "logps/rejected": lambda: logps[B:].detach().sum(),
        }
        metrics = {name: compute() for name, compute in candidates.items() if self.wants(name)}
        loss = self._add_moe_terms(out, losses.sum(), torch.tensor(float(B), device=ids.device), self.aux_coef, metrics)
        return LossOutput(loss, metrics)
