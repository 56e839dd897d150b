"""The hand-written backward passes of astrai.model.ops against autograd of the plain formulas."""

import pytest
import torch

from astrai.model.ops import apply_rope, rms_norm


def reference_rms_norm(x, w, eps):
    xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_rope(x, cos, sin):
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def test_rms_norm_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w))


def test_rope_gradcheck_with_asymmetric_tables():
    # the backward must be the exact transpose, not rely on cos/sin repeating across the halves
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    cos, sin = torch.randn(2, 4, 8, dtype=torch.float64, generator=g), torch.randn(2, 4, 8, dtype=torch.float64, generator=g)
    assert torch.autograd.gradcheck(lambda a: apply_rope(a, cos, sin), (x,))
    torch.testing.assert_close(apply_rope(x, cos, sin), reference_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_composite_forward_and_backward(dtype):
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 6, 16, generator=g).to(dtype)
    w0 = torch.randn(16, generator=g)
    upstream = torch.randn(4, 6, 16, generator=g)
    outs, grads = [], []
    for fn in (rms_norm, reference_rms_norm):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w, 1e-6)
        y.backward(upstream.to(y.dtype))
        outs.append(y.detach())
        grads.append((x.grad, w.grad))
    assert outs[0].dtype == outs[1].dtype and grads[0][0].dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    torch.testing.assert_close(grads[0][0], grads[1][0], **tol)
    torch.testing.assert_close(grads[0][1], grads[1][1], **tol)


def test_no_grad_paths_equal_grad_paths():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 3, 8, generator=g), torch.randn(8, generator=g)
    cos, sin = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    q = torch.randn(2, 3, 4, 8, generator=g)
    with torch.no_grad():
        plain = rms_norm(x, w, 1e-6), apply_rope(q, cos, sin)
    tracked = rms_norm(x.requires_grad_(), w, 1e-6), apply_rope(q.requires_grad_(), cos, sin)
    for a, b in zip(plain, tracked):
        assert torch.equal(a, b.detach())
