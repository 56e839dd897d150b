"""Building blocks with hand-written backward passes: RMSNorm, rotary embeddings, the SwiGLU MLP.

Autograd differentiates a composite RMSNorm op by op (square, mean, add, rsqrt, two products),
saving every intermediate and replaying a dozen elementwise kernels backwards; rotary embeddings
cost a negation, a concatenation and two broadcast products each way. On a CPU every one of
those kernels is a full pass over the activations, and for small models these passes cost about
as much as the matrix products. Written out by hand both need fewer passes and save less:

    RMSNorm:  y = xhat * w,  xhat = x * r,  r = 1 / sqrt(mean(x^2) + eps)
              dw = sum_rows(g * xhat),   dx = r * (g*w - xhat * mean(g*w * xhat))
    RoPE:     y = x * cos + rotate(x) * sin,  rotate(x1, x2) = (-x2, x1)
              dx = g * cos + rotate^T(g * sin),  rotate^T(y1, y2) = (y2, -y1)

The SwiGLU MLP `y = down(silu(gate(x)) * up(x))` differentiated op by op saves four tensors of
the intermediate width per token (gate(x), up(x), silu(gate(x)) and the product that enters
`down`), which is 60% of a Llama layer's saved activations. Its backward needs only two of them:

    s = silu(g),  h = s * u:   dWd = dy^T h,  dh = dy Wd,  du = dh * s,
                               dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
                               dx = dg Wg + du Wu,  dWg = dg^T x,  dWu = du^T x

so it saves x, g and u and recomputes s and h (elementwise, no matrix product) in backward,
reusing their buffers for du and dg (`silu_backward` writes dg in one pass). A
pre-norm can run inside it (and inside `norm_linears`, the attention's q, k and v): then the norm's
xhat and 1/rms are saved instead of x, and the normed input is rebuilt from them in backward.

Without gradients (inference, evaluation) the same forward arithmetic runs without the
`autograd.Function` wrapper, whose bookkeeping matters at decode batch sizes. Statistics are
taken in float32 for low-precision inputs, as the composite versions did.
"""

from __future__ import annotations

import contextlib

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
        return (*_rms_norm_grads(g, xhat, r, weight, ctx.x_dtype, *ctx.needs_input_grad[:2]), None)


def _rms_norm_grads(g: Tensor, xhat: Tensor, r: Tensor, weight: Tensor, x_dtype: torch.dtype,
                    need_x: bool, need_w: bool) -> tuple[Tensor | None, Tensor | None]:
    """(dx, dw) of RMSNorm for the output gradient g, from its saved xhat and r."""
    dw = None
    if need_w:
        dw = (g.to(xhat.dtype) * xhat).reshape(-1, xhat.size(-1)).sum(0).to(weight.dtype)
    dx = None
    if need_x:
        gw = (g * weight).to(xhat.dtype)
        dot = (gw * xhat).mean(-1, keepdim=True)
        dx = gw.sub_(xhat * dot).mul_(r).to(x_dtype)
    return dx, dw


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


# -- pre-normed projections: the norm's output is recomputed in backward, never saved -----------
def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the matrix products: autocast's when it is on (as for the composite's
    linears), else the input's."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _no_autocast(x: Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on x's device (the inputs are cast explicitly), where autocast exists."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()


class _Input:
    """The input of a projection block, optionally RMS-normed first. Forward saves xhat and r of
    the norm (or the cast input without one); backward recomputes the normed input from them and
    turns its gradient into the gradients of x and of the norm's weight."""

    def __init__(self, x: Tensor, norm_weight: Tensor | None, eps: float, dtype: torch.dtype) -> None:
        self.x_dtype, self.dtype = x.dtype, dtype
        if norm_weight is None:
            self.value = x.to(dtype)
            self.saved: tuple[Tensor, ...] = (self.value,)
        else:
            y, xhat, r = _rms_norm_parts(x, norm_weight, eps)
            self.y_dtype, self.value, self.saved = y.dtype, y.to(dtype), (xhat, r, norm_weight)

    def restore(self, saved: tuple[Tensor, ...]) -> Tensor:
        """The (cast) block input again, from the tensors `saved` held."""
        if len(saved) == 1:
            return saved[0]
        xhat, _, weight = saved
        return (xhat.to(self.x_dtype) * weight).to(self.dtype)  # as _rms_norm_parts computed it

    def grads(self, d_value: Tensor, saved: tuple[Tensor, ...], need_x: bool,
              need_w: bool) -> tuple[Tensor | None, Tensor | None]:
        """(dx, d norm weight) from the gradient of the block input."""
        if len(saved) == 1:
            return (d_value.to(self.x_dtype) if need_x else None), None
        xhat, r, weight = saved
        return _rms_norm_grads(d_value.to(self.y_dtype), xhat, r, weight, self.x_dtype, need_x, need_w)

    # the input and the pieces ctx must carry between forward and backward
    def pack(self, ctx, *tensors: Tensor) -> None:
        ctx.save_for_backward(*self.saved, *tensors)
        ctx.num_input_saved = len(self.saved)
        self.value = self.saved = None  # tensors live in save_for_backward only (checkpointing's hooks see them)
        ctx.block_input = self

    @staticmethod
    def unpack(ctx) -> tuple[_Input, tuple[Tensor, ...], tuple[Tensor, ...]]:
        saved = ctx.saved_tensors
        n = ctx.num_input_saved
        return ctx.block_input, saved[:n], saved[n:]


class _SwiGLU(torch.autograd.Function):
    """down(silu(gate(h)) * up(h)) for h = x, or h = rms_norm(x) with a norm weight; saves g and u
    (and x's norm statistics, or x), never h's products; weights as (out, in) like nn.Linear.

    Under autocast the products run in the autocast dtype, as the composite's linears would: the
    input and weights are cast once, and the gradients cast back to their own dtypes."""

    @staticmethod
    def forward(ctx, x: Tensor, norm_weight: Tensor | None, eps: float, w_gate: Tensor, w_up: Tensor,
                w_down: Tensor) -> Tensor:
        dtype = _compute_dtype(x)
        with _no_autocast(x):
            inp = _Input(x, norm_weight, eps, dtype)
            wg, wu, wd = (w.to(dtype) for w in (w_gate, w_up, w_down))
            g, u = F.linear(inp.value, wg), F.linear(inp.value, wu)
            y = F.linear(F.silu(g).mul_(u), wd)
        inp.pack(ctx, g, u, wg, wu, wd)
        ctx.w_dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:
        inp, saved, (g, u, wg, wu, wd) = _Input.unpack(ctx)
        need_x, need_norm, _, need_g, need_u, need_d = ctx.needs_input_grad
        dy = dy.to(g.dtype)
        # three (..., I) blocks in all, each a fresh allocation (on a CPU the page faults of a
        # fresh block cost more than the pass over it): s, then h = s * u, whose buffer takes du
        # once dWd is taken, and dh, which becomes dh * u in place; silu's own backward kernel
        # (one pass: dh * u * sig * (1 + g * (1 - sig))) writes dg over s
        s = F.silu(g)  # exactly as the forward computed it
        h_prod = s * u
        dw_down = _weight_grad(dy, h_prod).to(ctx.w_dtypes[2]) if need_d else None
        dh = dy @ wd  # (..., I)
        du = torch.mul(dh, s, out=h_prod)
        dg = torch.ops.aten.silu_backward.grad_input(dh.mul_(u), g, grad_input=s)
        h = inp.restore(saved) if need_g or need_u else None
        dw_gate = _weight_grad(dg, h).to(ctx.w_dtypes[0]) if need_g else None
        dw_up = _weight_grad(du, h).to(ctx.w_dtypes[1]) if need_u else None
        dx = d_norm = None
        if need_x or need_norm:
            dx, d_norm = inp.grads((dg @ wg).add_(du @ wu), saved, need_x, need_norm)
        return dx, d_norm, None, dw_gate, dw_up, dw_down


class _NormLinears(torch.autograd.Function):
    """(linear_1(h), ..., linear_n(h)) for h = rms_norm(x): one norm feeding several projections
    (an attention block's q, k and v) without saving h; arguments x, norm weight, eps, n, the n
    weights, then the n biases (None for none)."""

    @staticmethod
    def forward(ctx, x: Tensor, norm_weight: Tensor, eps: float, n: int, *params: Tensor | None) -> tuple[Tensor, ...]:
        dtype = _compute_dtype(x)
        with _no_autocast(x):
            inp = _Input(x, norm_weight, eps, dtype)
            weights = [w.to(dtype) for w in params[:n]]
            biases = [None if b is None else b.to(dtype) for b in params[n:]]
            outs = tuple(F.linear(inp.value, w, b) for w, b in zip(weights, biases))
        inp.pack(ctx, *weights)
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *d_outs: Tensor | None) -> tuple[Tensor | None, ...]:
        inp, saved, weights = _Input.unpack(ctx)
        need = ctx.needs_input_grad
        n = len(weights)
        h = inp.restore(saved) if any(need[4:4 + n]) else None
        d_h, d_weights, d_biases = None, [], []
        for i, (w, d) in enumerate(zip(weights, d_outs)):
            if d is None:  # an output no loss reached
                d_weights.append(None)
                d_biases.append(None)
                continue
            d = d.to(w.dtype)
            d_weights.append(_weight_grad(d, h).to(ctx.param_dtypes[i]) if need[4 + i] else None)
            d_biases.append(d.reshape(-1, d.size(-1)).sum(0).to(ctx.param_dtypes[n + i]) if need[4 + n + i] else None)
            d_h = d @ w if d_h is None else d_h.add_(d @ w)
        dx = d_norm = None
        if d_h is not None and (need[0] or need[1]):
            dx, d_norm = inp.grads(d_h, saved, need[0], need[1])
        return (dx, d_norm, None, None, *d_weights, *d_biases)


def _weight_grad(grad_out: Tensor, inp: Tensor) -> Tensor:
    """sum over rows of grad_out^T inp: (out, in), the weight gradient of a linear layer."""
    return grad_out.reshape(-1, grad_out.size(-1)).t() @ inp.reshape(-1, inp.size(-1))


def _wants_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
           norm: tuple[Tensor, float] | None = None) -> Tensor:
    """down(silu(gate(h)) * up(h)) for (out, in) weights, h = x or, with `norm` (weight, eps),
    h = rms_norm(x); with gradients, the lean `_SwiGLU`."""
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    if _wants_grad(x, norm_weight, w_gate, w_up, w_down):
        return _SwiGLU.apply(x, norm_weight, eps, w_gate, w_up, w_down)
    h = x if norm is None else rms_norm(x, norm_weight, eps)
    return F.linear(F.silu(F.linear(h, w_gate), inplace=True).mul_(F.linear(h, w_up)), w_down)


def norm_linears(x: Tensor, norm_weight: Tensor, eps: float, weights: list[Tensor],
                 biases: list[Tensor | None]) -> tuple[Tensor, ...]:
    """linear(rms_norm(x), w_i, b_i) for each weight; with gradients, the lean `_NormLinears`."""
    if _wants_grad(x, norm_weight, *weights, *biases):
        return _NormLinears.apply(x, norm_weight, eps, len(weights), *weights, *biases)
    h = rms_norm(x, norm_weight, eps)
    return tuple(F.linear(h, w, b) for w, b in zip(weights, biases))
