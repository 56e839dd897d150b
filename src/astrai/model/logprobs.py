"""Log-probabilities of chosen tokens: the one function that sampling and the losses share.

The engine records each generated token's log-prob with it, and the trainer recomputes the
same quantity under the current policy; both call `selective_log_softmax`, so behaviour and
training log-probs are computed identically (float32, same reduction order).
"""

from __future__ import annotations

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
