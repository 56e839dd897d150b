"""What every objective shares: ``LossOutput``, the loop contract (``Objective``, ``RolloutObjective``,
``Companion``), metric requests, the MoE terms and the frozen reference, as plain functions.

Sits between a loop and ``train/losses.py``: an objective runs the model forward on a batch and
hands the outputs to the pure loss functions, which hold all the arithmetic. Loops normalise by
the whole accumulation window, so every objective reports *sums* over its loss units (loss tokens
for seq/sft, preference pairs for dpo, tokens or sequences for RL): ``loss`` and each metric are
divided by the window's unit count (all ranks) in ``train/step.py``. Metrics are computed only
when requested: the loop sets ``requested_metrics`` to the names its callbacks read (None = all).
Objectives are composed, not inherited: each calls the shared steps it needs (here, and for
rollout objectives ``logps.py`` and ``rollout_steps.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.model.chunked_head import HeadLogps, head_logps
from astrai.train.losses import IGNORE_INDEX
from astrai.train.objectives.packing import forward_rows

if TYPE_CHECKING:
    from astrai.train.build import Run
    from astrai.train.rl.data import Rollout

Batch = dict[str, Any]


@dataclass
class LossOutput:
    loss: Tensor  # scalar, summed over this micro-batch's loss units (graph attached)
    # detached scalars, each summed over the same units (the trainer turns them into window means)
    metrics: dict[str, Tensor] = field(default_factory=dict)
    # (B, T) tensors the loop stores on the rollout at the batch's samples, for the steps that
    # reuse it (online RL: the trainer's log-probs at the rollout's weights)
    pins: dict[str, Tensor] = field(default_factory=dict)


class Companion(Protocol):
    """A module trained beside the policy on the same micro-batches (PPO's critic): wrapped like
    the policy, with its own optimizer, schedule and gradient step. The loop joins ``module`` to
    its DDP no-sync window, calls ``add`` after each backward and ``step`` after the policy's."""

    name: str  # its gradient-step counters are saved as "<name>_step" in trainer_state.json
    module: nn.Module

    def add(self, out: LossOutput, units: Tensor | int) -> None: ...
    def step(self, number: int) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, int]: ...
    def load_state_dict(self, state: dict[str, int]) -> None: ...
    def extra_state(self) -> dict[str, dict[str, Any]]: ...
    def load_extra_state(self, states: dict[str, dict[str, Any]]) -> None: ...


class Objective(Protocol):
    """What a loop asks of an objective. ``__call__`` runs one micro-batch: its loss summed over
    ``num_units(batch)`` loss units, and metric sums over the same units (only those named in
    ``requested_metrics``, None = all, set by the loop from its callbacks). ``setup(run,
    total_steps)`` runs once the policy is wrapped and the run's length is known (PPO builds its
    critic's training there); ``companions`` are the modules trained beside the policy. Every
    objective here states all five; a user's own objective for the offline loop may give only
    ``__call__`` and ``num_units`` (``train/build.py`` reads the others with defaults)."""

    requested_metrics: frozenset[str] | None
    companions: tuple[Companion, ...]

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput: ...
    def num_units(self, batch: Batch) -> Tensor | int: ...
    def setup(self, run: Run, total_steps: int) -> None: ...


class RolloutObjective(Objective, Protocol):
    """An objective of the online loop (``train/rl/loop.py``), which trains on rollouts: ``prepare``
    pins a fresh rollout's targets once (advantages, pairs, values); each optimizer step on it
    runs ``batches(rollout, grad_accum_steps)`` (with ``mini_batches`` > 1, ``batches(rollout,
    grad_accum_steps, samples)`` on that step's mini-batch of sample indices); under DDP a rank with fewer micro-batches than
    another runs ``filler_batch(rollout, batches)`` for each missing one, a pass whose loss and
    units the loop zeroes, so that every rank joins every gradient all-reduce."""

    def prepare(self, rollout: Rollout) -> None: ...
    def batches(self, rollout: Rollout, num_micro: int, samples: Tensor | None = None) -> list[Batch]: ...
    def filler_batch(self, rollout: Rollout, batches: list[Batch]) -> Batch: ...


def wants(requested: frozenset[str] | None, name: str) -> bool:
    """Whether metric `name` was asked for (``requested_metrics``; None asks for every one)."""
    return requested is None or name in requested


def computed(candidates: dict[str, Callable[[], Tensor]], requested: frozenset[str] | None) -> dict[str, Tensor]:
    """The requested metrics of `candidates` (name -> how to compute it), computed; the others never are."""
    return {name: compute() for name, compute in candidates.items() if wants(requested, name)}


def num_tokens(batch: Batch) -> Tensor | int:
    """Non-padding input tokens of a batch (every ``*attention_mask``), for throughput metrics."""
    masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
    if masks:
        return sum(m.sum() for m in masks)
    return sum(t.numel() for k, t in batch.items() if k.endswith("input_ids"))


def labelled_positions(labels: Tensor) -> Tensor | None:
    """Positions (K,) where at least one row has a label, or None when that is every position.

    Logits are only needed there: SFT prompts (and DPO prompts) carry no loss, so skipping their
    LM-head projection and softmax over the vocabulary saves work without changing the loss or
    its gradient.
    """
    keep = (labels != IGNORE_INDEX).any(dim=0)  # (T,)
    if bool(keep.all()):
        return None
    return keep.nonzero().squeeze(1)


def labelled_logps(model: Any, batch: Batch, layout: str = "pad", smoothing: bool = False) -> tuple[Any, Tensor, Tensor]:
    """(model output, log pi(label) (M,), mean_v log pi_v (M,) or None) of the M labelled tokens
    of a batch (its ``input_ids``, ``labels``, ``attention_mask``, ``position_ids``), row by row
    in order, through the chunked lm head at those tokens only, the rows in `layout`
    (``packing.forward_rows``): SFT, seq and DPO."""
    labels = batch["labels"]
    targets = labels[labels != IGNORE_INDEX]  # (M,) row by row, as forward_rows gathers them

    def head(hidden: Tensor, lm_head: nn.Module) -> HeadLogps:
        return head_logps(hidden, lm_head, targets, smoothing=smoothing)

    out, _ = forward_rows(model, batch, layout, head=head)
    return out, out.head.logps, out.head.mean_logps


def aux_coef(cfg: Config, model: nn.Module) -> float:
    """The MoE load-balancing weight: the model section overrides the loaded model's config.json."""
    default = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0)
    return float(cfg.model.get("router_aux_loss_coef", default))


def add_moe_terms(out: Any, loss: Tensor, units: Tensor, coef: float, metrics: dict[str, Tensor],
                  requested: frozenset[str] | None) -> Tensor:
    """loss + coef * aux_loss of the forward `out` (aux is a per-micro-batch mean, so it is
    weighted by the units); the requested MoE metrics go into `metrics`."""
    if out.aux_loss is None:
        return loss
    aux = out.aux_loss.float() * units
    candidates = {
        "task_loss": lambda: loss.detach(),
        "aux_loss": lambda: aux.detach(),
        "aux_loss_weighted": lambda: coef * aux.detach(),
    }
    for name, value in out.router_stats.items():
        value = value.detach().float()
        if value.ndim:  # per-expert loads: the busiest expert's share says how balanced routing is
            candidates[f"router/{name}_max"] = lambda v=value: v.max() * units
            candidates[f"router/{name}_min"] = lambda v=value: v.min() * units
        else:
            candidates[f"router/{name}"] = lambda v=value: v * units
    metrics.update(computed(candidates, requested))
    return loss + coef * aux


@torch.no_grad()
def update_reference(reference: nn.Module | None, policy: nn.Module, step: int, reset_interval: int,
                     ema: float | None) -> None:
    """After optimizer step `step`: ``ref_reset_interval`` (every that many steps the reference
    becomes the policy) and ``ref_ema`` (after each other step, reference = ema * reference +
    (1 - ema) * policy), parameter by parameter, the reference's names being the policy's."""
    reset = bool(reset_interval) and step % reset_interval == 0
    if reference is None or not (reset or ema is not None):
        return
    params = dict(policy.named_parameters())
    for name, ref in reference.named_parameters():
        if name not in params:
            raise ValueError(f"reference parameter {name!r} is not the policy's; ref_reset_interval and ref_ema need a "
                             "reference of the policy's architecture (drop ref_model_path or these settings)")
        if reset:
            ref.copy_(params[name])
        else:
            ref.lerp_(params[name].to(ref.dtype), 1 - ema)


def frozen_reference(ref_model_path: str | None, model: nn.Module) -> Any:
    """The reference of DPO and of the RL KL term: ref_model_path, else the initial policy: under
    LoRA the policy's own module with its adapters disabled (no copy of the weights), otherwise a
    frozen copy. Built before the policy is compiled or wrapped."""
    from astrai.model.lora import AdapterDisabled, has_lora

    if ref_model_path is None and has_lora(model):
        return AdapterDisabled(model)
    if ref_model_path is None:
        ref = copy.deepcopy(model)
    else:
        from astrai.model.hf import load_model

        ref = load_model(ref_model_path, device=next(model.parameters()).device)
    return ref.eval().requires_grad_(False)
