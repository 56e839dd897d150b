"""Where each second of a step goes: the ``time_*`` metrics, their shares, and one log per rank.

Every loop's ``TrainContext`` holds a ``StepTimes``; the code that does the work adds its seconds
to a part: ``TrainStep`` (``train/step.py``) ``forward_backward`` (the window's micro-batches; on
CUDA the device is synchronised once before the optimizer step, so queued kernels count here),
``optimizer`` (the gradient step, the companions' steps) and ``weight_sync`` (publishing the new
policy version to the sampler); the online loop ``weight_sync`` (refreshing the sampler's weights
before a fresh rollout) and ``reference`` (the objective's preparation of a fresh rollout:
reference log-probs, PPO's critic values, advantages); the checkpoint saver ``checkpoint``. A
fresh rollout's own timings (``rollout_seconds`` and its parts ``generation_seconds``,
``tool_seconds``, ``env_seconds``, ``reward_seconds``, measured by the episode runner) become
``rollout``, ``generation``, ``tools``, ``environment`` and ``rewards``. When a loop builds a
step's metrics it ``take``s them: ``time_step`` (the step's wall time), one ``time_<part>`` per
part and ``time_other`` (the step's time no part claims: data loading, bookkeeping).
``time_checkpoint`` is the odd one: a checkpoint is published after its step's metrics were
written, so its seconds arrive with the next step's line (and the last one only in the run
summary's shares). The numbers are the rank's own; ``RankLog`` (more than one rank) writes each
rank's to ``<log_dir>/ranks/rank_<R>.jsonl`` so a straggler shows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# the parts, in the order the summary names them; those inside rollout are indented there
PARTS = ("rollout", "generation", "tools", "environment", "rewards", "reference", "forward_backward", "optimizer",
         "weight_sync", "checkpoint", "other")
ROLLOUT_PARTS = ("generation", "tools", "environment", "rewards")
OUTSIDE_STEP = ("checkpoint",)  # published between steps
ROLLOUT_STATS = {"rollout_seconds": "rollout", "generation_seconds": "generation", "tool_seconds": "tools",
                 "env_seconds": "environment", "reward_seconds": "rewards"}


class StepTimes:
    """Seconds per part since the last ``take`` (module docstring)."""

    def __init__(self) -> None:
        self.pending: dict[str, float] = {}

    def add(self, part: str, seconds: float) -> None:
        self.pending[part] = self.pending.get(part, 0.0) + seconds

    @contextmanager
    def span(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - start)

    def take(self, step_seconds: float, rollout_stats: dict[str, float] | None = None) -> dict[str, float]:
        """The step's ``time_*`` metrics (a fresh rollout's timings from its `rollout_stats`); resets."""
        for key, part in ROLLOUT_STATS.items():
            if rollout_stats and key in rollout_stats:
                self.add(part, rollout_stats[key])
        parts, self.pending = self.pending, {}
        inside = sum(v for k, v in parts.items() if k not in OUTSIDE_STEP and k not in ROLLOUT_PARTS)
        out = {"time_step": step_seconds, **{f"time_{k}": v for k, v in sorted(parts.items())}}
        out["time_other"] = max(0.0, step_seconds - inside)
        return out


def time_shares(totals: dict[str, float]) -> list[tuple[str, float]]:
    """(part, share of the run's time) from summed ``time_*`` metrics: the steps' wall time plus
    the checkpoints' (published between steps). Empty without any."""
    total = totals.get("time_step", 0.0) + totals.get("time_checkpoint", 0.0)
    if total <= 0:
        return []
    return [(part, totals.get(f"time_{part}", 0.0) / total) for part in PARTS
            if totals.get(f"time_{part}", 0.0) > 0 or part in ("forward_backward", "optimizer")]


def format_time_shares(shares: list[tuple[str, float]]) -> str:
    """``rollout 61% (generation 48%, rewards 3%), forward_backward 30%, ...``."""
    inside = [(p, s) for p, s in shares if p in ROLLOUT_PARTS]
    words = []
    for part, share in shares:
        if part in ROLLOUT_PARTS:
            continue
        sub = ", ".join(f"{p} {s:.0%}" for p, s in inside) if part == "rollout" and inside else ""
        words.append(f"{part} {share:.0%}" + (f" ({sub})" if sub else ""))
    return ", ".join(words)


class RankLog:
    """With several ranks: every rank appends its own step lines (step, rank, its ``time_*``
    numbers and its rollout's statistics before they are averaged over ranks) to
    ``<log_dir>/ranks/rank_<R>.jsonl``; a resumed run drops the lines past the restored step."""

    requested_metrics = frozenset()

    def __init__(self, log_dir: str | Path, rank: int):
        self.rank = rank
        self.path = Path(log_dir) / "ranks" / f"rank_{rank}.jsonl"

    def on_train_begin(self, trainer: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        step = trainer.ctx.step
        if step == 0 or not self.path.exists():
            self.path.write_text("")
        else:
            kept = [x for x in self.path.read_text().splitlines() if x.strip() and json.loads(x)["step"] <= step]
            self.path.write_text("".join(x + "\n" for x in kept))

    def after_optimizer_step(self, trainer: Any) -> None:
        m = trainer.step_metrics
        line = {"step": trainer.ctx.step, "rank": self.rank, **{k: v for k, v in m.items() if k.startswith("time_")}}
        rollout = getattr(trainer, "rollout", None)
        if rollout is not None and rollout.num_uses == 1:  # this rank's own fresh rollout
            line.update({k: v for k, v in rollout.stats.items() if isinstance(v, int | float)})
            line["reward_mean"] = float(rollout.rewards.mean())
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
