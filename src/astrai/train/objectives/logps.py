"""The log-probs a rollout objective compares: the policy's (``token_logps``), the reference's
(``reference_logps``) and the behaviour side of the ratio (``behaviour``: the old log-probs and
the importance weights for the sampler-trainer mismatch).

Sits between the rollout objectives (``grpo.py``, ``ppo.py``) and the model: every labelled token
is scored under the distribution the rollout sampler drew it from, read from the one function
that states it (``rl/sampler.py: rollout_sampling``), through the chunked lm head and the row
layouts of ``packing.py``. docs/training.md, "The log-prob contract", says why the ratio's old
log-probs are the trainer's own and the sampler's enter only through the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from astrai.model.chunked_head import HeadLogps, head_logps
from astrai.train.losses import IGNORE_INDEX, importance_weights
from astrai.train.objectives.base import Batch, labelled_positions
from astrai.train.objectives.packing import RowLayout, forward_rows
from astrai.train.rl.sampler import RolloutSampling

if TYPE_CHECKING:
    from astrai.train.rl.data import Rollout


@dataclass
class PolicyLogps:
    """What ``token_logps`` gives an objective, at the labelled positions ``idx`` (K,) of the
    padded rows (every position when None): log-probs and loss mask (B, K), the entropy metric
    (B, K) when asked for, and the forward's MoE terms."""

    logps: Tensor
    mask: Tensor
    idx: Tensor | None
    entropy: Tensor | None = None
    aux_loss: Tensor | None = None
    router_stats: dict[str, Tensor] = field(default_factory=dict)
    rows: RowLayout | None = None  # how the rows went through the model (PPO's critic runs them the same way)


def token_logps(model: Any, batch: Batch, sampling: RolloutSampling, entropy: bool = False,
                layout: str = "share", entropy_grad: bool = False) -> PolicyLogps:
    """The labelled tokens' log-probs under the distribution the rollout sampler drew from:
    logits / temperature, truncated to top_k and top_p and renormalised (docs/training.md, "The
    log-prob contract"); temperature 0 (greedy) uses the plain logits, as the sampler does. The
    rows run through the model in `layout` (``packing.py``: padding-free by default; "sort" runs
    each micro-batch trimmed to its longest row) and the lm head runs chunked on the labelled
    tokens only (``model/chunked_head.py``: no (rows, vocab) logits tensor); results come back in
    the padded (B, K) layout, 0 off-label. `entropy_grad`: the entropy carries a gradient (an
    entropy bonus in the loss), else it is a detached metric. A batch with ``routing``
    (``routing_replay``) runs a MoE policy on the experts the sampler chose per token."""
    labels = batch["labels"]
    labelled = labels != IGNORE_INDEX
    layout = "trim" if layout == "sort" else layout
    targets = labels[labelled]  # (M,) row by row, as forward_rows gathers them

    # a repetition penalty reads each labelled token's context: its row of input_ids up to its column
    context = (batch["input_ids"], *labelled.nonzero(as_tuple=True)) if sampling.repetition_penalty != 1.0 else None

    def head(hidden: Tensor, lm_head: nn.Module) -> HeadLogps:
        return head_logps(hidden, lm_head, targets, sampling.temperature, sampling.top_k,
                          sampling.top_p, entropy=entropy, entropy_grad=entropy_grad, min_p=sampling.min_p,
                          repetition_penalty=sampling.repetition_penalty, context=context)

    out, rows = forward_rows(model, batch, layout, labelled, head)
    idx = labelled_positions(labels)
    mask = labelled if idx is None else labelled[:, idx]  # (B, K)
    ent = rows.scatter(out.head.entropy, idx) if entropy else None
    return PolicyLogps(rows.scatter(out.head.logps, idx), mask, idx, ent, out.aux_loss, out.router_stats, rows)


@torch.no_grad()
def reference_logps(reference: Any, rollout: Rollout, sampling: RolloutSampling, device: torch.device) -> Tensor:
    """The reference's log-probs (N, T) of a rollout's labels (0 where no label), in chunks of 16
    samples: for KL terms folded into per-token rewards (PPO, REINFORCE++)."""
    out = torch.zeros(rollout.labels.shape)
    for rows in torch.arange(rollout.num_samples).split(16):
        batch = {"input_ids": rollout.input_ids[rows].to(device), "attention_mask": rollout.attention_mask[rows].to(device),
                 "labels": rollout.labels[rows].to(device)}
        ref = token_logps(reference, batch, sampling)
        full = torch.zeros(len(rows), out.size(1))
        full[:, ref.idx if ref.idx is not None else slice(None)] = ref.logps.cpu()
        out[rows] = full
    return out


@dataclass
class Behaviour:
    """What a rollout objective compares its log-probs with, at the labelled positions (B, K):
    ``old`` is the ratio's denominator (the trainer's own log-prob at the rollout's weights),
    ``weights`` the truncated importance weights for the sampler-trainer mismatch, ``capped`` where
    the cap bit, and ``pins`` what the loop stores on the rollout for the steps that reuse it."""

    old: Tensor
    weights: Tensor
    capped: Tensor
    pins: dict[str, Tensor]


def at_labels(batch: Batch, key: str, idx: Tensor | None) -> Tensor:
    """A (B, T) batch field at the labelled positions `idx` (B, K) (all of it when None)."""
    return batch[key] if idx is None else batch[key][:, idx]


def behaviour(batch: Batch, logps: Tensor, mask: Tensor, idx: Tensor | None, online: bool, rl: Any) -> Behaviour:
    """The ratio's denominator and the importance weights (docs/training.md, "The log-prob
    contract"). Offline records (`online` false), and rows without behaviour log-probs (NaN), use
    the policy's own log-probs: weights 1. Online, the first step on a rollout takes the trainer's
    log-probs (`logps`, at the rollout's weights) as the old ones and pins them. The weights follow
    `rl`'s ``rollout_is_level``, ``rollout_is_mode``, ``rollout_is_cap`` and ``rollout_is_min``."""
    current, recorded = logps.detach(), at_labels(batch, "old_logps", idx)
    sampler = torch.where(torch.isnan(recorded), current, recorded)
    if not online or "trainer_logps" not in batch:
        return Behaviour(sampler, mask.float(), torch.zeros_like(mask), {})
    known = at_labels(batch, "trainer_logps", idx)
    old = torch.where(torch.isnan(known), current, known)  # NaN: this is the rollout's first step
    weights, capped = importance_weights(old, sampler, mask, rl.rollout_is_level, rl.rollout_is_cap,
                                         rl.rollout_is_mode, rl.rollout_is_min)
    full = batch["trainer_logps"].clone()
    full[:, idx if idx is not None else slice(None)] = old
    return Behaviour(old, weights, capped, {"trainer_logps": full})


def trainer_logps_pins(objective: Any, model: Any, batch: Batch) -> dict[str, Tensor]:
    """The ``trainer_logps`` pin of `batch` from a forward of `objective`'s log-probs (no loss): what
    ``behaviour`` pins on a rollout's first step, taken before any step when the rollout's steps
    train on mini-batches (the later ones would otherwise see moved weights as the old ones)."""
    pol = objective.logps(model, batch)
    full = batch["trainer_logps"].clone()
    full[:, pol.idx if pol.idx is not None else slice(None)] = pol.logps.detach().to(full.dtype)
    return {"trainer_logps": full}


def unknown_trainer_logps(rollout: Rollout) -> None:
    """A fresh rollout: the trainer's log-probs at its weights are not known yet (NaN); the first
    step on it computes them (the weights have not moved since sampling) and pins them (see
    ``behaviour``). Positions without a label hold 0 (a checkpoint's rollout must be finite)."""
    unknown = torch.full(rollout.old_logps.shape, math.nan)
    rollout.trainer_logps = torch.where(rollout.labels != IGNORE_INDEX, unknown, 0.0)
