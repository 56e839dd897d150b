"""LoRA: low-rank adapters on named projections of a CausalLM, trained while the base is frozen.

`apply_lora(model, r, alpha, dropout, targets)` swaps the chosen `nn.Linear` projections (short
names q, k, v, o, gate, up, down, i.e. `*_proj`) for `LoraLinear`, which keeps the base
`weight`/`bias` under their original names (so state dicts and hf.py keep working) and adds
`lora_A` (r, in) and `lora_B` (out, r). Only adapter weights stay trainable. `merge_lora` folds
W + (alpha / r) * B @ A back into plain `nn.Linear`s. `merged_state_dict` gives the merged
weights without touching the model: `hf.save_model` writes a model that still carries adapters
through it, as a normal Hugging Face model directory (hf imports lora, never the reverse).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
               "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
DEFAULT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class LoraLinear(nn.Module):
    """y = x W^T + b + (alpha / r) * dropout(x) A^T B^T; B starts at zero, so y starts as the base's."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRA rank r must be a positive integer, got {r}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the base's own Parameter: same key, shared with any tie
        self.bias = base.bias
        self.r, self.alpha = r, alpha
        self.scaling = alpha / r
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear: variance ~ 1/in
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        base = F.linear(x, self.weight, self.bias)  # (..., out)
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)  # (..., out)
        return base + self.scaling * update

    def delta_weight(self) -> Tensor:
        return self.scaling * (self.lora_B @ self.lora_A)  # (out, in)

    def merged(self) -> nn.Linear:
        """A plain nn.Linear with W + delta; reuses the base Parameter so ties survive."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta")
        with torch.no_grad():
            self.weight.add_(self.delta_weight().to(self.weight.dtype))
        linear.weight = self.weight
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, alpha={self.alpha}"


def _resolve_targets(targets: tuple[str, ...] | list[str]) -> set[str]:
    unknown = [t for t in targets if t not in PROJECTIONS and t not in PROJECTIONS.values()]
    if unknown or not targets:
        raise ValueError(
            f"unknown LoRA target(s) {unknown or list(targets)}; choose from {list(PROJECTIONS)}"
        )
    return {PROJECTIONS.get(t, t) for t in targets}


def apply_lora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
) -> list[str]:
    """Wrap the target projections in place and freeze everything else; returns wrapped names."""
    names = _resolve_targets(targets)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in names and type(child) is nn.Linear:
                setattr(module, child_name, LoraLinear(child, r, alpha, dropout))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    if not wrapped:
        raise ValueError(f"no nn.Linear named {sorted(names)} found in {type(model).__name__}")
    for pname, p in model.named_parameters():
        p.requires_grad_(".lora_A" in f".{pname}" or ".lora_B" in f".{pname}")
    return wrapped


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Only the adapter tensors (what a LoRA run needs to save besides the frozen base)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place; the model is plain again (all
    parameters trainable, as a freshly loaded model)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoraLinear):
                setattr(module, child_name, child.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict the merged model would have, without changing `model`."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            prefix = f"{name}." if name else ""
            del state[prefix + "lora_A"], state[prefix + "lora_B"]
            state[prefix + "weight"] = module.weight + module.delta_weight().to(module.weight.dtype)
    return state

