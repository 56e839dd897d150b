"""The decoder-only causal language model: the one model of astrai.

Training, RL rollouts and serving all run this module. `CausalLM.forward` takes a padded batch
(training, evaluation, parity with transformers) or, with `attn_metadata`, a flat row of tokens
from several sequences whose keys and values live in the engine's paged KV cache. Submodule and
parameter names match Hugging Face's Llama/Qwen layout, so checkpoints map by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from astrai.model.attention import (
    Attention,
    RMSNorm,
    build_attention_mask,
    document_ids_from_positions,
    rope_cos_sin,
    rope_inv_freq,
)
from astrai.model.config import ModelConfig
from astrai.model.moe import MLP, MoE
from astrai.model.paged_metadata import PagedAttentionMetadata


@dataclass
class ModelOutput:
    logits: Tensor | None  # (B, T, V), or (B, K, V) when logits_indices selects K positions; None with `head`
    hidden_states: Tensor  # after the final norm: (B, T, C); (B, K, C) at logits_indices in padded batches
    aux_loss: Tensor | None = None  # MoE load-balancing loss (training mode only)
    router_stats: dict[str, Tensor] = field(default_factory=dict)
    head: Any = None  # what forward's `head` returned (chunked log-probs), when one was given
    routing: Tensor | None = None  # (B, T, MoE layers, k) experts of every token, with return_routing


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp = MoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
        meta: PagedAttentionMetadata | None, token_mask: Tensor | None, keep: Tensor | None = None,
        routing: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, dict, Tensor | None]:
        """x (B, T, C) -> (B, T, C); with `keep` (K,) only those positions' outputs, (B, K, C). A
        MoE layer also gives the experts (B, T, k) it used: its own, or `routing`'s (replayed)."""
        # the norms run inside the projections that read them (their outputs are not saved)
        attn = self.self_attn(x, cos, sin, mask, meta, query_idx=keep, norm=self.input_layernorm)
        x = x + attn if keep is None else x[:, keep] + attn
        if self.is_moe:
            y, aux, stats, experts = self.mlp(self.post_attention_layernorm(x), token_mask, routing)
        else:
            y, aux, stats, experts = self.mlp(x, norm=self.post_attention_layernorm), None, {}, None
        return x + y, aux, stats, experts


class Transformer(nn.Module):
    """The trunk (embeddings, blocks, final norm); `CausalLM.model` and the critic's trunk."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.gradient_checkpointing = False

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        attn_metadata: PagedAttentionMetadata | None = None,
        keep: Tensor | None = None,
        *,
        prefix_ids: Tensor | None = None,
        routing: Tensor | None = None,
        return_routing: bool = False,
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor], Tensor | None]:
        """input_ids (B, T) -> (hidden (B, T, C), mean MoE aux loss or None, mean router stats,
        experts (B, T, MoE layers, k) with `return_routing`, else None).

        `keep` (K,), padded batches only: the positions whose hidden states are wanted; hidden is
        then (B, K, C). A dense last layer computes only those rows (every layer before it still
        computes all positions, since later positions attend to their keys and values): when
        only the reply of an SFT or DPO row carries a loss, its prompt skips the last layer's
        query, attention output and MLP work.

        `prefix_ids` (B, T) with `document_ids`, packed rows only: each token also attends to all
        of the document it names (0: none), a prompt placed once before the samples that share it
        (``train/objectives/packing.py``, layout ``share``).

        `routing` (B, T, MoE layers, k): routing replay, the experts each MoE layer uses per token
        (``MoE.forward``; a row whose first entry is negative routes on its own).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        window = self.config.sliding_window
        if window is not None and attn_metadata is None and T > window and int(position_ids.max()) >= window:
            raise ValueError(
                f"a sequence reaches position {int(position_ids.max())} but sliding_window is {window}: astrai "
                f"attends over the full context, which equals the window only up to {window} tokens; "
                f"use sequences of at most {window} tokens"
            )
        mask = None
        if attn_metadata is None:
            if document_ids is None:
                document_ids = document_ids_from_positions(position_ids)
            mask = build_attention_mask(attention_mask, document_ids, T, input_ids.device, prefix_ids)
        x = self.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, x.dtype)  # (B, T, D) each
        if keep is not None and attn_metadata is not None:
            raise ValueError("keep applies to padded batches; paged batches select rows with logits_indices")
        prune = keep is not None and not self.layers[-1].is_moe  # MoE statistics need every token
        moe_layers = [i for i, layer in enumerate(self.layers) if layer.is_moe]
        if routing is not None and tuple(routing.shape[:3]) != (B, T, len(moe_layers)):
            raise ValueError(f"routing has shape {tuple(routing.shape)} but replaying it needs (batch {B}, tokens {T}, "
                             f"MoE layers {len(moe_layers)}, experts per token); record it from this model's forward")
        aux_losses, stats, experts = [], [], []
        for i, layer in enumerate(self.layers):
            rows = keep if prune and i == len(self.layers) - 1 else None
            replay = routing[:, :, len(experts)] if routing is not None and layer.is_moe else None
            if self.gradient_checkpointing and self.training:
                x, aux, st, chosen = checkpoint(
                    layer, x, cos, sin, mask, attn_metadata, attention_mask, rows, replay, use_reentrant=False
                )
            else:
                x, aux, st, chosen = layer(x, cos, sin, mask, attn_metadata, attention_mask, rows, replay)
            if chosen is not None:
                experts.append(chosen)
            if aux is not None:
                aux_losses.append(aux)
                stats.append(st)
        aux_loss = torch.stack(aux_losses).mean() if aux_losses else None
        router_stats = {k: torch.stack([s[k] for s in stats]).mean(0) for k in stats[0]} if stats else {}
        if keep is not None and not prune:
            x = x[:, keep]
        chosen = torch.stack(experts, dim=2) if return_routing and experts else None  # (B, T, L, k)
        return self.norm(x), aux_loss, router_stats, chosen


class WithTrunk(nn.Module):
    """A model built on a ``Transformer`` trunk (``self.model``): the causal LM, the critic, the
    sequence classifier. Gradient checkpointing is the trunk's."""

    model: Transformer

    @property
    def gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        self.model.gradient_checkpointing = enabled


class CausalLM(WithTrunk):
    def __init__(self, config: ModelConfig, seed: int | None = 0, device: torch.device | str | None = None) -> None:
        """Build the model. `seed` gives a deterministic init (None: leave PyTorch's init);
        `device="meta"` builds without allocating, for loading weights afterwards."""
        super().__init__()
        self.config = config
        with torch.device(device) if device is not None else nullcontext():
            self.model = Transformer(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if seed is not None and str(device) != "meta":
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, initializer_range) weights, zero biases, unit norms; the projections that
        write into the residual stream (o_proj, down_proj) are scaled by 1/sqrt(2 * layers)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.initializer_range
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                s = residual_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)
        self.model.inv_freq = rope_inv_freq(self.config).to(self.model.inv_freq.device)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        attn_metadata: PagedAttentionMetadata | None = None,
        logits_indices: Tensor | None = None,
        head: Callable[[Tensor, nn.Module], Any] | None = None,
        *,
        prefix_ids: Tensor | None = None,
        routing: Tensor | None = None,
        return_routing: bool = False,
    ) -> ModelOutput:
        """Logits at every position, or at `logits_indices` only: in padded batches (K,) positions
        of every row, for which the last layer computes just those rows; in paged batches (K,)
        indices into the flat row. `head` (padded batches): called as head(hidden, lm_head)
        instead of the lm head, e.g. chunked log-probs (`model/chunked_head.py`) that never hold
        the logits; its result is `head` of the output and `logits` is None. It runs here, inside
        the model's forward, so FSDP's unshard and reshard hooks cover the lm head's weight.
        `prefix_ids`: shared prompts in packed rows (`Transformer.forward`). `routing` (B, T, MoE
        layers, k): the experts to replay; `return_routing`: the output's `routing` holds the
        experts every MoE layer used (the engine records them for routing replay)."""
        moe = {"routing": routing, "return_routing": return_routing}
        if attn_metadata is None:
            hidden, aux_loss, router_stats, chosen = self.model(
                input_ids, attention_mask, position_ids, document_ids, keep=logits_indices, prefix_ids=prefix_ids, **moe
            )
            if head is not None:
                return ModelOutput(None, hidden, aux_loss, router_stats, head=head(hidden, self.lm_head), routing=chosen)
            return ModelOutput(self.lm_head(hidden), hidden, aux_loss, router_stats, routing=chosen)
        hidden, aux_loss, router_stats, chosen = self.model(input_ids, attention_mask, position_ids, document_ids,
                                                            attn_metadata, **moe)
        h = hidden if logits_indices is None else hidden[:, logits_indices]
        return ModelOutput(self.lm_head(h), hidden, aux_loss, router_stats, routing=chosen)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[tuple[Tensor, Tensor]]:
        """Per-layer (k, v) caches, each (num_blocks, block_size, num_kv_heads, head_dim)."""
        ref = self.lm_head.weight
        shape = (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype or ref.dtype, device=device or ref.device),
             torch.zeros(shape, dtype=dtype or ref.dtype, device=device or ref.device))
            for _ in range(self.config.num_hidden_layers)
        ]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

