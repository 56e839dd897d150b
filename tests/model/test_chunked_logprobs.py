"""The chunked lm-head log-probs equal the full-logits path in value and gradient (fp32, 1e-6).

The reference in each test is today's arithmetic written out on the full logits tensor:
``selective_log_softmax`` / ``truncated_token_logps`` / ``F.cross_entropy`` / ``token_entropy``;
the chunked path runs with chunks much smaller than the rows, so several chunks (and a ragged
last one) are exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.model import CausalLM, ModelConfig
from astrai.model.chunked_head import head_logps
from astrai.model.logprobs import selective_log_softmax, truncated_token_logps
from astrai.model.lora import AdapterDisabled, apply_lora

TOL = dict(atol=1e-6, rtol=1e-6)


def assert_grad_close(a, b):
    """Within 1e-6 of the gradient's scale: chunks sum dW and the tied embedding's gradient in
    another order than one matmul, a rounding difference of ~1e-7 of the largest entry."""
    assert a is not None and b is not None
    scale = max(1.0, b.abs().max().item())
    assert (a - b).abs().max().item() <= 1e-6 * scale, ((a - b).abs().max().item(), scale)


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    base.update(overrides)
    return ModelConfig(**base)


def reference_logps(logits, targets, temperature, top_k, top_p):
    """Today's trainer path on full logits (base.token_logps before the chunked head)."""
    if temperature > 0:
        return truncated_token_logps(logits.float() / temperature, targets, top_k, top_p)
    return selective_log_softmax(logits.float(), targets)


def grads(loss, params):
    return torch.autograd.grad(loss, params, allow_unused=True)


SAMPLING = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.9, 5, 1.0), (1.0, 0, 0.8), (0.8, 7, 0.6), (0.0, 5, 0.5)]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING, ids=["plain", "temp", "topk", "topp", "both", "greedy"])
@pytest.mark.parametrize("tied", [False, True])
def test_value_and_gradient_equal_the_full_logits_path(temperature, top_k, top_p, tied):
    model = CausalLM(tiny(tie_word_embeddings=tied), seed=1)
    with torch.no_grad():  # peaked rows, so top_p cuts at different ranks per row
        model.lm_head.weight.mul_(40.0)
    ids = torch.randint(0, 97, (3, 11))
    targets = torch.randint(0, 97, (3, 11))
    weights = torch.rand(3, 11)  # an arbitrary downstream use of the log-probs
    params = [p for p in model.parameters()]

    ref = reference_logps(model(ids).logits, targets, temperature, top_k, top_p)
    ref_grads = grads((ref * weights).sum(), params)
    head = lambda h, lm: head_logps(h, lm, targets, temperature, top_k, top_p, chunk_rows=4)  # noqa: E731
    out = model(ids, head=head)
    assert out.logits is None
    new = out.head.logps
    assert torch.isfinite(new).all()
    torch.testing.assert_close(new, ref, **TOL)
    for a, b in zip(grads((new * weights).sum(), params), ref_grads, strict=True):
        assert_grad_close(a, b)


def test_truncation_really_cuts():
    """The truncated cases above differ from the untruncated log-probs (the test can fail)."""
    torch.manual_seed(0)
    lm = torch.nn.Linear(16, 97, bias=False)
    with torch.no_grad():
        lm.weight.mul_(40.0)
    h, t = torch.randn(8, 16), torch.randint(0, 97, (8,))
    plain = head_logps(h, lm, t, 1.0).logps
    cut = head_logps(h, lm, t, 1.0, top_k=5, top_p=0.8).logps
    assert (cut > plain + 1e-3).any()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_label_smoothing(smoothing):
    torch.manual_seed(0)
    lm = torch.nn.Linear(16, 97, bias=True)
    h = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 97, (2, 9))
    labels[0, :3] = -100
    logits = lm(h)
    ref = F.cross_entropy(logits.reshape(-1, 97), labels.reshape(-1), ignore_index=-100,
                          label_smoothing=smoothing, reduction="sum")
    ref_g = grads(ref, [h, lm.weight, lm.bias])
    mask = labels != -100
    out = head_logps(h, lm, torch.where(mask, labels, 0), smoothing=True, chunk_rows=5)
    per_token = (1 - smoothing) * out.logps + smoothing * out.mean_logps
    new = -torch.where(mask, per_token, 0.0).sum()
    torch.testing.assert_close(new, ref, **TOL)
    for a, b in zip(grads(new, [h, lm.weight, lm.bias]), ref_g, strict=True):
        assert_grad_close(a, b)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("top_k", [5, 0], ids=["truncated", "untruncated"])
@pytest.mark.parametrize("bias", [False, True])
def test_entropy_equals_the_metric_on_full_logits(temperature, top_k, bias):
    """Truncated rows take logsumexp and entropy separately; untruncated ones share one exp pass
    (and, in float32, the reused blocks), which must give the same entropy and log-probs."""
    from astrai.train.losses import token_entropy

    torch.manual_seed(0)
    lm = torch.nn.Linear(16, 97, bias=bias)
    h, t = torch.randn(3, 7, 16), torch.randint(0, 97, (3, 7))
    out = head_logps(h, lm, t, temperature, top_k=top_k, entropy=True, chunk_rows=4)
    scale = temperature if temperature > 0 else 1.0
    torch.testing.assert_close(out.entropy, token_entropy(lm(h).float() / scale), **TOL)
    assert not out.entropy.requires_grad
    torch.testing.assert_close(out.logps, reference_logps(lm(h), t, temperature, top_k, 1.0), **TOL)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5), (0.0, 0)])
def test_entropy_gradient_equals_autograd_of_the_full_softmax(temperature, top_k):
    """entropy_grad (the RL entropy bonus): the entropy of the tempered untruncated distribution
    with its gradient, dH/dz = -p (log p + H), across chunks and beside a log-prob gradient (a
    truncated row's log-probs and its untruncated entropy both reach the weights)."""
    torch.manual_seed(0)
    lm = torch.nn.Linear(16, 97, bias=True)
    h, t = torch.randn(3, 7, 16, requires_grad=True), torch.randint(0, 97, (3, 7))
    w_ent, w_lp = torch.randn(3, 7), torch.randn(3, 7)
    out = head_logps(h, lm, t, temperature, top_k=top_k, entropy=True, chunk_rows=4, entropy_grad=True)
    new = (out.entropy * w_ent).sum() + (out.logps * w_lp).sum()
    z = lm(h).float() / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(z, dim=-1)
    ref = (-(lp.exp() * lp).sum(-1) * w_ent).sum() + (reference_logps(lm(h), t, temperature, top_k, 1.0) * w_lp).sum()
    torch.testing.assert_close(new, ref, **TOL)
    for a, b in zip(grads(new, [h, lm.weight, lm.bias]), grads(ref, [h, lm.weight, lm.bias]), strict=True):
        assert_grad_close(a, b)


def test_repetition_penalty_value_and_gradient_equal_the_full_logits_path():
    """repetition_penalty 1.5 on each row's context tokens (input_ids[row, :col + 1]), before the
    temperature: values and gradients equal autograd through the penalised full logits."""
    torch.manual_seed(0)
    lm = torch.nn.Linear(16, 97, bias=True)
    h, t = torch.randn(6, 16, requires_grad=True), torch.randint(0, 97, (6,))
    input_ids = torch.randint(0, 97, (2, 5))
    rows, cols = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 2, 4, 1, 3, 4])
    out = head_logps(h, lm, t, 0.8, top_k=20, chunk_rows=4, repetition_penalty=1.5, context=(input_ids, rows, cols))
    z = lm(h).float()
    seen = torch.zeros(6, 97, dtype=torch.bool)
    for m in range(6):
        seen[m, input_ids[rows[m], : cols[m] + 1]] = True
    ref = reference_logps(torch.where(seen, torch.where(z > 0, z / 1.5, z * 1.5), z), t, 0.8, 20, 1.0)
    torch.testing.assert_close(out.logps, ref, **TOL)
    for a, b in zip(grads(out.logps.sum(), [h, lm.weight, lm.bias]), grads(ref.sum(), [h, lm.weight, lm.bias]),
                    strict=True):
        assert_grad_close(a, b)
    plain = head_logps(h, lm, t, 0.8, top_k=20)
    assert not torch.allclose(plain.logps, out.logps)  # the penalty changed something here


def test_low_precision_weights_take_the_allocating_path():
    """bf16 weights do not use the float32 block: values still match the full-logits path."""
    torch.manual_seed(0)
    lm = torch.nn.Linear(16, 97, bias=False).to(torch.bfloat16)
    h, t = torch.randn(3, 7, 16, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, 97, (3, 7))
    out = head_logps(h, lm, t, 1.0, entropy=True, chunk_rows=4)
    torch.testing.assert_close(out.logps, selective_log_softmax(lm(h).float(), t), atol=1e-5, rtol=1e-5)
    out.logps.sum().backward()
    assert h.grad is not None and lm.weight.grad is not None and lm.weight.grad.dtype == torch.bfloat16


def test_zero_rows_give_zero_gradients():
    lm = torch.nn.Linear(16, 97, bias=True)
    h = torch.randn(0, 16, requires_grad=True)
    head_logps(h, lm, torch.zeros(0, dtype=torch.long)).logps.sum().backward()
    assert lm.weight.grad is not None and not lm.weight.grad.any() and not lm.bias.grad.any()


def test_lora_model_and_its_disabled_reference():
    model = CausalLM(tiny(tie_word_embeddings=True), seed=2)
    apply_lora(model, r=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids, targets = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 9))
    trained = [p for p in model.parameters() if p.requires_grad]
    ref = reference_logps(model(ids).logits, targets, 0.9, 6, 1.0)
    head = lambda h, lm: head_logps(h, lm, targets, 0.9, 6, chunk_rows=3)  # noqa: E731
    new = model(ids, head=head).head.logps
    torch.testing.assert_close(new, ref, **TOL)
    for a, b in zip(grads(new.sum(), trained), grads(ref.sum(), trained), strict=True):
        assert_grad_close(a, b)
    base = AdapterDisabled(model)
    with torch.no_grad():
        torch.testing.assert_close(base(ids, head=head).head.logps,
                                   reference_logps(base(ids).logits, targets, 0.9, 6, 1.0), **TOL)


def test_label_smoothing_under_truncation_is_refused():
    lm = torch.nn.Linear(8, 20, bias=False)
    with pytest.raises(ValueError, match="label smoothing"):
        head_logps(torch.randn(2, 8), lm, torch.zeros(2, dtype=torch.long), 1.0, top_k=3, smoothing=True)
