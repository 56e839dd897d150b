"""Grouped-query attention with rotary embeddings, for training and for paged inference.

One module serves both worlds. In training (and plain evaluation) it attends over a padded
(B, T) batch, masking padding; packed rows (several documents each) attend within each document,
with no (T, T) mask (`kernels.packed_attention`). In inference the
engine hands it a flat row of the tokens scheduled this step (several sequences back to back)
and a `PagedAttentionMetadata` (paged_metadata.py): new keys and values are written into the
paged KV cache and each sequence attends over its cached context.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from astrai.model.config import ModelConfig
from astrai.model.kernels import (
    PackedSegments,
    SharedPrefixSegments,
    decode_attention,
    packed_attention,
    packed_segments,
    paged_decode,
    sdpa,
    shared_prefix_attention,
    shared_prefix_segments,
)
from astrai.model.ops import apply_rope, norm_linears, rms_norm
from astrai.model.paged_metadata import PagedAttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # float32 statistics keep bf16 training stable; the weight multiplies in the input dtype
        return rms_norm(x, self.weight, self.eps)


# -- rotary position embeddings ----------------------------------------------------------------
def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies (head_dim / 2,), with `linear` or `llama3` scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(inv_freq: Tensor, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin (B, T, head_dim) for integer positions (B, T), computed in float32."""
    freqs = position_ids.float()[..., None] * inv_freq.float()  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# -- masks for training batches ----------------------------------------------------------------
def document_ids_from_positions(position_ids: Tensor) -> Tensor | None:
    """Document ids (B, T) from position resets, or None when no row restarts its positions."""
    resets = position_ids[:, 1:] <= position_ids[:, :-1]  # (B, T-1)
    if not bool(resets.any()):
        return None
    starts = torch.cat([torch.zeros_like(position_ids[:, :1], dtype=torch.bool), resets], dim=1)
    return starts.long().cumsum(dim=1)


def build_attention_mask(
    attention_mask: Tensor | None, document_ids: Tensor | None, T: int, device: torch.device,
    prefix_ids: Tensor | None = None,
) -> Tensor | PackedSegments | SharedPrefixSegments | None:
    """Boolean mask (B, 1, T, T), True = may attend; None when plain causal attention suffices;
    packed rows as `PackedSegments` (per-document attention, no mask: the varlen kernel on CUDA)
    when they have no padding or their padding is document 0 and no real token's
    (``train/objectives/packing.py``'s padding-free rows); rows whose samples share prompts
    (`prefix_ids`) as `SharedPrefixSegments`."""
    if prefix_ids is not None:
        if document_ids is None:
            raise ValueError("prefix_ids name prefix documents: pass the document_ids of the packed rows too")
        return shared_prefix_segments(document_ids, prefix_ids)
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # no padding: plain causal attention takes the faster kernel
    if attention_mask is None and document_ids is None:
        return None
    if document_ids is not None:
        # padding as a document of its own only attends to padding: per-document attention applies
        if attention_mask is None or bool(((document_ids != 0) == attention_mask.bool()).all()):
            return packed_segments(document_ids)  # each document's own square: no (B, T, T) mask at all
    return dense_document_mask(attention_mask, document_ids, T, device)


def dense_document_mask(attention_mask: Tensor | None, document_ids: Tensor | None, T: int,
                        device: torch.device | str) -> Tensor:
    """The dense form, for rows whose padding shares a real token's document id: causal and
    block-diagonal over documents, minus padding keys (B, 1, T, T)."""
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None]  # (1, T, T)
    if document_ids is not None:
        allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])  # (B, T, T)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    # a padding query may attend to nothing; let it see itself so softmax stays finite
    allowed = allowed | torch.eye(T, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


def shared_prefix_dense_mask(document_ids: Tensor, prefix_ids: Tensor, T: int, device: torch.device | str) -> Tensor:
    """`SharedPrefixSegments` as a dense (B, 1, T, T) mask: causal, within each document or
    onto the prefix document a token names."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    onto_prefix = (prefix_ids[:, :, None] == document_ids[:, None, :]) & (prefix_ids != 0)[:, :, None]
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None] & (same | onto_prefix)
    return (allowed | torch.eye(T, dtype=torch.bool, device=device)[None])[:, None]


# -- the attention module ----------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
        meta: PagedAttentionMetadata | None = None, query_idx: Tensor | None = None,
        norm: RMSNorm | None = None,
    ) -> Tensor:
        """x (B, T, C) -> (B, T, C), attending over norm(x) when a `norm` is given; with
        `query_idx` (K,) (padded batches only) only those positions query, every position still
        gives keys and values, and the result is (B, K, C)."""
        B, T, _ = x.shape
        cos_q, sin_q = (cos, sin) if query_idx is None else (cos[:, query_idx], sin[:, query_idx])
        q, k, v = self._project(x, norm, query_idx)
        q = q.view(B, q.size(1), self.num_heads, self.head_dim)  # (B, Tq, H, D)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos, sin)
        if isinstance(mask, PackedSegments):
            if query_idx is not None:  # zero queries elsewhere: their rows are computed and dropped
                q = q.new_zeros(B, T, *q.shape[2:]).index_copy(1, query_idx, q)
            out = packed_attention(q, k, v, mask, self.num_kv_heads != self.num_heads)  # (B, T, H, D)
            if query_idx is not None:
                out = out.index_select(1, query_idx)
            return self.o_proj(out.reshape(B, out.size(1), self.num_heads * self.head_dim))
        elif isinstance(mask, SharedPrefixSegments):
            if query_idx is None:
                out = shared_prefix_attention(q, k, v, mask, self.num_kv_heads != self.num_heads)
                return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))
            mask = shared_prefix_dense_mask(mask.document_ids, mask.prefix_ids, T, x.device)
        if meta is None:
            if query_idx is not None:  # rows of the (T, T) mask for the querying positions only
                if mask is None:
                    mask = (torch.arange(T, device=x.device) <= query_idx[:, None])[None, None]  # (1, 1, K, T)
                else:
                    mask = mask[:, :, query_idx]  # (B, 1, K, T)
            out = sdpa(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask, is_causal=mask is None, enable_gqa=self.num_kv_heads != self.num_heads,
            )  # (B, H, Tq, D)
            out = out.transpose(1, 2)
        else:
            out = self._paged(q[0], k[0], v[0], meta)[None]
        return self.o_proj(out.reshape(B, q.size(1), self.num_heads * self.head_dim))

    def _project(self, x: Tensor, norm: RMSNorm | None, query_idx: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """q (at `query_idx` only, when given), k and v of norm(x). With gradients and plain
        linears, one `norm_linears`: the normed input is recomputed in backward, not saved."""
        if norm is not None and query_idx is None and torch.is_grad_enabled() and self.fusable:
            projections = (self.q_proj, self.k_proj, self.v_proj)
            return norm_linears(x, norm.weight, norm.eps, [p.weight for p in projections],
                                [p.bias for p in projections])
        if norm is not None:
            x = norm(x)
        return self.q_proj(x if query_idx is None else x[:, query_idx]), self.k_proj(x), self.v_proj(x)

    @property
    def fusable(self) -> bool:
        """q, k and v are plain linears (not LoRA-wrapped): the norm may run inside them."""
        return all(type(p) is nn.Linear for p in (self.q_proj, self.k_proj, self.v_proj))

    def _gather(self, cache: Tensor, blocks: Tensor) -> Tensor:
        """Whole cache blocks, back to back: (len(blocks) * block_size, Hkv, D)."""
        return torch.index_select(cache, 0, blocks).view(-1, self.num_kv_heads, self.head_dim)

    def _paged(self, q: Tensor, k: Tensor, v: Tensor, meta: PagedAttentionMetadata) -> Tensor:
        """q (N, H, D), k/v (N, Hkv, D) of the flat step batch -> (N, H, D)."""
        k_cache, v_cache = meta.kv_caches[self.layer_idx]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)  # (slots, Hkv, D)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))
        gqa = self.num_kv_heads != self.num_heads
        decode_only = not meta.prefills and meta.decode_token_idx is not None
        out = None if decode_only else torch.empty_like(q)
        for seg in meta.prefills:
            qs = q[seg.start : seg.end].transpose(0, 1)[None]  # (1, H, Tq, D)
            if seg.blocks is None:
                ks = k[seg.start : seg.end].transpose(0, 1)[None]  # (1, Hkv, Tq, D)
                vs = v[seg.start : seg.end].transpose(0, 1)[None]
            else:
                ks = self._gather(k_cache, seg.blocks)[: seg.context_len].transpose(0, 1)[None].to(q.dtype)
                vs = self._gather(v_cache, seg.blocks)[: seg.context_len].transpose(0, 1)[None].to(q.dtype)
            o = sdpa(
                qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None, enable_gqa=gqa
            )
            out[seg.start : seg.end] = o[0].transpose(0, 1)
        if meta.paged_decode is not None:
            o = paged_decode(q if decode_only else q[meta.decode_token_idx], k_cache, v_cache, meta.paged_decode)
            if decode_only:
                return o
            out[meta.decode_token_idx] = o.to(out.dtype)
        elif meta.decode_token_idx is not None:
            Sd, L = meta.decode_token_idx.numel(), meta.decode_mask.size(-1)
            G = self.num_heads // self.num_kv_heads
            # one query per sequence: the G query heads of a kv head attend like G query positions,
            # so keys and values are never repeated for GQA
            qd = q if decode_only else q[meta.decode_token_idx]  # a decode-only step: every token decodes
            qd = qd.view(Sd, self.num_kv_heads, G, self.head_dim)  # (Sd, Hkv, G, D)
            if meta.decode_view is not None:
                new_k, new_v = (k, v) if decode_only else (k[meta.decode_token_idx], v[meta.decode_token_idx])
                kd, vd = meta.decode_view.layer_kv(self.layer_idx, k_cache, v_cache, new_k, new_v)
                kd, vd = kd[:, :, :L], vd[:, :, :L]  # (Sd, Hkv, L, D) views of the dense copy
            else:
                blocks = meta.decode_blocks.flatten()
                kd = self._gather(k_cache, blocks).view(Sd, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
                vd = self._gather(v_cache, blocks).view(Sd, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
            o = decode_attention(qd, kd.to(q.dtype), vd.to(q.dtype), meta.decode_mask.to(q.dtype))  # (Sd, Hkv, G, D)
            if decode_only:
                return o.reshape(Sd, self.num_heads, self.head_dim)
            # under autocast o is bf16 while out has q's dtype (float32 after rope): index_put needs one dtype
            out[meta.decode_token_idx] = o.reshape(Sd, self.num_heads, self.head_dim).to(out.dtype)
        return out
