"""Attention kernels chosen by device type, each with the CPU reference the suite checks it against.

attention.py calls these where a CUDA device has a faster kernel than the dense SDPA forms that
serve the CPU: packed training rows (several documents in one row, no padding) go through the
flash varlen kernel with segment offsets instead of a (B, T, T) block-diagonal mask, and paged
decode (`paged_kernel="varlen"`, opt-in until a device run has checked it) reads each sequence's
KV blocks where they lie in the cache through the kernel's block-table form instead of gathering
a dense copy. On CPU the same functions run a plain-SDPA reference with the same arguments, so
the tables and offsets they are given are tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def to_device(host: Tensor, device: torch.device | str) -> Tensor:
    """A host-built index tensor on `device`: through pinned memory and an asynchronous copy on CUDA
    (a pageable copy would block the host), as it is on CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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


def packed_attention(q: Tensor, k: Tensor, v: Tensor, segs: PackedSegments, gqa: bool) -> Tensor:
    """q (B, T, H, D), k/v (B, T, Hkv, D) -> (B, T, H, D), causal within each segment: the flash
    varlen kernel on CUDA, one causal SDPA call per segment elsewhere (the CPU reference)."""
    B, T, H, D = q.shape
    fq, fk, fv = q.reshape(B * T, H, D), k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(fq, fk, fv, segs.cu_seqlens, segs.cu_seqlens, segs.max_seqlen, segs.max_seqlen,
                          window_size=(-1, 0), enable_gqa=gqa)
        return out.view(B, T, H, D)
    out = torch.empty_like(fq)
    bounds = segs.cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[a:b] = F.scaled_dot_product_attention(
            fq[a:b].transpose(0, 1)[None], fk[a:b].transpose(0, 1)[None], fv[a:b].transpose(0, 1)[None],
            is_causal=True, enable_gqa=gqa)[0].transpose(0, 1)
    return out.view(B, T, H, D)


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
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(qc, k_cache, v_cache, t.cu_seq_q, None, 1, t.max_k, enable_gqa=gqa,
                          seqused_k=t.seqused_k, block_table=t.block_table)
        return out.to(q.dtype)
    blocks = t.block_table.long()
    L = blocks.size(1) * k_cache.size(1)
    kd = k_cache[blocks].view(Sd, L, -1, D).transpose(1, 2)  # (Sd, Hkv, L, D)
    vd = v_cache[blocks].view(Sd, L, -1, D).transpose(1, 2)
    real = torch.arange(L, device=q.device)[None, :] < t.seqused_k[:, None]  # (Sd, L)
    out = F.scaled_dot_product_attention(qc[:, :, None], kd, vd, attn_mask=real[:, None, None], enable_gqa=gqa)
    return out[:, :, 0].to(q.dtype)  # (Sd, H, D)
