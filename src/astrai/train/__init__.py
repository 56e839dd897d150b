"""Training: config -> Trainer loop -> objectives/losses -> optimizer -> checkpoints.

Public Python API: ``Trainer`` (offline loop), ``OnlineLoop`` (online RL), ``TrainContext``,
``LossOutput``, ``OBJECTIVES`` (imported lazily, so ``import astrai.train.losses`` stays light).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Trainer": "astrai.train.trainer",
    "OnlineLoop": "astrai.train.rl.loop",
    "TrainContext": "astrai.train.context",
    "LossOutput": "astrai.train.objectives",
    "OBJECTIVES": "astrai.train.objectives",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'astrai.train' has no attribute {name!r}")
