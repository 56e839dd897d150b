"""Train types -> objectives: a batch and the model in, ``LossOutput(loss, metrics)`` out.

``OBJECTIVES`` is the one map from a ``train_type`` to its objective class, one module per family:
``lm`` (seq, sft), ``dpo``, ``grpo`` (grpo, online_grpo), ``online_dpo``, ``ppo`` (online_ppo);
``base`` holds what they share. Its keys are the config's ``TRAIN_TYPES`` (``astrai.config_values``,
where each train type's record kind is stated), checked by ``tests/train/test_config.py``. Which
loop runs a train type follows from its record kind: ``prompt`` types draw rollouts in
``train/rl/loop.py``, the others run in the offline ``Trainer``.
"""

from __future__ import annotations

from torch import nn

from astrai.config import Config
from astrai.config_values import TRAIN_TYPES, is_online
from astrai.train.objectives.base import LossOutput, Objective, labelled_positions, num_tokens
from astrai.train.objectives.dpo import DPOObjective
from astrai.train.objectives.grpo import GRPOObjective, OnlineGRPOObjective
from astrai.train.objectives.lm import SeqObjective, SFTObjective
from astrai.train.objectives.online_dpo import OnlineDPOObjective
from astrai.train.objectives.ppo import OnlinePPOObjective

OBJECTIVES = {
    "seq": SeqObjective,
    "sft": SFTObjective,
    "dpo": DPOObjective,
    "grpo": GRPOObjective,
    "online_grpo": OnlineGRPOObjective,
    "online_dpo": OnlineDPOObjective,
    "online_ppo": OnlinePPOObjective,
}

__all__ = ["OBJECTIVES", "DPOObjective", "GRPOObjective", "LossOutput", "Objective", "OnlineDPOObjective",
           "OnlineGRPOObjective", "OnlinePPOObjective", "SFTObjective", "SeqObjective", "build_objective",
           "is_online", "labelled_positions", "num_tokens", "record_kind"]


def objective_class(train_type: str) -> type:
    if train_type not in OBJECTIVES:
        raise ValueError(f"train_type={train_type!r} has no objective here; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[train_type]


def record_kind(train_type: str) -> str:
    """The record kind (seq, sft, dpo, prompt, rollout) the datasets of `train_type` read."""
    objective_class(train_type)
    return TRAIN_TYPES[train_type]


def build_objective(cfg: Config, model: nn.Module) -> Objective:
    return objective_class(cfg.data.train_type)(cfg, model)
