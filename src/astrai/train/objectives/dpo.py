"""Direct preference optimisation (``dpo``): chosen and rejected rows in one forward, sequence
log-probs against a frozen reference (or none), ``losses.dpo_loss`` (sigmoid, IPO, hinge) and the
implicit-reward metrics TRL reports. Online DPO (``online_dpo.py``) reuses this objective on pairs
picked from rollouts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.train.losses import IGNORE_INDEX, dpo_loss, sum_token_logps
from astrai.train.objectives.base import (
    Batch,
    Companion,
    LossOutput,
    add_moe_terms,
    aux_coef,
    computed,
    frozen_reference,
    labelled_logps,
)

if TYPE_CHECKING:
    from astrai.train.build import Run


def concat_pairs(batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chosen and rejected rows padded to one length and stacked: one forward for both."""
    parts = []
    for key, pad in (("input_ids", 0), ("labels", IGNORE_INDEX), ("attention_mask", 0), ("position_ids", 0)):
        c, r = batch[f"chosen_{key}"], batch[f"rejected_{key}"]  # (B, Tc), (B, Tr)
        T = max(c.size(1), r.size(1))
        c = nn.functional.pad(c, (0, T - c.size(1)), value=pad)
        r = nn.functional.pad(r, (0, T - r.size(1)), value=pad)
        parts.append(torch.cat([c, r], dim=0))  # (2B, T)
    return parts[0], parts[1], parts[2], parts[3]


class DPOObjective:
    """Direct preference optimisation against a frozen reference (or none, reference-free). Under
    LoRA the reference is the policy's own module with its adapters disabled (no second model)."""

    requested_metrics: frozenset[str] | None = None
    companions: tuple[Companion, ...] = ()

    def __init__(self, cfg: Config, model: nn.Module, reference: nn.Module | None = None):
        o = cfg.objective
        self.beta, self.loss_type, self.label_noise = o.beta, o.loss_type, o.dpo_label_noise
        self.aux_coef = aux_coef(cfg, model)
        self.layout = o.row_layout  # chosen and rejected rows share one micro-batch in it (packing.py)
        self.reference: Any = None  # a frozen module, or a LoRA model's AdapterDisabled view
        if not o.reference_free:
            self.reference = reference if reference is not None else frozen_reference(o.ref_model_path, model)
            if isinstance(self.reference, nn.Module):
                self.reference.eval().requires_grad_(False)

    def setup(self, run: Run, total_steps: int) -> None:
        """Nothing is trained beside the policy."""

    def num_units(self, batch: Batch) -> Tensor:
        return torch.tensor(batch["chosen_input_ids"].size(0), device=batch["chosen_input_ids"].device)

    def _logps(self, model: nn.Module, ids: Tensor, labels: Tensor, mask: Tensor, pos: Tensor) -> tuple[Any, Tensor]:
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": pos}
        out, token_logps, _ = labelled_logps(model, batch, self.layout)  # (M,), the chunked lm head at labelled tokens
        # IPO compares per-token mean log-probs (its length normalisation)
        return out, sum_token_logps(token_logps, labels != IGNORE_INDEX, average=self.loss_type == "ipo")  # (2B,)

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        ids, labels, mask, pos = concat_pairs(batch)  # (2B, T) each
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
        metrics = computed({
            "rewards/chosen": lambda: chosen_rewards.sum(),
            "rewards/rejected": lambda: rejected_rewards.sum(),
            "rewards/margins": lambda: (chosen_rewards - rejected_rewards).sum(),
            "rewards/accuracies": lambda: (chosen_rewards > rejected_rewards).float().sum(),
            "logps/chosen": lambda: logps[:B].detach().sum(),
            "logps/rejected": lambda: logps[B:].detach().sum(),
        }, self.requested_metrics)
        units = torch.tensor(float(B), device=ids.device)
        loss = add_moe_terms(out, losses.sum(), units, self.aux_coef, metrics, self.requested_metrics)
        return LossOutput(loss, metrics)
