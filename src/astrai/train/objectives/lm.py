"""Language-modelling objectives: next-token cross entropy (``seq``, pre-training) and its masked
form (``sft``, where the dataset labels only assistant turns), with label smoothing and the MoE
load-balancing term. The arithmetic is ``losses.cross_entropy_from_logps`` (``token_cross_entropy``'s
on log-probs from the chunked lm head)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from astrai.config import Config
from astrai.train.losses import IGNORE_INDEX, cross_entropy_from_logps
from astrai.train.objectives.base import Batch, Companion, LossOutput, add_moe_terms, aux_coef, labelled_logps

if TYPE_CHECKING:
    from astrai.train.build import Run


class SeqObjective:
    """Next-token cross entropy on every labelled token (pre-training), with label smoothing."""

    requested_metrics: frozenset[str] | None = None
    companions: tuple[Companion, ...] = ()

    def __init__(self, cfg: Config, model: nn.Module):
        self.label_smoothing = cfg.objective.label_smoothing
        self.layout = cfg.objective.row_layout  # how a micro-batch's rows go through the model (packing.py)
        self.aux_coef = aux_coef(cfg, model)

    def setup(self, run: Run, total_steps: int) -> None:
        """Nothing is trained beside the policy."""

    def num_units(self, batch: Batch) -> Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        # the lm head runs chunked at the labelled tokens only: no (B, T, V) logits
        out, logps, mean_logps = labelled_logps(model, batch, self.layout, self.label_smoothing > 0)  # (M,) each
        loss_sum = cross_entropy_from_logps(logps, mean_logps, self.label_smoothing)
        num_tokens = (batch["labels"] != IGNORE_INDEX).sum()
        metrics: dict[str, Tensor] = {}
        loss = add_moe_terms(out, loss_sum, num_tokens, self.aux_coef, metrics, self.requested_metrics)
        return LossOutput(loss, metrics)


class SFTObjective(SeqObjective):
    """Masked cross entropy: the dataset sets labels to -100 outside assistant turns."""
