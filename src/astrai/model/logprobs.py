"""Log-probabilities of chosen tokens and the truncation of a distribution: what sampling and the
losses share.

The engine records each generated token's log-prob with it, and the trainer recomputes the
same quantity under the current policy; both call `selective_log_softmax`, so behaviour and
training log-probs are computed identically (float32, same reduction order). Truncation (top_k,
top_p, min_p: `apply_truncation`) is here for the same reason: the sampler draws from the
truncated, renormalised distribution and records its log-prob, and online RL's trainer applies
the same truncation (`truncated_token_logps`) so that its log-prob of a token equals the
sampler's when the weights are the ones that drew it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def selective_log_softmax(logits: Tensor, ids: Tensor) -> Tensor:
    """log_softmax(logits)[..., ids] in float32 without materialising the full log-softmax.

    logits (..., V), ids (...) int64 -> (...) float32.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1)  # (...)
    return picked - torch.logsumexp(logits, dim=-1)


def log_softmax(logits: Tensor) -> Tensor:
    """Full float32 log-softmax over the vocabulary (for top-N alternatives)."""
    return torch.log_softmax(logits.float(), dim=-1)


TOP_P_CANDIDATES = 1024  # a top_p row first looks for its cutoff among this many most likely tokens


def apply_truncation(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Mask logits (B, V) outside top_k (B,) long (V = off), then top_p (B,) of the renormalised
    rest, then below min_p (B,) times the top probability. Masked entries become -inf."""
    V = logits.shape[-1]
    cut = (top_k < V) | (top_p < 1.0)  # (B,) rows that truncate
    if bool(cut.any()):
        rows = cut.nonzero()[:, 0]
        kept = _top_k_top_p(logits[rows], top_k[rows], top_p[rows])
        logits = logits.index_copy(0, rows, kept)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, -math.inf)
    return logits


def _top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """top_k, then top_p, on rows that use at least one of them. Only the K most likely tokens of
    each row are sorted (K = the largest top_k, or TOP_P_CANDIDATES for a row with top_p alone,
    which covers the top_p mass of any peaked distribution); when some top_p row's cutoff lies
    beyond them, the whole vocabulary is sorted instead."""
    V = logits.shape[-1]
    has_k = top_k < V
    k = int(top_k[has_k].max()) if bool(has_k.any()) else 0
    if bool((~has_k & (top_p < 1.0)).any()):
        k = max(k, TOP_P_CANDIDATES)
    k = min(k, V)
    while True:
        vals, order = logits.topk(k, dim=-1) if k < V else _sort_descending(logits)  # (R, k), most likely first
        ranks = torch.arange(k, device=logits.device)[None]
        vals = vals.masked_fill(ranks >= top_k[:, None], -math.inf)
        # probabilities under the top_k-truncated distribution: a row without top_k normalises
        # over its whole vocabulary, not over the candidates
        norm = vals.logsumexp(dim=-1)  # (R,)
        if not bool(has_k.all()):
            norm = torch.where(has_k, norm, logits.logsumexp(dim=-1))
        probs = (vals - norm[:, None]).exp()
        mass = probs.cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p; the first token always survives
        drop = (mass - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
        short = ~has_k & (top_p < 1.0) & (mass[:, -1] < top_p)  # cutoff may lie past the candidates
        if k == V or not bool(short.any()):
            break
        k = V
    vals = vals.masked_fill(drop, -math.inf)
    return torch.full_like(logits, -math.inf).scatter_(1, order, vals)


def _sort_descending(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of x (B, V) sorted, largest first, and the order. On CPU numpy's sort is several
    times faster than torch's for vocabulary-sized rows; equal values may come in either order."""
    if x.device.type != "cpu":
        return x.sort(dim=-1, descending=True)
    order = torch.from_numpy(np.argsort(-x.numpy(), axis=-1))
    return x.gather(1, order), order


def truncated_token_logps(logits: Tensor, ids: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """log pi(ids) under `logits` truncated as the sampler truncates them (top_k, then top_p of
    the renormalised rest), float32; gradients flow through the kept logits.

    logits (..., V) (already divided by the temperature), ids (...) int64 -> (...). The kept set
    is chosen on detached values, and the token itself is always kept: the sampler drew it, so a
    rounding difference at the nucleus boundary must not turn its log-prob into -inf.
    """
    V = logits.shape[-1]
    if (top_k <= 0 or top_k >= V) and top_p >= 1.0:
        return selective_log_softmax(logits, ids)
    flat, flat_ids = logits.float().reshape(-1, V), ids.reshape(-1)  # (N, V), (N,)
    N = flat.shape[0]
    k = torch.full((N,), top_k if 0 < top_k < V else V, device=flat.device)
    p = torch.full((N,), float(top_p), device=flat.device)
    kept = torch.isfinite(apply_truncation(flat.detach(), k, p, torch.zeros(N, device=flat.device)))  # (N, V)
    kept[torch.arange(N, device=flat.device), flat_ids] = True
    out = selective_log_softmax(flat.masked_fill(~kept, -math.inf), flat_ids)
    return out.reshape(ids.shape)
