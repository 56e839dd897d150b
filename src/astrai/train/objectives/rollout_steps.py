"""The steps every objective that trains on scored samples (GRPO, PPO) composes, beside the
log-probs of ``logps.py``: which labelled tokens carry loss, the loss units (``rl_loss_agg``:
tokens or sequences), a rollout cut into micro-batches of whole samples, and the metrics they all
report (clip fractions, approx_kl, sampler_logp_diff, mismatch_kl, entropy, importance weights).

Plain functions of tensors, batches and config values: each objective calls the ones it needs
with its own settings, so no objective inherits another's steps. The arithmetic is
``train/losses.py``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from astrai.train.losses import IGNORE_INDEX, aggregate_token_loss, cispo_loss, clipped_surrogate, kl_estimate
from astrai.train.objectives.base import Batch, wants
from astrai.train.objectives.logps import Behaviour, PolicyLogps

if TYPE_CHECKING:
    from astrai.train.rl.data import Rollout

# how micro-batches go through the model (measured in benchmarks/bench_rl_scale.py): "share"
# (padding-free rows, each group's common prompt computed once), "pack" (padding-free rows),
# "sort" (samples sorted by length into micro-batches, each trimmed to its longest), "pad"
# (every micro-batch at the rollout's width, as before)
DEFAULT_LAYOUT = "share"


def loss_mask(batch: Batch, mask: Tensor) -> Tensor:
    """The labelled positions that carry loss: with ``mask_truncated_completions``, none of a
    completion cut off at ``rollout_max_tokens`` (the ``keep`` pinned per sample by ``pin_keep``)."""
    return mask & batch["keep"][:, None] if "keep" in batch else mask


def num_units(batch: Batch, agg: str) -> Tensor:
    """The batch's loss units under ``rl_loss_agg`` `agg`: loss tokens for token_mean, else samples
    that carry loss."""
    labelled = loss_mask(batch, batch["labels"] != IGNORE_INDEX)
    if agg == "token_mean":
        return labelled.sum()
    if "keep" in batch:
        return batch["keep"].sum()
    return torch.tensor(batch["labels"].size(0), device=batch["labels"].device)


def per_turn(rollout: Rollout) -> tuple[Tensor, Tensor | None]:
    """The scores (B, G) and per-turn rewards (N, T) a per-token estimator places: with
    ``turn_rewards`` the environment's rewards leave the episode's score and sit on their turns;
    otherwise the episode's reward as it is, and None."""
    if rollout.turn_rewards is None:
        return rollout.rewards, None
    return rollout.rewards - rollout.reward_terms["environment"], rollout.turn_rewards


def pin_keep(rollout: Rollout, mask_truncated: bool) -> None:
    """``mask_truncated_completions``: pin which samples carry loss (those that ended)."""
    if mask_truncated:
        rollout.pinned["keep"] = ~rollout.truncated


def micro_batches(rollout: Rollout, num_micro: int, layout: str, samples: Tensor | None = None) -> list[Batch]:
    """Micro-batches of whole samples (all of the rollout's, or the mini-batch `samples`), in order
    (or, layout "sort", longest first, so that each micro-batch holds samples of similar lengths)."""
    order = torch.arange(rollout.num_samples) if samples is None else samples
    if layout == "sort":
        order = order[rollout.attention_mask[order].sum(dim=1).argsort(descending=True, stable=True)]
    chunks = order.tensor_split(min(num_micro, len(order)))
    return [rollout.rows(idx) for idx in chunks if len(idx)]


def policy_surrogate(rl: Any, logps: Tensor, old: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor]:
    """The per-token policy loss of ``policy_loss`` (B, K) and where it clipped: PPO's clipped
    surrogate (with ``clip_eps``, ``clip_eps_high``, ``clip_ratio_c``) or CISPO's."""
    if rl.policy_loss == "cispo":
        return cispo_loss(logps, old, advantages, rl.clip_eps, rl.clip_eps_high)
    return clipped_surrogate(logps, old, advantages, rl.clip_eps, rl.clip_eps_high, rl.clip_ratio_c)


def per_unit(per_token: Tensor, mask: Tensor, agg: str) -> Tensor:
    """A per-token metric summed over the loss units of ``rl_loss_agg`` `agg` (a token or a
    sequence mean once the window divides by its units)."""
    return aggregate_token_loss(per_token, mask, "token_mean" if agg == "token_mean" else "seq_mean")[0]


def common_metrics(pol: PolicyLogps, mask: Tensor, beh: Behaviour, clipped: Tensor, sampler: Tensor, agg: str,
                   requested: frozenset[str] | None) -> dict[str, Tensor]:
    """The metrics every rollout objective reports, computed only when asked for (TRL / verl
    names where they exist): clip fractions (all, below 1 - eps, above 1 + eps_high), approx_kl
    to the old policy, sampler_logp_diff and mismatch_kl, the policy's mean token entropy, importance weights."""
    diff_old, diff_sampler = pol.logps.detach() - beh.old, pol.logps.detach() - sampler
    candidates = {
        "clip_fraction": lambda: clipped.float(),
        "clip_fraction_low": lambda: (clipped & (diff_old < 0)).float(),  # ratio below 1 - clip_eps
        "clip_fraction_high": lambda: (clipped & (diff_old > 0)).float(),  # ratio above 1 + clip_eps_high
        "approx_kl": lambda: 0.5 * diff_old**2,  # between the current and the old policy
        "sampler_logp_diff": lambda: diff_sampler.abs(),  # |trainer - sampler| log-prob; ~0 on a fresh rollout
        # k3 estimate of KL(trainer || sampler): the policy trained against the one that drew (async_steps: k behind)
        "mismatch_kl": lambda: kl_estimate(pol.logps.detach(), sampler, "k3"),
        "entropy": lambda: pol.entropy.detach(),  # computed chunk by chunk by token_logps when asked for
        "is_weight_mean": lambda: beh.weights,
        "is_weight_capped_fraction": lambda: beh.capped.float(),
    }
    return {k: per_unit(f(), mask, agg) for k, f in candidates.items() if wants(requested, k)}
