"""The lean autograd blocks (`swiglu`, `norm_linears`): what the decoder layer saves for backward,
and that values and gradients equal the op-by-op composite they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.model import CausalLM, ModelConfig
from astrai.model.attention import Attention
from astrai.model.moe import MLP
from astrai.model.ops import norm_linears, rms_norm, swiglu

EPS = 1e-5


def composite_mlp(x, norm_w, wg, wu, wd):
    h = x if norm_w is None else rms_norm(x, norm_w, EPS)
    return F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


def composite_linears(x, norm_w, weights, biases):
    h = rms_norm(x, norm_w, EPS)
    return tuple(F.linear(h, w, b) for w, b in zip(weights, biases))


def leaves(dtype, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * (0.3 if len(s) == 2 else 1.0)).to(dtype).requires_grad_() for s in shapes]


def relative_error(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("with_norm", [False, True])
def test_swiglu_gradcheck(with_norm):
    x, nw, wg, wu, wd = leaves(torch.float64, (2, 3, 6), (6,), (10, 6), (10, 6), (6, 10))
    norm = (nw, EPS) if with_norm else None
    assert torch.autograd.gradcheck(lambda *a: swiglu(a[0], *a[2:], norm=(a[1], EPS) if norm else None),
                                    (x, nw, wg, wu, wd))


def test_norm_linears_gradcheck_with_biases():
    x, nw, w1, w2, b1, b2 = leaves(torch.float64, (2, 3, 6), (6,), (8, 6), (4, 6), (8,), (4,))
    assert torch.autograd.gradcheck(lambda *a: norm_linears(a[0], a[1], EPS, [a[2], a[3]], [a[4], a[5]]),
                                    (x, nw, w1, w2, b1, b2))


@pytest.mark.parametrize("with_norm", [False, True])
def test_swiglu_equals_composite_fp32(with_norm):
    tensors = leaves(torch.float32, (4, 9, 16), (16,), (40, 16), (40, 16), (16, 40), seed=1)
    upstream = torch.randn(4, 9, 16, generator=torch.Generator().manual_seed(2))
    x, nw, wg, wu, wd = tensors
    inputs = [x, nw, wg, wu, wd] if with_norm else [x, wg, wu, wd]
    lean = swiglu(x, wg, wu, wd, norm=(nw, EPS) if with_norm else None)
    ref = composite_mlp(x, nw if with_norm else None, wg, wu, wd)
    assert torch.equal(lean, ref)  # the forward runs the same kernels in the same order
    for a, b in zip(torch.autograd.grad(lean, inputs, upstream), torch.autograd.grad(ref, inputs, upstream)):
        assert relative_error(a, b) < 1e-6


def test_norm_linears_equals_composite_fp32():
    x, nw, wq, wk, bq, bk = leaves(torch.float32, (3, 7, 16), (16,), (24, 16), (8, 16), (24,), (8,), seed=3)
    g = torch.Generator().manual_seed(4)
    ups = [torch.randn(3, 7, 24, generator=g), torch.randn(3, 7, 8, generator=g)]
    inputs = [x, nw, wq, wk, bq, bk]
    lean, ref = norm_linears(x, nw, EPS, [wq, wk], [bq, bk]), composite_linears(x, nw, [wq, wk], [bq, bk])
    assert all(torch.equal(a, b) for a, b in zip(lean, ref))
    for a, b in zip(torch.autograd.grad(lean, inputs, ups), torch.autograd.grad(ref, inputs, ups)):
        assert relative_error(a, b) < 1e-6


def test_under_bf16_autocast_dtypes_and_values_follow_the_composite():
    x, nw, wg, wu, wd = leaves(torch.float32, (4, 9, 16), (16,), (40, 16), (40, 16), (16, 40), seed=5)
    upstream = torch.randn(4, 9, 16, generator=torch.Generator().manual_seed(6))
    results = []
    for fn in (lambda: swiglu(x, wg, wu, wd, norm=(nw, EPS)), lambda: composite_mlp(x, nw, wg, wu, wd)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn()
        results.append((y, torch.autograd.grad(y, [x, nw, wg, wu, wd], upstream.to(y.dtype))))
    (y1, g1), (y2, g2) = results
    assert y1.dtype == y2.dtype == torch.bfloat16
    assert relative_error(y1, y2) < 1e-2
    for a, b in zip(g1, g2):
        assert a.dtype == b.dtype == torch.float32
        assert relative_error(a, b) < 3e-2  # bf16 products, rounded in a different order


def saved_bytes(fn) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes and shapes of the distinct non-parameter storages autograd saves while fn() runs."""
    seen: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def test_decoder_saves_no_norm_outputs_and_two_mlp_intermediates(monkeypatch):
    """Per dense layer the MLP saves gate(h) and up(h) only (the composite saved four tensors of
    the intermediate width), and neither norm's output is saved; turning the lean blocks off
    (as LoRA-wrapped projections do) restores the composite's saves and gives the same loss and
    gradients."""
    config = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(7))

    def run():
        model = CausalLM(config, seed=0).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        logits, seen = saved_bytes(lambda: model(ids).logits)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        activations = {k: v for k, v in seen.items() if k not in params}
        wide = sum(1 for _, shape in activations.values() if shape[-1] == config.intermediate_size)
        return loss.detach(), [p.grad for p in model.parameters()], activations, wide

    loss, grads, lean_saves, lean_wide = run()
    monkeypatch.setattr(MLP, "fusable", property(lambda self: False))
    monkeypatch.setattr(Attention, "fusable", property(lambda self: False))
    ref_loss, ref_grads, ref_saves, ref_wide = run()
    assert lean_wide == 2 * config.num_hidden_layers and ref_wide == 4 * config.num_hidden_layers
    hidden_wide = lambda saves: sum(1 for _, s in saves.values() if s[-1] == config.hidden_size)  # noqa: E731
    # the composite saves both norms' outputs besides their xhat: two more hidden-wide tensors per layer
    assert hidden_wide(ref_saves) - hidden_wide(lean_saves) == 2 * config.num_hidden_layers
    assert sum(b for b, _ in lean_saves.values()) < 0.75 * sum(b for b, _ in ref_saves.values())
    assert relative_error(loss, ref_loss) < 1e-6
    errors = [relative_error(a, b) for a, b in zip(grads, ref_grads)]
    assert max(errors) < 1e-6
