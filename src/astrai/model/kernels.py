"""Attention kernels chosen by device type, each with the CPU form the suite checks it against.

attention.py calls these for what dense SDPA over a (T, T) mask does badly: packed training rows
(several documents in one row) attend within each document, through the flash varlen kernel with
segment offsets on CUDA and one SDPA call per document (short ones batched) elsewhere, never over
a (B, T, T) block-diagonal mask; paged decode (`paged_kernel="varlen"`, opt-in, on a torch whose
kernel takes a block table) reads each sequence's KV blocks where they lie in the cache through the
kernel's block-table form instead of gathering a dense copy. On CPU the same functions run plain
SDPA with the same arguments, so the tables and offsets they are given are tested without a GPU.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's attention builds an execution plan for every new shape; rollouts and decode change shape
# at every step, and on the first H200 run the plans cost 12 ms of host time a call (74% of a GRPO
# step's CPU time): on CUDA the flash and memory-efficient kernels are preferred, math as fallback
CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """`F.scaled_dot_product_attention`, restricted to `CUDA_SDPA` on a CUDA device."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(CUDA_SDPA):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

def to_device(host: Tensor, device: torch.device | str) -> Tensor:
    """A host-built index tensor on `device`: through pinned memory and an asynchronous copy on CUDA
    (a pageable copy would block the host), as it is on CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@functools.cache
def varlen_params() -> frozenset[str]:
    """The keyword arguments this torch's `varlen_attn` takes: they grew between releases
    (`enable_gqa`, `seqused_k` and `block_table` are newer than `window_size`)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def paged_varlen_supported() -> bool:
    """Whether `paged_kernel="varlen"` can run on this torch: its varlen kernel reads a block table."""
    try:
        return {"seqused_k", "block_table"} <= varlen_params()
    except ImportError:
        return False


def _varlen(q: Tensor, k: Tensor, v: Tensor, *args, gqa: bool, **kwargs) -> Tensor:
    """`varlen_attn` with the keywords this torch takes. Grouped-query attention passes the
    fewer key/value heads as they are: the flash kernel reads them natively, and a torch whose
    signature has `enable_gqa` is told so."""
    from torch.nn.attention.varlen import varlen_attn

    if gqa and "enable_gqa" in varlen_params():
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, *args, **kwargs)


@dataclass
class PackedSegments:
    """Packed rows without padding, as varlen segments: each run of equal document ids in a row
    is one causal sequence of the flattened (B * T) tokens (a document id repeated after another
    one starts a new segment, unlike the dense mask, which joins them)."""

    document_ids: Tensor  # (B, T)
    cu_seqlens: Tensor  # (num_segments + 1,) int32 offsets into the B * T tokens
    max_seqlen: int


def packed_segments(document_ids: Tensor) -> PackedSegments:
    B, T = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)  # (B, T) first token of a segment
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    idx = starts.flatten().nonzero()[:, 0]
    cu = torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)  # (num_segments + 1,)
    return PackedSegments(document_ids, cu, int((cu[1:] - cu[:-1]).max()))  # one sync per forward


# Off the varlen kernel a document of at least this many tokens takes an SDPA call of its own, on a
# view of the packed row; shorter ones share one call, each padded to the longest of them. The
# bound is where one call per document stops paying (forward and backward, one thread, 4 heads of
# 32, about 1,200 tokens: 100 documents of 8-16 tokens 8.3 ms one call each against 3.6 ms in one
# padded call; 33 of 24-48 tokens 3.4 ms against 7.7 ms; docs/performance.md)
OWN_CALL_MIN_LEN = 32


def packed_attention(q: Tensor, k: Tensor, v: Tensor, segs: PackedSegments, gqa: bool) -> Tensor:
    """q (B, T, H, D), k/v (B, T, Hkv, D) -> (B, T, H, D), causal within each segment: the flash
    varlen kernel on CUDA in half precision, `document_attention` elsewhere."""
    B, T, H, D = q.shape
    fq, fk, fv = q.reshape(B * T, H, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = _varlen(fq, fk, fv, segs.cu_seqlens, segs.cu_seqlens, segs.max_seqlen, segs.max_seqlen,
                      window_size=(-1, 0), gqa=gqa)
        return out.view(B, T, H, D)
    return document_attention(fq, fk, fv, segs.cu_seqlens.tolist(), gqa).view(B, T, H, D)


def document_attention(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], gqa: bool) -> Tensor:
    """q (N, H, D), k/v (N, Hkv, D) of back-to-back documents (token offsets `bounds`, first 0,
    last N) -> (N, H, D), causal within each document and never across: each document's own
    square, no (N, N) mask. A document of `OWN_CALL_MIN_LEN` tokens or more is one SDPA call on
    its view; the shorter ones are gathered into one right-padded batch and one causal call (a
    padding key lies after every real query of its row, so causality hides it: the padding
    repeats the document's last token). On a CPU outside autocast the flash kernel's forward and
    backward are called directly (`_DocumentAttention`)."""
    spans = _Spans(bounds, q.device)
    if q.device.type == "cpu" and not torch.is_autocast_enabled("cpu"):
        return _DocumentAttention.apply(q, k, v, spans)
    batched: dict[int, Tensor] = {}
    if spans.short:
        rows = lambda t: spans.gather(t).transpose(1, 2)  # noqa: E731
        o = sdpa(rows(q), rows(k), rows(v), is_causal=True, enable_gqa=gqa).transpose(1, 2)  # (S, L, H, D)
        batched = {a: o[i, :b - a] for i, (a, b) in enumerate(spans.short)}
    pieces = [batched[a] if a in batched else sdpa(*(_heads_first(t, a, b) for t in (q, k, v)), is_causal=True,
                                                   enable_gqa=gqa)[0].transpose(0, 1) for a, b in spans.all]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()


def _heads_first(t: Tensor, a: int, b: int) -> Tensor:
    """Tokens a..b of flat (N, H, D) as a (1, H, b - a, D) view."""
    return t[a:b].transpose(0, 1)[None]


class _Spans:
    """The documents of a flat row: `long` ones (`OWN_CALL_MIN_LEN` tokens or more) each take a
    call; the `short` ones share a padded batch (S, L), gathered through `idx`; `take` picks each
    real token of that batch's flattened (S * L) rows, `dest` is where it lies in the row, and
    `padding` lists the other rows."""

    def __init__(self, bounds: list[int], device: torch.device):
        self.all = list(zip(bounds[:-1], bounds[1:]))
        self.long = [(a, b) for a, b in self.all if b - a >= OWN_CALL_MIN_LEN]
        self.short = [(a, b) for a, b in self.all if b - a < OWN_CALL_MIN_LEN]
        if self.short:
            self.L = max(b - a for a, b in self.short)
            starts = torch.tensor([a for a, _ in self.short], device=device)
            lens = torch.tensor([b - a for a, b in self.short], device=device)
            col = torch.arange(self.L, device=device)[None]
            self.idx = (starts[:, None] + torch.minimum(col, lens[:, None] - 1)).flatten()
            real = (col < lens[:, None]).flatten()
            self.take, self.dest = real.nonzero()[:, 0], self.idx[real]
            self.padding = (~real).nonzero()[:, 0]

    def gather(self, t: Tensor) -> Tensor:
        """flat (N, H, D) -> the short documents' padded (S, L, H, D)."""
        return t.index_select(0, self.idx).view(len(self.short), self.L, *t.shape[1:])

    def scatter(self, into: Tensor, padded: Tensor) -> None:
        """Write the real tokens of padded (S, H, L, D) into flat (N, H, D)."""
        into.index_copy_(0, self.dest, padded.transpose(1, 2).reshape(-1, *into.shape[1:]).index_select(0, self.take))


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _DocumentAttention(torch.autograd.Function):
    """`document_attention` on a CPU: the flash kernel's forward and backward per call on views of
    the flat rows, results written into flat (N, ...) tensors. Autograd through per-document
    slices would allocate, zero and sum a full-size gradient for every document (at eight
    documents of a micro-batch, a tenth of a tiny model's SFT step)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spans: _Spans) -> Tensor:
        out, lses = torch.empty_like(q), []
        for a, b in spans.long:
            o, lse = _FLASH_CPU(*(_heads_first(t, a, b) for t in (q, k, v)), 0.0, True)
            out[a:b] = o[0].transpose(0, 1)
            lses.append(lse)
        if spans.short:
            o, lse = _FLASH_CPU(*(spans.gather(t).transpose(1, 2) for t in (q, k, v)), 0.0, True)
            spans.scatter(out, o)
            lses.append(lse)
        ctx.spans = spans
        ctx.save_for_backward(q, k, v, out, *lses)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, *lses = ctx.saved_tensors
        spans = ctx.spans
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for (a, b), lse in zip(spans.long, lses, strict=False):
            views = (_heads_first(t, a, b) for t in (d_out, q, k, v, out))
            for into, g in zip(grads, _FLASH_CPU_BACKWARD(*views, lse, 0.0, True), strict=True):
                into[a:b] = g[0].transpose(0, 1)
        if spans.short:
            d_o = spans.gather(d_out)  # padding rows repeat a real token: their gradient must be zero
            d_o.view(-1, *d_o.shape[2:]).index_fill_(0, spans.padding, 0)
            views = (t.transpose(1, 2) for t in (d_o, *(spans.gather(t) for t in (q, k, v, out))))
            for into, g in zip(grads, _FLASH_CPU_BACKWARD(*views, lses[-1], 0.0, True), strict=True):
                spans.scatter(into, g)
        return *grads, None


@dataclass
class SharedPrefixSegments:
    """Packed rows where samples share a prompt (``prefix_ids``): each run of equal document ids
    is a segment of the flattened (B * T) tokens, causal within itself, and a segment whose
    tokens name a prefix document also sees all of that prefix's keys (its own row, earlier
    columns). The prompt of a GRPO group is then computed once for all its samples.

    Attention runs as one SDPA call over all segments, each a batch row: its queries, then as
    keys the prefix it names followed by its own tokens, padded to the longest (``query_idx``,
    ``key_idx`` and ``mask`` index the flat tokens; ``out_idx`` puts each token's output back,
    padding columns of the packed rows reading a zero row)."""

    document_ids: Tensor  # (B, T)
    prefix_ids: Tensor  # (B, T) the document each token may also attend to in full; 0: none
    query_idx: Tensor  # (S, Lq) flat token of each segment's query rows (0 past its end)
    key_idx: Tensor  # (S, Lk) flat token of each key: the named prefix, then its own tokens
    mask: Tensor  # (S, 1, Lq, Lk) bool, True = may attend
    out_idx: Tensor  # (B * T,) row of the (S * Lq + 1) outputs each token takes (the last is zeros)


def shared_prefix_segments(document_ids: Tensor, prefix_ids: Tensor) -> SharedPrefixSegments:
    """The segments of packed rows with shared prefixes (document id 0 is padding); a prefix must
    lie in the same row as, and before, every segment that names it."""
    B, T = document_ids.shape
    docs, prefixes = document_ids.flatten().tolist(), prefix_ids.flatten().tolist()
    runs: list[tuple[int, int]] = []  # (start, end) of each run of equal, non-zero document ids
    for row in range(B):
        start = row * T
        for i in range(row * T + 1, (row + 1) * T + 1):
            if i == (row + 1) * T or docs[i] != docs[start]:
                if docs[start]:
                    runs.append((start, i))
                start = i
    where = {docs[a]: (a, b) for a, b in runs}
    spans = []  # (start, end, prefix start, prefix end)
    for a, b in runs:
        p = prefixes[a]
        if not p:
            spans.append((a, b, a, a))
            continue
        if p not in where or where[p][1] > a or where[p][0] // T != a // T:
            raise ValueError(f"prefix_ids: tokens {a}..{b - 1} name prefix document {p}, which is not "
                             "earlier in the same row; place each shared prefix before its samples")
        spans.append((a, b, *where[p]))
    S = max(len(spans), 1)
    Lq = max((b - a for a, b, _, _ in spans), default=1)
    Lk = max((b - a + pb - pa for a, b, pa, pb in spans), default=1)
    query_idx, key_idx = [[0] * Lq for _ in range(S)], [[0] * Lk for _ in range(S)]
    mask = torch.zeros(S, Lq, Lk, dtype=torch.bool)
    mask[:, :, 0] = True  # a padding query row sees one key, so its softmax stays finite
    out_idx = [S * Lq] * (B * T)
    for s, (a, b, pa, pb) in enumerate(spans):
        n, p = b - a, pb - pa
        query_idx[s][:n] = range(a, b)
        key_idx[s][:p + n] = [*range(pa, pb), *range(a, b)]
        mask[s, :n, :p] = True
        mask[s, :n, p:p + n] = torch.ones(n, n, dtype=torch.bool).tril()
        out_idx[a:b] = range(s * Lq, s * Lq + n)
    device = document_ids.device
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return SharedPrefixSegments(document_ids, prefix_ids, as_long(query_idx), as_long(key_idx),
                                mask[:, None].to(device), as_long(out_idx))


def shared_prefix_attention(q: Tensor, k: Tensor, v: Tensor, segs: SharedPrefixSegments, gqa: bool) -> Tensor:
    """q (B, T, H, D), k/v (B, T, Hkv, D) -> (B, T, H, D): every segment a row of one SDPA call,
    over the keys of the prefix it names and its own (causal)."""
    B, T, H, D = q.shape
    fq, fk, fv = q.reshape(B * T, H, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)
    # gathered with index_select: its backward (index_add) is several times faster than advanced
    # indexing's (index_put with accumulate; 0.4 s of a SmolLM2 step at two threads); the outputs
    # go back the same way
    qs = _rows(fq, segs.query_idx).transpose(1, 2)  # (S, H, Lq, D)
    ks, vs = _rows(fk, segs.key_idx).transpose(1, 2), _rows(fv, segs.key_idx).transpose(1, 2)  # (S, Hkv, Lk, D)
    if takes_short_keys(qs, ks):
        o = short_key_attention(qs, ks, vs, segs.mask)  # (S, H, Lq, D)
    else:
        o = sdpa(qs, ks, vs, attn_mask=segs.mask, enable_gqa=gqa)
    o = torch.cat([o.transpose(1, 2).reshape(-1, H, D), o.new_zeros(1, H, D)])  # (S * Lq + 1, H, D)
    return o.index_select(0, segs.out_idx).view(B, T, H, D)


def _rows(flat: Tensor, idx: Tensor) -> Tensor:
    """flat (N, ...) at the rows idx (S, L) -> (S, L, ...)."""
    return flat.index_select(0, idx.flatten()).view(*idx.shape, *flat.shape[1:])


class _ShortKeyAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(D) + bias) v as batched matrix products, with its own backward: the
    CPU form of attention over short key rows (`short_key_attention`)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        probs = _short_key_probs(q, k, bias)  # (B * Hkv, G * Lq, Lk)
        B, H, Lq, D = q.shape
        Hkv = k.size(1)
        out = torch.bmm(probs, v.reshape(B * Hkv, -1, D)).view(B, H, Lq, D)
        ctx.save_for_backward(q, k, v, probs)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, probs = ctx.saved_tensors
        B, H, Lq, D = q.shape
        Hkv = k.size(1)
        kf, vf = k.reshape(B * Hkv, -1, D), v.reshape(B * Hkv, -1, D)
        d_o = d_out.reshape(B * Hkv, -1, D)  # (B * Hkv, G * Lq, D): a kv head's G query heads stacked
        dv = torch.bmm(probs.transpose(1, 2), d_o)
        dp = torch.bmm(d_o, vf.transpose(1, 2))  # (B * Hkv, G * Lq, Lk)
        # softmax backward: ds = p * (dp - sum(p * dp)), then the 1 / sqrt(D) of the scores
        ds = dp.sub_((dp * probs).sum(-1, keepdim=True)).mul_(probs).mul_(D ** -0.5)
        dq = torch.bmm(ds, kf).view(B, H, Lq, D)
        dk = torch.bmm(ds.transpose(1, 2), q.reshape(B * Hkv, -1, D)).view(B, Hkv, -1, D)
        return dq, dk, dv.view(B, Hkv, -1, D), None


def _short_key_probs(q: Tensor, k: Tensor, bias: Tensor) -> Tensor:
    """Attention probabilities (B * Hkv, G * Lq, Lk): the G query heads that share a kv head are
    one (G * Lq, D) block against that head's keys, so keys are never repeated for GQA."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.size(1), k.size(2)
    G = H // Hkv
    scores = torch.bmm(q.reshape(B * Hkv, G * Lq, D), k.reshape(B * Hkv, Lk, D).transpose(1, 2))
    scores = scores.view(B, Hkv, G, Lq, Lk).mul_(D ** -0.5).add_(bias[:, :, None])
    return torch.softmax(scores, dim=-1).view(B * Hkv, G * Lq, Lk)


def takes_short_keys(q: Tensor, k: Tensor) -> bool:
    """`short_key_attention` serves q (B, H, Lq, D) against k (B, Hkv, Lk, D): on a CPU, in
    float32 or float64, with key rows no longer than the head dimension (so the probabilities it
    keeps for backward take no more memory than the queries)."""
    return _plain_products(q) and k.size(2) <= q.size(3)


def _plain_products(q: Tensor) -> bool:
    """Attention as plain matrix products: on a CPU in float32 or float64 (under autocast SDPA
    keeps its float32 accumulation)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and not torch.is_autocast_enabled("cpu")


def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """One decode step's attention: q (Sd, Hkv, G, D), the G query heads of each kv head as G
    query rows, k/v (Sd, Hkv, L, D), bias (Sd, 1, 1, L) additive -> (Sd, Hkv, G, D).

    On a CPU in full precision, two matrix products and a softmax: a decode query row is one
    vector against its keys, where the flash kernel's tiling only adds work. Measured per layer
    at one / two threads: 64 rows x 2 kv heads x 30 keys (head 32) 71 / 68 against 98 / 229 us;
    SmolLM2's 32 rows x 3 kv heads x 600 keys (head 64) 2.5 / 1.2 against 2.5 / 1.8 ms; never
    slower up to 2,048 keys. Elsewhere SDPA."""
    if not _plain_products(q):
        return sdpa(q, k, v, attn_mask=bias)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.size(-1) ** -0.5).add_(bias)  # (Sd, Hkv, G, L)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def short_key_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q (B, H, Lq, D), k/v (B, Hkv, Lk, D), mask (B, 1, Lq, Lk) bool (True = may attend, every
    query row with at least one key) -> (B, H, Lq, D), as SDPA with `enable_gqa` computes it.

    On a CPU, PyTorch's flash kernel works in tiles sized for long sequences; over the short key
    rows of packed RL samples (a prompt and one completion: tens of keys) its per-tile work costs
    more than the arithmetic. Plain batched products there ran forward and backward together in
    0.55x the time at one thread, 0.3x at two (72 segments x 4 heads x 16 queries x 30 keys, head
    dimension 32: 1.8 against 3.2 ms, 0.7 against 2.5 ms). The probabilities are kept for
    backward; with key rows longer than the head dimension they would outweigh the queries, and
    recomputing them lost to the flash kernel (SmolLM2's 104 keys: 45 against 36 ms), so
    `takes_short_keys` sends those rows to SDPA."""
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return _ShortKeyAttention.apply(q, k, v, bias)


@dataclass
class PagedDecodeTables:
    """Paged decode read in place (`paged_kernel="varlen"`): the flash varlen kernel's block-table
    form visits each sequence's cache blocks where they lie, with no gathered copy."""

    block_table: Tensor  # (Sd, W) int32 cache blocks of each decoding sequence, padded with block 0
    seqused_k: Tensor  # (Sd,) int32 context length of each
    cu_seq_q: Tensor  # (Sd + 1,) int32: one query per sequence
    max_k: int

    @classmethod
    def build(cls, context_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str) -> PagedDecodeTables:
        w = -(-max(context_lens) // block_size)
        rows = [[c, *t[:w], *[0] * (w - len(t))] for c, t in zip(context_lens, block_tables)]
        host = to_device(torch.tensor(rows, dtype=torch.int32), device)  # (Sd, 1 + W): one transfer
        return cls(host[:, 1:], host[:, 0], torch.arange(len(context_lens) + 1, dtype=torch.int32, device=device),
                   max(context_lens))


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, t: PagedDecodeTables) -> Tensor:
    """q (Sd, H, D), caches (num_blocks, block_size, Hkv, D) -> (Sd, H, D): the varlen kernel on
    CUDA; elsewhere a reference with the same contract (gathers the blocks, masks past seqused_k)."""
    Sd, H, D = q.shape
    gqa = k_cache.size(2) != H
    qc = q.to(k_cache.dtype)
    if q.is_cuda:
        out = _varlen(qc, k_cache, v_cache, t.cu_seq_q, None, 1, t.max_k, gqa=gqa,
                      seqused_k=t.seqused_k, block_table=t.block_table)
        return out.to(q.dtype)
    blocks = t.block_table.long()
    L = blocks.size(1) * k_cache.size(1)
    kd = k_cache[blocks].view(Sd, L, -1, D).transpose(1, 2)  # (Sd, Hkv, L, D)
    vd = v_cache[blocks].view(Sd, L, -1, D).transpose(1, 2)
    real = torch.arange(L, device=q.device)[None, :] < t.seqused_k[:, None]  # (Sd, L)
    out = sdpa(qc[:, :, None], kd, vd, attn_mask=real[:, None, None], enable_gqa=gqa)
    return out[:, :, 0].to(q.dtype)  # (Sd, H, D)
