"""The one list of train types: ``OBJECTIVES`` maps each name to its objective class.

Everything else is derived from this dict: the config's allowed ``train_type`` values, the record
kind a run's dataset reads (each objective declares ``record_kind``: seq, sft, dpo, prompt or
rollout), and which loop runs it (``online`` objectives draw rollouts in ``train/rl/loop.py``; the
others run in the offline ``Trainer``). Adding a train type is one line here plus its class.
"""

from __future__ import annotations

from torch import nn

from astrai.config import Config
from astrai.train.objectives import DPOObjective, Objective, SeqObjective, SFTObjective
from astrai.train.rl.objectives import (
    GRPOObjective,
    OnlineDPOObjective,
    OnlineGRPOObjective,
    OnlinePPOObjective,
)

OBJECTIVES = {
    "seq": SeqObjective,
    "sft": SFTObjective,
    "dpo": DPOObjective,
    "grpo": GRPOObjective,
    "online_grpo": OnlineGRPOObjective,
    "online_dpo": OnlineDPOObjective,
    "online_ppo": OnlinePPOObjective,
}


def objective_class(train_type: str) -> type:
    if train_type not in OBJECTIVES:
        raise ValueError(f"train_type={train_type!r} has no objective here; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[train_type]


def record_kind(train_type: str) -> str:
    """The record kind (seq, sft, dpo, prompt, rollout) the datasets of `train_type` read."""
    return objective_class(train_type).record_kind


def is_online(train_type: str) -> bool:
    """Whether `train_type` trains on rollouts of the live policy (the online loop)."""
    return bool(getattr(objective_class(train_type), "online", False))


def build_objective(cfg: Config, model: nn.Module) -> Objective:
    return objective_class(cfg.data.train_type)(cfg, model)
