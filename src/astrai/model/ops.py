"""Elementwise building blocks with hand-written backward passes: RMSNorm and rotary embeddings.

Autograd differentiates a composite RMSNorm op by op (square, mean, add, rsqrt, two products),
saving every intermediate and replaying a dozen elementwise kernels backwards; rotary embeddings
cost a negation, a concatenation and two broadcast products each way. On a CPU every one of
those kernels is a full pass over the activations, and for small models these passes cost about
as much as the matrix products. Written out by hand both need fewer passes and save less:

    RMSNorm:  y = xhat * w,  xhat = x * r,  r = 1 / sqrt(mean(x^2) + eps)
              dw = sum_rows(g * xhat),   dx = r * (g*w - xhat * mean(g*w * xhat))
    RoPE:     y = x * cos + rotate(x) * sin,  rotate(x1, x2) = (-x2, x1)
              dx = g * cos + rotate^T(g * sin),  rotate^T(y1, y2) = (y2, -y1)

Without gradients (inference, evaluation) the same forward arithmetic runs without the
`autograd.Function` wrapper, whose bookkeeping matters at decode batch sizes. Statistics are
taken in float32 for low-precision inputs, as the composite versions did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable


def _stat_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _rms_norm_parts(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, xhat, r): xhat = x / rms(x) in the statistics dtype, r = 1 / rms(x) of shape (..., 1)."""
    xf = x.to(_stat_dtype(x))
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
    xhat = xf * r
    # the weight multiplies in the input dtype (the usual Llama convention for bf16)
    return xhat.to(x.dtype) * weight, xhat, r


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, xhat, r = _rms_norm_parts(x, weight, eps)
        ctx.save_for_backward(xhat, r, weight)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        xhat, r, weight = ctx.saved_tensors
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (g.to(xhat.dtype) * xhat).reshape(-1, xhat.size(-1)).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            gw = (g * weight).to(xhat.dtype)
            dot = (gw * xhat).mean(-1, keepdim=True)
            dx = gw.sub_(xhat * dot).mul_(r).to(ctx.x_dtype)
        return dx, dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    if x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64):
        # torch's fused kernel: one pass instead of six (same arithmetic as the parts below, and
        # the same numbers; in low precision the weight's dtype convention differs, so not there)
        return F.rms_norm(x, (x.size(-1),), weight, eps)
    return _rms_norm_parts(x, weight, eps)[0]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, transpose: bool) -> Tensor:
    """x * cos + rotate(x) * sin, or x * cos + rotate^T(x * sin) when `transpose`; rotate(x) is
    never materialised."""
    h = x.shape[-1] // 2
    out = x * cos
    if transpose:
        out[..., :h].addcmul_(x[..., h:], sin[..., h:])
        out[..., h:].addcmul_(x[..., :h], sin[..., :h], value=-1.0)
    else:
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1.0)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, transpose=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, sin, transpose=True), None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, H, D); cos/sin (B, T, D). Rotates the two halves of each head (HF convention)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if torch.is_grad_enabled() and x.requires_grad and not (cos.requires_grad or sin.requires_grad):
        return _Rope.apply(x, cos, sin)
    return _rotate(x, cos, sin, transpose=False)
