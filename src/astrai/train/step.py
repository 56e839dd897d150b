"""The gradient-step window and one optimizer step's bookkeeping: every loop calls them.

The offline trainer, the online RL loop and the PPO critic's optimizer all end a window the same
way, so the arithmetic lives here once. Objectives report *sums* over their loss units; after the
window's micro-batches have been backpropagated, ``step()`` all-reduces the unit count, loss and
metric sums over the ranks in one collective, scales the gradients so that the update equals
(sum over the window and all ranks) / (the window's loss units), clips them (the pre-clip norm is
the step's ``grad_norm``), and steps the optimizer and the schedule. A non-finite loss or
gradient norm skips the update (gradients dropped, ``nonfinite_steps`` counts it, one warning
names the step); ``max_nonfinite_steps`` skips in a row stop the run with ``NonFiniteError``.
A window without loss units (nothing to learn from) leaves the weights as they are.
``TrainStep`` is what both loops write around it: a micro-batch (device, DDP no-sync, autocast,
objective, backward, the window's sums, the companions') and the window's end (the optimizer
step, then the run's step and policy-version counters, then the companions' steps), timing
each part into ``ctx.times`` (``train/timing.py``).
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn

from astrai.train import dist
from astrai.train.context import TrainContext
from astrai.train.objectives.base import Batch, Companion, LossOutput, Objective, num_tokens


class NonFiniteError(RuntimeError):
    """Training diverged: too many consecutive steps had a non-finite loss or gradient norm."""


class GradientStep:
    """One accumulation window over `params`: ``add`` after each backward, ``step`` to finish it."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: Any, scheduler: Any, *,
                 max_grad_norm: float, world_size: int, device: torch.device,
                 max_nonfinite_steps: int = 10, name: str = "policy"):
        self.params = [p for p in params if p.requires_grad]
        self.optimizer, self.scheduler = optimizer, scheduler
        self.max_grad_norm, self.world_size, self.device = max_grad_norm, world_size, device
        self.max_nonfinite_steps, self.name = max_nonfinite_steps, name
        self.num_nonfinite_in_row = 0
        self.num_nonfinite_total = 0
        self.reset()

    def reset(self) -> None:
        """Forget the window's sums (the gradients are the caller's: see ``drop``)."""
        self.size = 0
        self._units = torch.zeros((), dtype=torch.long, device=self.device)
        self._tokens = torch.zeros((), dtype=torch.long, device=self.device)
        self._loss = torch.zeros((), device=self.device)
        self._metrics: dict[str, Tensor] = {}

    def drop(self) -> None:
        """Abandon a partial window: its gradients and sums go (a stop inside a window)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.reset()

    def add(self, loss: Tensor, units: Tensor | int, num_tokens: Tensor | int,
            metrics: dict[str, Tensor] | None = None) -> None:
        """Record one backpropagated micro-batch: its summed loss, loss units, tokens and metric sums."""
        self.size += 1
        self._units += units
        self._tokens += num_tokens
        self._loss += loss.detach().float()
        for k, v in (metrics or {}).items():
            self._metrics[k] = self._metrics.get(k, 0.0) + v.detach().float()

    def step(self, number: int, before_update: Callable[[], None] | None = None) -> dict[str, Any]:
        """Finish the window as optimizer step `number`: normalise, clip, check, then (after
        `before_update`, which sees the final gradients: the loop's callback hook) step. Returns the
        window means and ``lr``, ``grad_norm``, ``num_loss_units``, ``num_tokens``, ``skipped``
        (1 when a non-finite value skipped the update) and ``nonfinite_steps`` (the run's total)."""
        names = sorted(self._metrics)
        local = torch.stack([self._units.float(), self._loss, self._tokens.float(),
                             *[self._metrics[k] for k in names]])
        totals = dist.all_reduce_sum(local)  # one collective for every sum of the window
        units = totals[0].clamp(min=1)
        # DDP/FSDP average gradients over ranks; scaling by world_size / units turns that mean of
        # per-rank sums into (sum over the window and all ranks) / (the window's loss units)
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self.world_size / units.item())
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        grad_norm = _to_float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))  # the pre-clip norm
        loss = (totals[1] / units).item()
        lr = self.scheduler.get_last_lr()[0]
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if before_update is not None:
            before_update()
        empty = totals[0].item() == 0  # nothing to learn from (e.g. online DPO with only tied groups)
        if skipped:
            self._skip(number, loss, grad_norm)
        elif not empty:
            self.num_nonfinite_in_row = 0
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # the schedule follows the step count, applied or skipped
        out = {
            "lr": lr, "loss": loss, "grad_norm": grad_norm, "num_loss_units": int(units.item()),
            "num_tokens": int(totals[2].item()), "skipped": int(skipped),
            "nonfinite_steps": self.num_nonfinite_total,
            **{k: (totals[3 + i] / units).item() for i, k in enumerate(names)},
        }
        self.reset()
        return out

    def state_dict(self) -> dict[str, int]:
        return {"nonfinite_in_row": self.num_nonfinite_in_row, "nonfinite_total": self.num_nonfinite_total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
        self.num_nonfinite_total = int(state.get("nonfinite_total", 0))

    def _skip(self, number: int, loss: float, grad_norm: float) -> None:
        self.num_nonfinite_in_row += 1
        self.num_nonfinite_total += 1
        if self.num_nonfinite_in_row >= self.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self.name}: {self.num_nonfinite_in_row} optimizer steps in a row had a non-finite loss or "
                f"gradient norm (last: loss={loss}, grad_norm={grad_norm}); training diverged. Lower --max_lr, "
                "add warmup (--warmup_steps) or clipping (--max_grad_norm), and resume from the last checkpoint"
            )
        if dist.get_rank() == 0:
            print(f"warning: {self.name} step {number} skipped: non-finite loss={loss} or grad_norm={grad_norm}; gradients "
                  f"dropped ({self.num_nonfinite_in_row} in a row, the run stops at {self.max_nonfinite_steps})",
                  file=sys.stderr)


class TrainStep:
    """One optimizer step of a loop: ``micro_batch`` for each micro-batch of the window, then
    ``finish``. `model` is the wrapped policy the objective trains through; `companions` are the
    modules trained beside it (the online loop's objective's; the offline loop has none)."""

    def __init__(self, model: nn.Module, objective: Objective, grad_step: GradientStep, device: torch.device,
                 bf16: bool, companions: Sequence[Companion] = ()):
        self.model, self.objective, self.grad_step = model, objective, grad_step
        self.device, self.bf16, self.companions = device, bf16, tuple(companions)
        self.forward_backward_seconds = 0.0  # this window's micro-batches so far (ctx.times gets it at finish)

    def micro_batch(self, batch: Batch, last: bool, filler: bool = False) -> LossOutput:
        """Forward and backward one micro-batch and add it to the window. DDP all-reduces the
        gradients only in the window's `last` backward (policy and companions). A `filler` pass
        (a rank with fewer micro-batches than another) only joins the gradient all-reduce: zero
        loss, zero units and tokens, zero metrics (their names keep the window's sums aligned
        over the ranks) and no pins."""
        start = time.perf_counter()
        batch = {k: v.to(self.device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}
        # the switches cover the forward only (DDP reads no-sync there); FSDP2 reads its switch in
        # the backward, so its gradients are reduce-scattered every micro-batch, as they always were
        with ExitStack() as stack:
            for module in (self.model, *(c.module for c in self.companions)):
                stack.enter_context(dist.no_sync(module, not last))
            stack.enter_context(dist.autocast(self.device, self.bf16))
            out = self.objective(self.model, batch)
        if filler:
            out = LossOutput(out.loss * 0, {k: torch.zeros_like(v) for k, v in out.metrics.items()})
        out.loss.backward()  # a sum over loss units; the window normalises it
        units = 0 if filler else self.objective.num_units(batch)
        self.grad_step.add(out.loss, units, 0 if filler else num_tokens(batch), out.metrics)
        for companion in self.companions:  # PPO's critic: the same backward fed its gradients
            companion.add(out, units)
        self.forward_backward_seconds += time.perf_counter() - start
        return out

    def finish(self, ctx: TrainContext, before_update: Callable[[], None] | None = None,
               publish: Callable[[int], None] | None = None) -> tuple[dict[str, Any], int]:
        """End the window as optimizer step ``ctx.step + 1`` (``GradientStep.step``; `before_update`
        is the loop's callback hook), count the step and the new policy version in `ctx`, hand the
        version to `publish` (the rollout sampler: older KV is never served), then step each
        companion, outside the version's publication. Returns the step's metrics (the policy's
        and the companions') and the window's trained tokens (all ranks), also added to
        ``ctx.tokens_seen``."""
        start = time.perf_counter()
        if self.device.type == "cuda":  # queued kernels are the micro-batches' time, not the optimizer's
            torch.cuda.synchronize(self.device)
        ctx.times.add("forward_backward", self.forward_backward_seconds + time.perf_counter() - start)
        self.forward_backward_seconds = 0.0
        with ctx.times.span("optimizer"):
            result = self.grad_step.step(ctx.step + 1, before_update=before_update)
        ctx.step += 1
        ctx.policy_version += 1
        if publish is not None:
            with ctx.times.span("weight_sync"):
                publish(ctx.policy_version)
        with ctx.times.span("optimizer"):
            for companion in self.companions:
                result.update(companion.step(ctx.step))
        tokens = result.pop("num_tokens")
        ctx.tokens_seen += tokens
        return result, tokens


def _to_float(x: Tensor | float) -> float:
    if isinstance(x, Tensor):
        x = x.full_tensor() if hasattr(x, "full_tensor") else x  # FSDP2 returns a DTensor norm
        return float(x.item())
    return float(x)
