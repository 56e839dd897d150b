"""Reward-model training (``reward``): preference pairs -> a scalar score per sequence, trained
with the Bradley-Terry loss of ``losses.bradley_terry_loss`` (an optional per-pair ``margin``
column, TRL's ``center_rewards_coefficient``).

The model is a ``SequenceClassifier`` (``model/classifier.py``, built by ``train/build.py``):
its checkpoints are transformers sequence-classification directories that ``rewards: [DIR]`` and
``critic_model_path`` read as they are. Chosen and rejected rows go through one forward the way
DPO's do (``dpo.concat_pairs``, in ``row_layout``); a row's score is the one at its last real token. Metrics are
TRL's: ``accuracy`` (chosen scored above rejected) and ``margin`` (r_chosen - r_rejected), summed
over pairs; the offline loop reports them on the validation data as ``val/accuracy`` and
``val/margin``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.train.losses import bradley_terry_loss
from astrai.train.objectives.base import Batch, Companion, LossOutput, computed
from astrai.train.objectives.dpo import concat_pairs
from astrai.train.objectives.packing import forward_rows

if TYPE_CHECKING:
    from astrai.train.build import Run


class RewardObjective:
    """Bradley-Terry on (chosen, rejected) pairs; the loss unit is a pair."""

    requested_metrics: frozenset[str] | None = None
    companions: tuple[Companion, ...] = ()

    def __init__(self, cfg: Config, model: nn.Module):
        self.center_coef = cfg.objective.center_rewards_coefficient
        self.layout = cfg.objective.row_layout

    def setup(self, run: Run, total_steps: int) -> None:
        """Nothing is trained beside the classifier."""

    def num_units(self, batch: Batch) -> Tensor:
        return torch.tensor(batch["chosen_input_ids"].size(0), device=batch["chosen_input_ids"].device)

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        ids, _, mask, pos = concat_pairs(batch)  # (2B, T) each
        B = ids.size(0) // 2
        last = torch.zeros_like(mask, dtype=torch.bool)
        last[torch.arange(len(mask)), (mask.sum(dim=1) - 1).clamp(min=0)] = True  # (2B, T) each row's last token
        pairs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        out, rows = forward_rows(model, pairs, self.layout, labelled=last)  # scores (R, W) in the layout's rows
        scores = rows.gather(out, None)  # (2B,) at each row's last token
        chosen, rejected = scores[:B], scores[B:]
        losses = bradley_terry_loss(chosen, rejected, batch.get("margin"), self.center_coef)  # (B,)
        diff = (chosen - rejected).detach()
        metrics = computed({
            "accuracy": lambda: (diff > 0).float().sum(),
            "margin": lambda: diff.sum(),
            "rewards/chosen": lambda: chosen.detach().sum(),
            "rewards/rejected": lambda: rejected.detach().sum(),
        }, self.requested_metrics)
        return LossOutput(losses.sum(), metrics)
