"""Feed-forward blocks: the dense SwiGLU MLP and the mixture-of-experts layer that replaces it.

The MoE layer routes each token to its top-k experts with a softmax router (Qwen-MoE style:
optionally renormalised top-k weights, optionally a gated shared expert). In training mode it
also returns the Switch-style load-balancing loss and router statistics, which the decoder
averages over MoE layers and the objective weights by `router_aux_loss_coef`. Routing replay
(RL's `routing_replay`): given the experts another forward chose for each token (the rollout
engine's), the layer uses those instead of its own top-k; their gating weights still come from
this forward's router, so the router keeps its gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.model.config import ModelConfig
from astrai.model.ops import swiglu


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor, norm: nn.Module | None = None) -> Tensor:
        """down(silu(gate(h)) * up(h)) for h = x, or h = norm(x) for an `RMSNorm` `norm`. With
        gradients, plain linears run as one `swiglu` (which saves the products' inputs only);
        wrapped ones (LoRA), and everything without gradients, op by op."""
        if torch.is_grad_enabled() and self.fusable:  # inference skips the check: nothing is saved there
            return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                          norm=None if norm is None else (norm.weight, norm.eps))
        h = x if norm is None else norm(x)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    @property
    def fusable(self) -> bool:
        return all(type(p) is nn.Linear and p.bias is None for p in (self.gate_proj, self.up_proj, self.down_proj))


def load_balancing_loss(router_probs: Tensor, top_idx: Tensor, num_experts: int) -> Tensor:
    """Switch-style aux loss: num_experts * sum_e f_e * P_e.

    router_probs (N, E): softmax of the router over the N counted tokens; top_idx (N, k): the
    chosen experts. f_e is the fraction of tokens that chose expert e among their top-k (so the
    f_e sum to k), P_e the mean router probability of e. Uniform routing gives k.
    """
    chosen = F.one_hot(top_idx, num_experts).sum(dim=1).float()  # (N, E), 0/1
    f = chosen.mean(dim=0)  # (E,)
    p = router_probs.mean(dim=0)  # (E,)
    return num_experts * torch.sum(f * p)


@torch.no_grad()
def router_statistics(router_probs: Tensor, top_idx: Tensor, num_experts: int) -> dict[str, Tensor]:
    """Per-expert load (share of routed assignments), mean router entropy, dead-expert fraction."""
    counts = torch.bincount(top_idx.flatten(), minlength=num_experts).float()  # (E,)
    load = counts / counts.sum().clamp(min=1)
    entropy = -(router_probs * router_probs.clamp(min=1e-12).log()).sum(-1).mean()
    return {"load": load, "entropy": entropy, "dead_fraction": (counts == 0).float().mean()}


class Experts(nn.Module):
    """All routed experts of a layer as two fused weights (transformers 5's in-memory layout):
    gate_up_proj (E, 2I, C) and down_proj (E, C, I). Rows arrive sorted by expert, so the SwiGLU
    MLPs of all experts run as two grouped matmuls instead of 3E small ones."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def _can_group(self, x: Tensor) -> bool:
        # grouped_mm needs matching dtypes and row strides that are multiples of 16 bytes
        if not hasattr(F, "grouped_mm") or x.dtype != self.down_proj.dtype:
            return False
        _, C, inter = self.down_proj.shape
        return (C * x.element_size()) % 16 == 0 and (inter * x.element_size()) % 16 == 0

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (M, C) rows grouped by expert, counts (E,) rows per expert -> (M, C)."""
        w_gu = self.gate_up_proj.transpose(1, 2)  # (E, C, 2I)
        w_d = self.down_proj.transpose(1, 2)  # (E, I, C)
        if self._can_group(x):
            offs = counts.cumsum(0).to(torch.int32)
            g, u = F.grouped_mm(x, w_gu, offs=offs).chunk(2, dim=-1)  # (M, I) each
            return F.grouped_mm(F.silu(g) * u, w_d, offs=offs)
        parts = []  # fallback: one expert at a time over contiguous slices
        for e, xe in enumerate(x.split(counts.tolist())):
            g, u = (xe @ w_gu[e]).chunk(2, dim=-1)
            parts.append((F.silu(g) * u) @ w_d[e])
        return torch.cat(parts)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.collect_stats = True  # router statistics in training mode; the trainer turns them off when unread

    def forward(self, x: Tensor, token_mask: Tensor | None = None,
                routing: Tensor | None = None) -> tuple[Tensor, Tensor | None, dict, Tensor]:
        """x (B, T, C) -> (out (B, T, C), aux_loss or None, router stats, experts (B, T, k)).
        token_mask (B, T) drops padding from the aux loss and statistics. routing (B, T, k): the
        experts to use per token, in the order the router ranked them (a row whose first entry is
        negative uses this forward's own top-k); their gating weights are this router's softmax
        there (renormalised with norm_topk_prob), so the router's gradient flows as without replay."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        logits = self.gate(flat)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if routing is not None:
            given = routing.reshape(-1, self.top_k).to(top_idx.dtype)  # (N, k)
            top_idx = torch.where(given[:, :1] < 0, top_idx, given)
            top_w = probs.gather(1, top_idx)  # the same values and gradient as topk's where replayed == own
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        # sort the N*k (token, expert) assignments by expert once; experts run on contiguous rows
        flat_idx = top_idx.flatten()  # (N*k,)
        order = torch.argsort(flat_idx, stable=True)
        rows = order // self.top_k  # token of each sorted assignment
        counts = torch.bincount(flat_idx, minlength=self.num_experts)  # (E,)
        y = self.experts(flat[rows], counts) * top_w.flatten()[order, None]  # (N*k, C)
        out = torch.zeros_like(flat).index_add_(0, rows, y)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        aux, stats = None, {}
        if self.training:
            keep = token_mask.reshape(-1).bool() if token_mask is not None else slice(None)
            aux = load_balancing_loss(probs[keep], top_idx[keep], self.num_experts)
            if self.collect_stats:
                stats = router_statistics(probs[keep], top_idx[keep], self.num_experts)
        return out.view(B, T, C), aux, stats, top_idx.view(B, T, self.top_k)
