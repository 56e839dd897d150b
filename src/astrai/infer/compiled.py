"""Optional compiled decode (`EngineConfig.compile`): the token-wise work of decode steps under
`torch.compile`, for fixed batch-size buckets.

A decode step runs every layer over one token per sequence. Its matrix products and elementwise
work (the SwiGLU MLP: two projections, SiLU, product, down projection) depend only on the
number of tokens, so they compile to one graph per token count; attention over the paged cache
(whose context lengths change every step) stays eager. To keep the number of graphs small and
fixed, a step's rows are padded up to the next bucket (1, 2, 4, ... up to `max_num_seqs`) and
the padding rows are dropped afterwards. The same bucketing is what CUDA graphs need on a GPU.
One compiled function serves every layer (the weights are its arguments), so the warm-up
compiles one graph per bucket, not per layer. Prefill steps, and anything run with gradients,
take the eager path. Padding rows never mix with real ones (each row of a matrix product is its
own), so greedy tokens equal eager ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.model.moe import MLP

logger = logging.getLogger(__name__)


def swiglu(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    """The dense MLP of a decoder layer, as a function of its weights: (..., C) -> (..., C)."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two up to the first one that holds max_num_seqs rows."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    return buckets


class CompiledDecode:
    """Routes the dense MLPs of a model through one compiled function while `active` (the runner
    turns it on for decode-only steps)."""

    def __init__(self, model: nn.Module, max_num_seqs: int) -> None:
        self.buckets = decode_buckets(max_num_seqs)
        self.active = False
        self.compiled = torch.compile(swiglu, dynamic=False)
        self.mlps = [m for m in model.modules() if isinstance(m, MLP)]
        self.warmup_seconds = 0.0
        self.num_calls = 0  # MLP calls that ran compiled
        for mlp in self.mlps:  # an instance attribute: parameter names and state_dict stay as they are
            mlp.forward = self._forward_of(mlp)

    def _forward_of(self, mlp: MLP) -> Callable[..., Tensor]:
        def forward(x: Tensor, norm: nn.Module | None = None) -> Tensor:
            n = x.size(-2)
            if not self.active or torch.is_grad_enabled() or n > self.buckets[-1]:
                return MLP.forward(mlp, x, norm)
            if norm is not None:
                x = norm(x)
            weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
            bucket = next(b for b in self.buckets if b >= n)
            padded = F.pad(x, (0, 0, 0, bucket - n)) if bucket != n else x  # (..., bucket, C)
            self.num_calls += 1
            return self.compiled(padded, *weights)[..., :n, :]

        return forward

    def warm_up(self) -> float:
        """Compile every bucket now (not on a request's first step); returns and logs the seconds."""
        if not self.mlps:
            return 0.0
        mlp = self.mlps[0]
        start = time.perf_counter()
        with torch.inference_mode():
            weight = mlp.gate_proj.weight
            for bucket in self.buckets:
                x = torch.zeros(1, bucket, weight.size(1), dtype=weight.dtype, device=weight.device)
                self.compiled(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        self.warmup_seconds = time.perf_counter() - start
        logger.info("compiled decode: %d batch-size buckets %s in %.1f s", len(self.buckets), self.buckets,
                    self.warmup_seconds)
        return self.warmup_seconds

    def remove(self) -> None:
        """Back to plain eager modules."""
        for mlp in self.mlps:
            mlp.__dict__.pop("forward", None)

    def describe(self) -> dict:
        return {"buckets": self.buckets, "warmup_seconds": round(self.warmup_seconds, 2),
                "num_layers": len(self.mlps)}
