"""Language-modelling objectives: next-token cross entropy (``seq``, pre-training) and its masked
form (``sft``, where the dataset labels only assistant turns), with label smoothing and the MoE
load-balancing term. The arithmetic is ``losses.token_cross_entropy``."""

from __future__ import annotations

from torch import Tensor, nn

from astrai.config import Config
from astrai.train.losses import IGNORE_INDEX, token_cross_entropy
from astrai.train.objectives.base import Batch, LossOutput, Objective, aux_coef, labelled_positions


class SeqObjective(Objective):
    """Next-token cross entropy on every labelled token (pre-training), with label smoothing."""

    def __init__(self, cfg: Config, model: nn.Module):
        self.label_smoothing = cfg.objective.label_smoothing
        self.aux_coef = aux_coef(cfg, model)

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
