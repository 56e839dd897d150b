"""Feed-forward blocks: the dense SwiGLU MLP and the mixture-of-experts layer that replaces it.

The MoE layer routes each token to its top-k experts with a softmax router (Qwen-MoE style:
optionally renormalised top-k weights, optionally a gated shared expert). In training mode it
also returns the Switch-style load-balancing loss and router statistics, which the decoder
averages over MoE layers and the objective weights by `router_aux_loss_coef`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.model.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None, dict]:
        """x (B, T, C) -> (out (B, T, C), aux_loss or None, router stats). token_mask (B, T) drops
        padding from the aux loss and statistics."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        logits = self.gate(flat)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(flat)
        # loop over experts, not tokens: each expert runs once on the rows routed to it
        for e in torch.unique(top_idx).tolist():
            rows, slot = torch.where(top_idx == e)
            y = self.experts[e](flat[rows]) * top_w[rows, slot, None]
            out.index_add_(0, rows, y)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        aux, stats = None, {}
        if self.training:
            keep = token_mask.reshape(-1).bool() if token_mask is not None else slice(None)
            aux = load_balancing_loss(probs[keep], top_idx[keep], self.num_experts)
            stats = router_statistics(probs[keep], top_idx[keep], self.num_experts)
        return out.view(B, T, C), aux, stats
