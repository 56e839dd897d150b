"""Online DPO (``online_dpo``): per prompt, the best and the worst rollout sample by reward become
a chosen / rejected pair for the DPO objective (``dpo.py``); groups whose rewards are all equal give
no pair and are counted (``skipped_groups``). ``group_size >= 2`` is checked where the config is
validated (``astrai.config``), before any model is built. A rank may hold fewer pairs than another
(or none): ``filler_batch`` gives the loop a batch for the passes it must still join under DDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.train.objectives.base import Batch, Companion, LossOutput
from astrai.train.objectives.dpo import DPOObjective

if TYPE_CHECKING:
    from astrai.train.build import Run
    from astrai.train.rl.data import Rollout


class OnlineDPOObjective:
    """Online DPO: per prompt, the best and the worst sample by reward become chosen / rejected."""

    companions: tuple[Companion, ...] = ()

    def __init__(self, cfg: Config, model: nn.Module):
        self.dpo = DPOObjective(cfg, model)

    def setup(self, run: Run, total_steps: int) -> None:
        """Nothing is trained beside the policy."""

    @property
    def requested_metrics(self) -> frozenset[str] | None:
        return self.dpo.requested_metrics

    @requested_metrics.setter
    def requested_metrics(self, value: frozenset[str] | None) -> None:
        self.dpo.requested_metrics = value

    def prepare(self, rollout: Rollout) -> None:
        """Pin (chosen, rejected) sample indices; groups whose rewards are all equal are skipped."""
        best, worst = rollout.rewards.argmax(dim=1), rollout.rewards.argmin(dim=1)  # (B,)
        distinct = rollout.rewards.max(dim=1).values > rollout.rewards.min(dim=1).values
        base = torch.arange(rollout.rewards.size(0)) * rollout.group_size
        rollout.pairs = torch.stack([base + best, base + worst], dim=1)[distinct]  # (P, 2)
        rollout.stats["skipped_groups"] = float((~distinct).sum())

    def batches(self, rollout: Rollout, num_micro: int, samples: Tensor | None = None) -> list[Batch]:
        if samples is not None:  # the config refuses mini_batches for online_dpo: a mini-batch would cut pairs
            raise ValueError("online_dpo trains on whole pairs; mini-batches of samples do not apply (mini_batches 1)")
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

    def filler_batch(self, rollout: Rollout, batches: list[Batch]) -> Batch:
        """This rank's last micro-batch again, or, when it has no pair at all, one of sample 0
        against itself (the loop zeroes its loss)."""
        if batches:
            return batches[-1]
        pairs, rollout.pairs = rollout.pairs, torch.zeros(1, 2, dtype=torch.long)
        try:
            return self.batches(rollout, 1)[0]
        finally:
            rollout.pairs = pairs

    def num_units(self, batch: Batch) -> Tensor:
        return self.dpo.num_units(batch)

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        return self.dpo(model, batch)
