"""What every objective shares: ``LossOutput``, metric requests, the MoE terms, the frozen reference,
and, for objectives that train on rollouts, token log-probs, loss units and micro-batches.

Sits between a loop and ``train/losses.py``: an objective runs the model forward on a batch and
hands the outputs to the pure loss functions, which hold all the arithmetic. Loops normalise by
the whole accumulation window, so every objective reports *sums* over its loss units (loss tokens
for seq/sft, preference pairs for dpo, tokens or sequences for RL): ``loss`` and each metric are
divided by the window's unit count (all ranks) in ``train/step.py``. Metrics are computed only
when requested: the loop sets ``requested_metrics`` to the names its callbacks read (None = all).

What a loop may ask of an objective beyond ``__call__`` and ``num_units`` is stated here once:
``setup(run, total_steps)`` after the policy is wrapped (PPO builds its critic's training there),
``companions`` (modules trained beside the policy on the same micro-batches, each with its own
optimizer and gradient step), and for online objectives ``prepare`` / ``batches``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from astrai.config import Config, RLConfig
from astrai.model.chunked_head import HeadLogps, head_logps
from astrai.train.dist import unwrap_model
from astrai.train.losses import IGNORE_INDEX, aggregate_token_loss, importance_weights
from astrai.train.objectives.packing import RowLayout

if TYPE_CHECKING:
    from astrai.train.build import Run

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


def labelled_logps(model: Any, batch: Batch, prefix: str = "", smoothing: bool = False) -> tuple[Any, Tensor, Tensor]:
    """(model output, log pi(label) (M,), mean_v log pi_v (M,) or None) of the M labelled tokens
    of a batch (its ``{prefix}input_ids``, ``labels``, ``attention_mask``, ``position_ids``), row
    by row in order, through the chunked lm head at those tokens only: SFT and DPO."""
    labels = batch[f"{prefix}labels"]
    idx = labelled_positions(labels)
    mask = labels != IGNORE_INDEX
    if idx is not None:
        mask = mask[:, idx]  # (B, K)
        labels = labels[:, idx]

    def head(hidden: Tensor, lm_head: nn.Module) -> HeadLogps:
        return head_logps(hidden[mask], lm_head, labels[mask], smoothing=smoothing)

    out = model(batch[f"{prefix}input_ids"], attention_mask=batch.get(f"{prefix}attention_mask"),
                position_ids=batch.get(f"{prefix}position_ids"), logits_indices=idx, head=head)
    return out, out.head.logps, out.head.mean_logps


def aux_coef(cfg: Config, model: nn.Module) -> float:
    """The MoE load-balancing weight: the model section overrides the loaded model's config.json."""
    default = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0)
    return float(cfg.model.get("router_aux_loss_coef", default))


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


class Objective:
    """What every objective shares: which of its metrics anyone asked for, the MoE terms, and the
    loop hooks that most objectives leave empty."""

    requested_metrics: frozenset[str] | None = None  # None: compute every metric
    companions: tuple[Companion, ...] = ()

    def wants(self, name: str) -> bool:
        return self.requested_metrics is None or name in self.requested_metrics

    def setup(self, run: Run, total_steps: int) -> None:
        """Called once the policy is wrapped and the run's length is known; nothing by default."""

    def _add_moe_terms(self, out: Any, loss: Tensor, units: Tensor, coef: float, metrics: dict[str, Tensor]) -> Tensor:
        """loss + coef * aux_loss (aux is a per-micro-batch mean, so it is weighted by the units)."""
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
        metrics.update({name: compute() for name, compute in candidates.items() if self.wants(name)})
        return loss + coef * aux


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


def token_logps(model: Any, batch: Batch, rl: RLConfig, entropy: bool = False, layout: str = "share") -> PolicyLogps:
    """The labelled tokens' log-probs under the distribution the rollout sampler drew from:
    logits / rollout_temperature, truncated to rollout_top_k and rollout_top_p and renormalised
    (docs/training.md, "The log-prob contract"); temperature 0 (greedy) uses the plain logits, as
    the sampler does. The rows run through the model in `layout` (``packing.py``: padding-free by
    default) and the lm head runs chunked on the labelled tokens only (``model/chunked_head.py``:
    no (rows, vocab) logits tensor); results come back in the padded (B, K) layout, 0 off-label."""
    labels = batch["labels"]
    labelled = labels != IGNORE_INDEX
    if layout == "share" and getattr(getattr(unwrap_model(model), "config", None), "num_experts", 0):
        layout = "pack"  # MoE routing statistics count tokens: a shared prompt must count once per sample
    rows = RowLayout.build(batch["attention_mask"], labelled, layout, batch["input_ids"])
    keep = rows.keep()
    targets = labels[rows.src]  # (M,)

    def head(hidden: Tensor, lm_head: nn.Module) -> HeadLogps:
        return head_logps(rows.gather(hidden, keep), lm_head, targets, rl.rollout_temperature, rl.rollout_top_k,
                          rl.rollout_top_p, entropy=entropy)

    out = model(**rows.inputs(batch["input_ids"], batch["attention_mask"]), logits_indices=keep, head=head)
    idx = labelled_positions(labels)
    mask = labelled if idx is None else labelled[:, idx]  # (B, K)
    ent = rows.scatter(out.head.entropy, idx) if entropy else None
    return PolicyLogps(rows.scatter(out.head.logps, idx), mask, idx, ent, out.aux_loss, out.router_stats, rows)


@torch.no_grad()
def reference_logps(reference: Any, rollout: Any, rl: RLConfig, device: torch.device) -> Tensor:
    """The reference's log-probs (N, T) of a rollout's labels (0 where no label), in chunks of 16
    samples: for KL terms folded into per-token rewards (PPO, REINFORCE++)."""
    out = torch.zeros(rollout.labels.shape)
    for rows in torch.arange(rollout.num_samples).split(16):
        batch = {"input_ids": rollout.input_ids[rows].to(device), "attention_mask": rollout.attention_mask[rows].to(device),
                 "labels": rollout.labels[rows].to(device)}
        ref = token_logps(reference, batch, rl)
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


class RolloutObjective(Objective):
    """Objectives that train on scored samples (GRPO, PPO): loss units follow ``rl_loss_agg``
    (tokens, or sequences), a rollout splits into micro-batches of whole samples, and online ones
    correct the sampler-trainer mismatch (``behaviour``)."""

    online = False
    # how micro-batches go through the model (measured in benchmarks/bench_rl_scale.py): "share"
    # (padding-free rows, each group's common prompt computed once), "pack" (padding-free rows),
    # "sort" (samples sorted by length into micro-batches, each trimmed to its longest), "pad"
    # (every micro-batch at the rollout's width, as before)
    layout = "share"

    def __init__(self, rl: RLConfig):
        self.rl = rl
        self.agg = rl.rl_loss_agg
        self.is_level, self.is_cap = rl.rollout_is_level, rl.rollout_is_cap
        self.mask_truncated = rl.mask_truncated_completions

    def loss_mask(self, batch: Batch, mask: Tensor) -> Tensor:
        """The labelled positions that carry loss: with ``mask_truncated_completions``, none of a
        completion cut off at ``rollout_max_tokens`` (the ``keep`` pinned per sample)."""
        return mask & batch["keep"][:, None] if "keep" in batch else mask

    def num_units(self, batch: Batch) -> Tensor:
        labelled = self.loss_mask(batch, batch["labels"] != IGNORE_INDEX)
        if self.agg == "token_mean":
            return labelled.sum()
        if "keep" in batch:
            return batch["keep"].sum()
        return torch.tensor(batch["labels"].size(0), device=batch["labels"].device)

    def prepare_truncation(self, rollout: Any) -> None:
        """``mask_truncated_completions``: pin which samples carry loss (those that ended)."""
        if self.mask_truncated:
            rollout.pinned["keep"] = ~rollout.truncated

    def prepare_behaviour(self, rollout: Any) -> None:
        """A fresh rollout: the trainer's log-probs at its weights are not known yet (NaN); the
        first step on it computes them (the weights have not moved since sampling) and pins them.
        Positions without a label hold 0 (a checkpoint's rollout must be finite)."""
        unknown = torch.full(rollout.old_logps.shape, math.nan)
        rollout.trainer_logps = torch.where(rollout.labels != IGNORE_INDEX, unknown, 0.0)

    def batches(self, rollout: Any, num_micro: int) -> list[Batch]:
        """Micro-batches of whole samples, in order (or, layout "sort", longest first, so that
        each micro-batch holds samples of similar lengths)."""
        order = torch.arange(rollout.num_samples)
        if self.layout == "sort":
            order = rollout.attention_mask.sum(dim=1).argsort(descending=True, stable=True)
        chunks = order.tensor_split(min(num_micro, rollout.num_samples))
        return [rollout.rows(idx) for idx in chunks if len(idx)]

    def logps(self, model: Any, batch: Batch, entropy: bool = False) -> PolicyLogps:
        """``token_logps`` in this objective's layout."""
        return token_logps(model, batch, self.rl, entropy, "trim" if self.layout == "sort" else self.layout)

    def behaviour(self, batch: Batch, logps: Tensor, mask: Tensor, idx: Tensor | None) -> Behaviour:
        """The ratio's denominator and the importance weights (docs/training.md, "The log-prob
        contract"). Offline records, and rows without behaviour log-probs (NaN), use the policy's
        own log-probs: weights 1."""
        def at(key: str) -> Tensor:
            return batch[key] if idx is None else batch[key][:, idx]

        current = logps.detach()
        sampler = torch.where(torch.isnan(at("old_logps")), current, at("old_logps"))
        if not self.online or "trainer_logps" not in batch:
            return Behaviour(sampler, mask.float(), torch.zeros_like(mask), {})
        known = at("trainer_logps")
        old = torch.where(torch.isnan(known), current, known)  # NaN: this is the rollout's first step
        weights, capped = importance_weights(old, sampler, mask, self.is_level, self.is_cap)
        full = batch["trainer_logps"].clone()
        full[:, idx if idx is not None else slice(None)] = old
        return Behaviour(old, weights, capped, {"trainer_logps": full})

    def per_unit(self, per_token: Tensor, mask: Tensor) -> Tensor:
        """A per-token metric summed over this objective's loss units (a token or a sequence mean
        once the window divides by its units)."""
        return aggregate_token_loss(per_token, mask, "token_mean" if self.agg == "token_mean" else "seq_mean")[0]

    def common_metrics(self, pol: PolicyLogps, mask: Tensor, beh: Behaviour, clipped: Tensor,
                       sampler: Tensor) -> dict[str, Tensor]:
        """The metrics every rollout objective reports, computed only when asked for (TRL / verl
        names where they exist): clip fractions (all, below 1 - eps, above 1 + eps_high), approx_kl
        to the old policy, sampler_logp_diff, the policy's mean token entropy, importance weights."""
        diff_old, diff_sampler = pol.logps.detach() - beh.old, pol.logps.detach() - sampler
        candidates = {
            "clip_fraction": lambda: clipped.float(),
            "clip_fraction_low": lambda: (clipped & (diff_old < 0)).float(),  # ratio below 1 - clip_eps
            "clip_fraction_high": lambda: (clipped & (diff_old > 0)).float(),  # ratio above 1 + clip_eps_high
            "approx_kl": lambda: 0.5 * diff_old**2,  # between the current and the old policy
            "sampler_logp_diff": lambda: diff_sampler.abs(),  # |trainer - sampler| log-prob; ~0 on a fresh rollout
            "entropy": lambda: pol.entropy,  # computed chunk by chunk by token_logps when asked for
            "is_weight_mean": lambda: beh.weights,
            "is_weight_capped_fraction": lambda: beh.capped.float(),
        }
        return {k: self.per_unit(f(), mask) for k, f in candidates.items() if self.wants(k)}
