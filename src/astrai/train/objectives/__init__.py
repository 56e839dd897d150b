"""Train types -> objectives: a batch and the model in, ``LossOutput(loss, metrics)`` out.

``OBJECTIVES`` is the one map from a ``train_type`` to what builds its objective from ``(cfg,
model)``, one module per family: ``lm`` (seq, sft), ``dpo``, ``grpo`` (grpo, and online_grpo: the
same class with ``online=True``), ``online_dpo``, ``ppo`` (online_ppo), ``distill`` (online_distill, kd), ``reward_model`` (reward). What a loop may ask of an
objective is stated once in ``base.py`` (``Objective``; ``RolloutObjective`` for the online
loop); the steps objectives share are functions there and in ``logps.py`` and
``rollout_steps.py``, composed by each objective, never inherited. The keys are the config's
``TRAIN_TYPES`` (``astrai.config_values``, where each train type's record kind is stated),
checked by ``tests/train/test_config.py``. Which loop runs a train type follows from its record
kind: ``prompt`` types draw rollouts in ``train/rl/loop.py``, the others run in the offline
``Trainer``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from astrai.config import Config
from astrai.config_values import TRAIN_TYPES
from astrai.train.objectives.base import (
    LossOutput,
    Objective,
    RolloutObjective,
    labelled_positions,
    num_tokens,
)
from astrai.train.objectives.distill import KDObjective, OnlineDistillObjective
from astrai.train.objectives.dpo import DPOObjective
from astrai.train.objectives.grpo import GRPOObjective
from astrai.train.objectives.lm import SeqObjective, SFTObjective
from astrai.train.objectives.online_dpo import OnlineDPOObjective
from astrai.train.objectives.ppo import PPOObjective
from astrai.train.objectives.reward_model import RewardObjective

OBJECTIVES: dict[str, Callable[[Config, nn.Module], Objective]] = {
    "seq": SeqObjective,
    "sft": SFTObjective,
    "dpo": DPOObjective,
    "grpo": GRPOObjective,
    "online_grpo": partial(GRPOObjective, online=True),
    "online_dpo": OnlineDPOObjective,
    "online_ppo": PPOObjective,
    "online_distill": OnlineDistillObjective,
    "kd": KDObjective,
    "reward": RewardObjective,
}

__all__ = ["OBJECTIVES", "DPOObjective", "GRPOObjective", "KDObjective", "LossOutput", "Objective", "OnlineDPOObjective",
           "OnlineDistillObjective", "PPOObjective", "RewardObjective", "RolloutObjective", "SFTObjective", "SeqObjective", "build_objective",
           "labelled_positions", "num_tokens", "objective_builder", "record_kind"]


def objective_builder(train_type: str) -> Callable[[Config, nn.Module], Objective]:
    """What builds `train_type`'s objective, or an error naming the train types that have one."""
    if train_type not in OBJECTIVES:
        raise ValueError(f"train_type={train_type!r} has no objective here; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[train_type]


def record_kind(train_type: str) -> str:
    """The record kind (seq, sft, dpo, prompt, rollout) the datasets of `train_type` read."""
    objective_builder(train_type)
    return TRAIN_TYPES[train_type]


def build_objective(cfg: Config, model: nn.Module) -> Objective:
    return objective_builder(cfg.data.train_type)(cfg, model)
