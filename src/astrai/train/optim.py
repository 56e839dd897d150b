"""Optimizers and learning-rate schedules, built from the ``optim`` config section.

Sits between the model and the trainer: ``build_optimizer`` groups the model's parameters
(weight decay only on 2-D weight matrices unless ``decay_all_params``) into AdamW, or into Muon
for the 2-D hidden matrices plus AdamW for everything else; ``LRSchedule`` sets every group's lr
once per optimizer step (constant, cosine with warmup and a floor, or warmup-stable-decay).
Both have ``state_dict``/``load_state_dict`` so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from astrai.config import OptimConfig
from astrai.config_values import CHOICES

OPTIMIZERS = CHOICES["optimizer"]  # the config's closed choices; each is implemented here
SCHEDULES = CHOICES["schedule"]


class OptimizerList:
    """Several optimizers stepped as one (Muon + AdamW); exposes the union of their param groups."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state.get("optimizers", [])) != len(self.optimizers):
            raise ValueError(
                f"optimizer state holds {len(state.get('optimizers', []))} optimizers, this run has "
                f"{len(self.optimizers)}; resume with the same --optimizer"
            )
        for opt, sd in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(sd)


def _is_hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """Muon applies to 2-D weights inside the blocks; embeddings and the LM head stay on AdamW."""
    return param.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name


def _adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for g in groups for p in g["params"]]
    # fused kernels exist for CPU and CUDA floating tensors; DTensor (FSDP2) params fall back
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for p in params)
    return torch.optim.AdamW(
        groups, lr=cfg.max_lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused or None
    )


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer | OptimizerList:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters; nothing to optimise")
    if cfg.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise ValueError("optimizer 'muon' needs torch.optim.Muon (torch >= 2.9); use --optimizer adamw")
        hidden = [p for n, p in named if _is_hidden_matrix(n, p)]
        rest = [(n, p) for n, p in named if not _is_hidden_matrix(n, p)]
        # match_rms_adamw scales Muon's update to AdamW's RMS, so one max_lr serves both
        muon = torch.optim.Muon(
            hidden, lr=cfg.max_lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        opts: list[torch.optim.Optimizer] = [muon]
        if rest:
            opts.append(_adamw(_decay_groups(rest, cfg), cfg))
        return OptimizerList(opts)
    return _adamw(_decay_groups(named, cfg), cfg)


def _decay_groups(named: list[tuple[str, nn.Parameter]], cfg: OptimConfig) -> list[dict[str, Any]]:
    decay = [p for _, p in named if cfg.decay_all_params or p.ndim >= 2]
    no_decay = [p for _, p in named if not (cfg.decay_all_params or p.ndim >= 2)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


# ------------------------------------------------------------------------------ schedules


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of max_lr for the optimizer step that follows ``step`` completed steps."""
    warmup = num_warmup_steps(cfg, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd: hold max_lr, then decay linearly to the floor over the last decay_ratio of the steps
    decay_steps = max(1, round(cfg.decay_ratio * total_steps))
    decay_start = max(warmup, total_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
    return 1.0 - (1.0 - floor) * progress


def num_warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else round((cfg.warmup_ratio or 0.0) * total_steps)


def warmup_warning(cfg: OptimConfig, total_steps: int) -> str | None:
    """A run's start line when warmup outlasts the run: the learning rate never reaches max_lr."""
    warmup = num_warmup_steps(cfg, total_steps)
    if warmup <= total_steps:
        return None
    return (f"warning: warmup_steps {warmup} is more than the run's {total_steps} optimizer steps, so the learning "
            f"rate ends at {total_steps / warmup:.0%} of max_lr without reaching it; lower --warmup_steps "
            f"(or --warmup_ratio) or raise --max_steps")


class LRSchedule:
    """Sets ``lr = initial_lr * lr_factor(step)`` on every param group; stepped per optimizer step."""

    def __init__(self, optimizer: Any, cfg: OptimConfig, total_steps: int):
        self.optimizer = optimizer
        self.cfg = cfg
        self.total_steps = max(1, total_steps)
        self.step_count = 0
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.apply()

    def apply(self) -> None:
        """Set every group's lr for the current step (also after a resume changed initial_lr)."""
        factor = lr_factor(self.step_count, self.total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def step(self) -> None:
        self.step_count += 1
        self.apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # the schedule's length comes from this run's config (a resumed run may extend max_steps);
        # the trainer reports when it differs from the checkpoint's
        self.step_count = int(state["step_count"])
        self.apply()
