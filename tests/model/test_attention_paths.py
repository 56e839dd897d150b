"""Attention paths chosen by device type: the CUDA kernels' CPU forms against the dense paths.

Packed training rows attend within each document (the flash varlen kernel on CUDA, one SDPA call
per document elsewhere) instead of over a dense block-diagonal mask; paged decode with
`paged_kernel="varlen"` reads KV blocks in place. On CPU the same functions run SDPA with the same
arguments: these tests hold them (and so the offsets and block tables handed to the kernels) to the
dense paths, and (`cuda`-marked) hold the kernels to the CPU forms.
"""

from __future__ import annotations

import pytest
import torch

from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from astrai.model import CausalLM, ModelConfig
from astrai.model.attention import (
    Attention,
    build_attention_mask,
    dense_document_mask,
    document_ids_from_positions,
    rope_cos_sin,
    rope_inv_freq,
)
from astrai.model.kernels import (
    OWN_CALL_MIN_LEN,
    PackedSegments,
    PagedDecodeTables,
    packed_attention,
    packed_segments,
    paged_decode,
    paged_varlen_supported,
    sdpa,
)
from astrai.model.paged_metadata import PagedAttentionMetadata

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def _layer_inputs(B: int, T: int, position_ids: torch.Tensor, device: str = "cpu"):
    attn = Attention(CFG, 0).to(device)
    x = torch.randn(B, T, CFG.hidden_size, device=device, requires_grad=True)
    cos, sin = rope_cos_sin(rope_inv_freq(CFG).to(device), position_ids.to(device), x.dtype)
    return attn, x, cos, sin


def test_segment_offsets_by_hand():
    doc = torch.tensor([[1, 1, 2, 2, 2], [1, 2, 2, 2, 2]])
    segs = packed_segments(doc)
    assert segs.cu_seqlens.dtype == torch.int32
    assert segs.cu_seqlens.tolist() == [0, 2, 5, 6, 10] and segs.max_seqlen == 4


def test_packed_rows_take_segments_on_every_device():
    doc = torch.tensor([[1, 1, 2, 2]])
    for device in ("cuda", "cpu"):
        assert isinstance(build_attention_mask(None, doc, 4, torch.device(device)), PackedSegments)
    # padding as document 0 (packing.py's rows) is a segment of its own; padding that shares a real
    # token's document id keeps the dense mask
    assert isinstance(build_attention_mask(torch.tensor([[1, 1, 0, 0]]), torch.tensor([[1, 1, 0, 0]]), 4,
                                           torch.device("cpu")), PackedSegments)
    pad = torch.tensor([[1, 1, 1, 0]])
    dense = build_attention_mask(pad, doc, 4, torch.device("cpu"))
    assert isinstance(dense, torch.Tensor) and dense.shape == (1, 1, 4, 4)
    # no padding and no documents: plain causal (SDPA is_causal, no mask) on every device
    assert build_attention_mask(torch.ones(1, 4), None, 4, torch.device("cuda")) is None
    assert build_attention_mask(None, None, 4, torch.device("cpu")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_document_attention_equals_dense_mask_for_mixed_lengths(dtype):
    """Documents of 1 to 70 tokens (short ones share one padded call, long ones a call each, the
    bound `OWN_CALL_MIN_LEN` on both sides of it), a padding run as document 0: values and the
    gradients of q, k and v equal the dense block-diagonal mask's at every real token."""
    lens = [[3, OWN_CALL_MIN_LEN, 1, 17, OWN_CALL_MIN_LEN - 1, 6], [70, 2, OWN_CALL_MIN_LEN + 5]]
    T = max(sum(r) for r in lens) + 4
    doc = torch.zeros(2, T, dtype=torch.long)
    for row, lengths in enumerate(lens):
        at = 0
        for i, n in enumerate(lengths):
            doc[row, at:at + n] = 10 * row + i + 1
            at += n
    real = doc != 0
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, T, h, 8, generator=g, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    weight = torch.randn(2, T, 4, 8, generator=g, dtype=dtype) * real[..., None, None]
    segs = packed_segments(doc)
    assert segs.cu_seqlens.tolist()[:3] == [0, 3, 3 + OWN_CALL_MIN_LEN]
    out = packed_attention(q, k, v, segs, gqa=True)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    ref = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None],
               enable_gqa=True).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out[real], ref[real], atol=tol, rtol=tol)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_packed_reference_equals_dense_block_diagonal_mask_forward_and_backward():
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]])
    doc = document_ids_from_positions(pos)
    attn, x, cos, sin = _layer_inputs(2, 8, pos)
    dense = attn(x, cos, sin, dense_document_mask(None, doc, 8, "cpu"))
    (g_dense,) = torch.autograd.grad(dense.square().sum(), x)
    packed = attn(x, cos, sin, packed_segments(doc))
    (g_packed,) = torch.autograd.grad(packed.square().sum(), x)
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_packed, g_dense, atol=1e-5, rtol=1e-5)
    # the segments really separate: attending across documents changes the output
    assert not torch.allclose(attn(x, cos, sin, None), dense, atol=1e-4)


def test_packed_segments_with_query_positions_equal_dense_rows():
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    doc = document_ids_from_positions(pos)
    attn, x, cos, sin = _layer_inputs(1, 8, pos)
    keep = torch.tensor([2, 5, 7])
    mask = dense_document_mask(None, doc, 8, "cpu")
    dense = attn(x, cos, sin, mask, query_idx=keep)
    (g_dense,) = torch.autograd.grad(dense.square().sum(), x)
    packed = attn(x, cos, sin, packed_segments(doc), query_idx=keep)
    (g_packed,) = torch.autograd.grad(packed.square().sum(), x)
    torch.testing.assert_close(packed, dense, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_packed, g_dense, atol=1e-6, rtol=1e-6)


def _decode_meta(kernel: str, kv_caches, context_lens, block_tables, query_lens=None):
    query_lens = query_lens or [1] * len(context_lens)
    return PagedAttentionMetadata.build(query_lens, context_lens, block_tables, 4, kv_caches, "cpu",
                                        list(range(len(context_lens))), None, kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_reference_equals_gather_path(dtype):
    model = CausalLM(CFG, seed=1).eval()
    kv = model.allocate_kv_cache(16, 4, dtype=dtype, device="cpu")
    for k, v in kv:  # a filled cache: every slot holds some key and value
        k.copy_(torch.randn_like(k, dtype=torch.float32))
        v.copy_(torch.randn_like(v, dtype=torch.float32))
    ctx, tables = [5, 9, 2], [[3, 7], [1, 0, 12], [15]]  # out of order, block 0 used, shared-free
    ids, pos = torch.tensor([[5, 6, 7]]), torch.tensor([[4, 8, 1]])
    with torch.inference_mode():
        ref = model(ids, position_ids=pos, attn_metadata=_decode_meta("gather", kv, ctx, tables)).logits
        meta = _decode_meta("varlen", kv, ctx, tables)
        assert meta.paged_decode is not None and meta.decode_blocks is None and meta.decode_mask is None
        assert meta.paged_decode.block_table.dtype == torch.int32 and meta.paged_decode.max_k == 9
        out = model(ids, position_ids=pos, attn_metadata=meta).logits
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_paged_decode_reference_in_a_mixed_step():
    """A prefill chunk next to decodes: the decodes read in place, the prefill as before."""
    model = CausalLM(CFG, seed=2).eval()
    kv_a = model.allocate_kv_cache(16, 4, device="cpu")
    kv_b = [(k.clone(), v.clone()) for k, v in kv_a]
    ctx, q, tables = [6, 3, 7], [1, 3, 1], [[2, 5], [9], [4, 1]]
    ids = torch.randint(0, 64, (1, 5))
    pos = torch.tensor([[5, 0, 1, 2, 6]])
    with torch.inference_mode():
        for kv in (kv_a, kv_b):  # earlier context in both caches
            for k, v in kv:
                torch.manual_seed(3)
                k.normal_()
                v.normal_()
        ref = model(ids, position_ids=pos, attn_metadata=_decode_meta("gather", kv_a, ctx, tables, q)).logits
        out = model(ids, position_ids=pos, attn_metadata=_decode_meta("varlen", kv_b, ctx, tables, q)).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_engine_decodes_the_same_tokens_through_the_reference():
    model = CausalLM(CFG, seed=4).eval()
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLMEngine(model, None, kv_cache_tokens=256, block_size=4).run_batch(prompts, params)
    engine = LLMEngine(model, None, kv_cache_tokens=256, block_size=4)
    engine.runner.paged_kernel, engine.runner.decode_view = "varlen", None  # the CPU stand-in of the kernel
    out = engine.run_batch(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    for a, b in zip(out, ref):
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-5)


def test_gpu_only_paths_are_refused_on_cpu():
    model = CausalLM(CFG, seed=0).eval()
    with pytest.raises(ValueError, match="paged_kernel='varlen' needs a CUDA device"):
        LLMEngine(model, None, kv_cache_tokens=64, paged_kernel="varlen")
    with pytest.raises(ValueError, match="paged_kernel is 'flash'"):
        PagedAttentionMetadata.build([1], [2], [[0]], 4, [], "cpu", paged_kernel="flash")


def test_sdpa_on_cpu_is_plain_sdpa():
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    torch.testing.assert_close(sdpa(q, k, v, is_causal=True),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=0)


# -- on a GPU: the kernels against their references ---------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_packed_kernel_matches_reference(dtype):
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0] * 16])
    doc = document_ids_from_positions(pos).cuda()
    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    segs = packed_segments(doc)
    out = packed_attention(q, k, v, segs, gqa=True)
    ref = packed_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), packed_segments(doc.cpu()), gqa=True)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not paged_varlen_supported(), reason=f"torch {torch.__version__}'s varlen_attn takes no block table")
@pytest.mark.parametrize("block_size", [16, 256])
def test_varlen_paged_decode_kernel_matches_reference(block_size):
    k_cache, v_cache = (torch.randn(40, block_size, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ctx, tables = [5, 3 * block_size + 1, 2], [[3, 7], [1, 0, 12, 30], [15]]
    t = PagedDecodeTables.build(ctx, tables, block_size, "cuda")
    q = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    out = paged_decode(q, k_cache, v_cache, t)
    t_cpu = PagedDecodeTables.build(ctx, tables, block_size, "cpu")
    ref = paged_decode(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), t_cpu)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
def test_short_key_attention_equals_sdpa_forward_and_backward(dtype, tol):
    """The CPU form for short key rows (batched products, its own backward) against SDPA with
    GQA and a boolean mask; a padding query row that sees only key 0 included."""
    from astrai.model.kernels import short_key_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, 7, 16, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(5, 2, 9, 16, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = torch.rand(5, 1, 7, 9, generator=gen) > 0.4
    mask[..., 0] = True
    mask[0, 0, -1] = False
    mask[0, 0, -1, 0] = True
    d_out = torch.randn(5, 6, 7, 16, generator=gen, dtype=dtype)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = short_key_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(ref, (q, k, v), d_out)):
        torch.testing.assert_close(got, want, atol=tol * 4, rtol=tol * 4)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda a, b, c: short_key_attention(a, b, c, mask), (q, k, v))


def test_short_keys_are_taken_on_cpu_in_full_precision_up_to_the_head_size():
    from astrai.model.kernels import takes_short_keys

    q = torch.zeros(2, 4, 3, 32)
    assert takes_short_keys(q, torch.zeros(2, 2, 32, 32))
    assert not takes_short_keys(q, torch.zeros(2, 2, 33, 32))  # probabilities would outweigh the queries
    assert not takes_short_keys(q.bfloat16(), torch.zeros(2, 2, 8, 32, dtype=torch.bfloat16))  # SDPA accumulates in fp32
    assert takes_short_keys(q.double(), torch.zeros(2, 2, 8, 32, dtype=torch.float64))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_decode_attention_equals_sdpa(dtype, tol):
    """A decode step's attention as matrix products (CPU, full precision) against SDPA over the
    same masked keys; under autocast it is SDPA itself."""
    from astrai.model.kernels import decode_attention

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(6, 2, 3, 16, generator=gen, dtype=dtype)
    k, v = (torch.randn(6, 2, 40, 16, generator=gen, dtype=dtype)[:, :, :29] for _ in range(2))  # views, as decode reads
    lens = torch.tensor([1, 5, 29, 12, 29, 7])
    bias = torch.zeros(6, 1, 1, 29, dtype=dtype).masked_fill_(torch.arange(29) >= lens[:, None, None, None], float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(decode_attention(q, k, v, bias), ref, atol=tol, rtol=tol)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(decode_attention(q, k, v, bias), torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=bias))


@pytest.mark.cuda
def test_cuda_attention_never_takes_the_cudnn_backend():
    """cuDNN builds a plan per new shape (12 ms of host time a call on an H200 GRPO step)."""
    model = CausalLM(CFG).cuda()
    ids = torch.randint(0, CFG.vocab_size, (2, 24), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.profiler.profile() as prof:
        for T in (24, 17, 9):
            model(ids[:, :T]).logits.float().sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert not [n for n in names if "cudnn_attention" in n], sorted(n for n in names if "attention" in n)
