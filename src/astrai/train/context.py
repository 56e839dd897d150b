"""TrainContext (the counters of a run and its stop request) and ``Loop``, what a loop exposes.

Created by the trainer (or the CLI, so that signal handlers installed before the model is built
have somewhere to write), read by callbacks, saved into ``trainer_state.json`` by checkpoints and
restored on ``--resume``. ``step`` counts optimizer steps; ``consumed_samples`` counts samples of
the current epoch consumed by completed optimizer steps, over all ranks.

``Loop`` is the protocol that callbacks, checkpoints and resume depend on, so they work with
every loop (the offline ``Trainer``, the online RL loop) and never import a concrete one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from astrai.train.timing import StepTimes


@dataclass
class TrainContext:
    epoch: int = 0
    step: int = 0  # completed optimizer steps
    consumed_samples: int = 0  # samples of the current epoch consumed by completed steps (global)
    tokens_seen: int = 0  # non-padding input tokens of completed steps (global)
    policy_version: int = 0  # bumped on every optimizer step (weights served to rollouts)
    stop_reason: str | None = None
    command: list[str] | None = None  # the `astrai train` arguments (the summary's resume line); None from Python
    times: StepTimes = field(default_factory=StepTimes, repr=False)  # seconds per part of the step (timing.py)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, reason: str = "requested") -> None:
        """Thread- and signal-safe: the loop stops at the next batch boundary."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "tokens_seen": self.tokens_seen,
            "policy_version": self.policy_version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("epoch", "step", "consumed_samples", "tokens_seen", "policy_version"):
            setattr(self, key, int(state[key]))


class Loop(Protocol):
    """What a training loop exposes to callbacks, checkpoints and resume."""

    config: Any  # astrai.config.Config
    ctx: TrainContext
    is_main: bool  # rank 0: the rank that logs and writes
    raw_model: Any  # the unwrapped policy module (its weights are the checkpoint's model)
    tokenizer: Any
    optimizer: Any
    scheduler: Any
    total_steps: int
    step_metrics: dict[str, Any]  # the last optimizer step's metrics

    def state_dict(self) -> dict[str, Any]:
        """JSON-able counters, sampler, RNG and config (trainer_state.json)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def extra_state(self) -> dict[str, dict[str, Any]]:
        """Further state saved as ``<name>.pt`` in each checkpoint (e.g. a critic and its optimizer)."""
        ...

    def load_extra_state(self, states: dict[str, dict[str, Any]]) -> None: ...
