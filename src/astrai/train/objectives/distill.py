"""Distillation from a teacher: ``online_distill`` (the student samples, the teacher scores every
sampled token) and ``kd`` (offline, on the labelled tokens of SFT records).

``online_distill`` is GRPO's machinery with the teacher as the advantage: ``prepare`` asks the
teacher (``teacher.py``) for the log-prob of each sampled token in one prefill per row, and pins
the per-token advantage log pi_teacher - log pi_student (the sampler's log-prob of the token), so
the existing ratio, clipping and importance weights train the student towards the teacher: a
policy gradient on the per-token reverse KL (``distill_loss: reverse_kl_pg``, Thinking Machines'
on-policy distillation). ``distill_coef`` adds that times the task reward's advantage (the
``advantage_estimator`` on ``rewards``). ``distill_loss: jsd`` instead adds the generalized JSD
(``losses.generalized_jsd``, ``distill_beta``) between the full distributions of the student and a
local teacher at every sampled position (TRL's on-policy GKD); the surrogate then carries only the
task term. Metrics: ``distill/reverse_kl`` (the mean over sampled tokens of log pi_student - log
pi_teacher, on a rollout's first step) and ``distill/teacher_seconds`` (the teacher's scoring
time). ``kd`` (``KDObjective``) is the same JSD on an SFT batch's labelled tokens, plus an MoE
student's load-balancing loss as ``sft`` adds it (``base.add_moe_terms``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from astrai.config import Config
from astrai.train.losses import IGNORE_INDEX, aggregate_token_loss, generalized_jsd
from astrai.train.objectives.base import (
    Batch,
    Companion,
    LossOutput,
    add_moe_terms,
    aux_coef,
    labelled_positions,
    wants,
)
from astrai.train.objectives.grpo import GRPOObjective
from astrai.train.objectives.packing import forward_rows
from astrai.train.objectives.rollout_steps import loss_mask
from astrai.train.objectives.teacher import LocalTeacher, build_teacher

if TYPE_CHECKING:
    from astrai.train.build import Run
    from astrai.train.rl.data import Rollout


def jsd_terms(model: nn.Module, teacher: LocalTeacher, batch: Batch, beta: float,
              layout: str = "pad") -> tuple[Tensor, Tensor, Any]:
    """(per-token generalized JSD (B, K), loss mask (B, K), the student's forward output) of the
    batch's labelled positions, the student's full distribution against the teacher's (temperature
    1), both models running the rows in `layout` (``packing.forward_rows``)."""
    labels = batch["labels"]
    idx = labelled_positions(labels)
    mask = labels != IGNORE_INDEX if idx is None else (labels != IGNORE_INDEX)[:, idx]
    student, rows = forward_rows(model, batch, layout, head=lambda hidden, lm_head: lm_head(hidden))
    teacher_logits = teacher.logits(batch, layout)  # (M, V)
    per_token = generalized_jsd(student.head.float().log_softmax(-1), teacher_logits.log_softmax(-1), beta)  # (M,)
    return rows.scatter(per_token, idx), mask, student


class OnlineDistillObjective:
    """On-policy distillation: GRPO's surrogate (``GRPOObjective(online=True)``) on the teacher's
    per-token advantages, or with ``jsd`` the divergence to a local teacher beside it."""

    companions: tuple[Companion, ...] = ()

    def __init__(self, cfg: Config, model: nn.Module):
        o = cfg.objective
        self.inner = GRPOObjective(cfg, model, online=True)
        self.loss, self.beta, self.coef = o.distill_loss, o.distill_beta, o.distill_coef
        self.agg, self.max_len = cfg.rl.rl_loss_agg, cfg.rl.rollout_max_tokens
        self.teacher = build_teacher(cfg, model)
        if self.loss == "jsd" and not isinstance(self.teacher, LocalTeacher):
            raise ValueError("distill_loss jsd compares full distributions and needs a local teacher; set "
                             "--teacher_path, or use --distill_loss reverse_kl_pg with teacher_url")
        self.layout = self.inner.layout

    @property
    def requested_metrics(self) -> frozenset[str] | None:
        return self.inner.requested_metrics

    @requested_metrics.setter
    def requested_metrics(self, names: frozenset[str] | None) -> None:
        self.inner.requested_metrics = names

    def setup(self, run: Run, total_steps: int) -> None:
        """Nothing is trained beside the student; the teacher is frozen."""

    def num_units(self, batch: Batch) -> Tensor:
        return self.inner.num_units(batch)

    def prepare(self, rollout: Rollout) -> None:
        """Score the rollout's sampled tokens with the teacher once and pin the advantages:
        log pi_teacher - log pi_student per token (reverse_kl_pg) plus distill_coef times the
        task advantage (the only term with jsd)."""
        self.inner.prepare(rollout)  # the task advantages, keep, the trainer's log-probs to pin
        start = time.perf_counter()
        teacher = self.teacher.label_logps(rollout)  # (N, T), 0 off-label
        seconds = time.perf_counter() - start
        labelled = rollout.labels != IGNORE_INDEX
        gap = torch.where(labelled, teacher - rollout.old_logps, 0.0)  # (N, T): -(log student - log teacher)
        rollout.stats["distill/reverse_kl"] = float(-gap.sum() / labelled.sum().clamp(min=1))
        rollout.stats["distill/teacher_seconds"] = seconds
        task = rollout.pinned["advantages"]
        task = task[:, None].expand_as(gap) if task.dim() == 1 else task
        advantages = self.coef * task if self.coef else torch.zeros_like(gap)
        if self.loss == "reverse_kl_pg":
            advantages = advantages + gap
        rollout.pinned["advantages"] = torch.where(labelled, advantages, 0.0).contiguous()

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        out = self.inner(model, batch)
        if self.loss == "jsd":
            assert isinstance(self.teacher, LocalTeacher)
            per_token, mask, _ = jsd_terms(model, self.teacher, batch, self.beta)
            total, _ = aggregate_token_loss(per_token, loss_mask(batch, mask), self.agg, self.max_len)
            out.loss = out.loss + total
            if wants(self.requested_metrics, "distill/jsd"):
                out.metrics["distill/jsd"] = total.detach()
        return out

    def batches(self, rollout: Rollout, num_micro: int) -> list[Batch]:
        return self.inner.batches(rollout, num_micro)

    def filler_batch(self, rollout: Rollout, batches: list[Batch]) -> Batch:
        return self.inner.filler_batch(rollout, batches)


class KDObjective:
    """Offline distillation (``kd``): the generalized JSD (``distill_beta``) between the student's
    and a local teacher's full distributions at the labelled tokens of SFT records (TRL's GKD with
    no on-policy fraction); the loss unit is a labelled token."""

    requested_metrics: frozenset[str] | None = None
    companions: tuple[Companion, ...] = ()

    def __init__(self, cfg: Config, model: nn.Module):
        teacher = build_teacher(cfg, model)
        if not isinstance(teacher, LocalTeacher):
            raise ValueError("kd needs a local teacher; set --teacher_path")
        self.teacher, self.beta = teacher, cfg.objective.distill_beta
        self.layout = cfg.objective.row_layout
        self.aux_coef = aux_coef(cfg, model)

    def setup(self, run: Run, total_steps: int) -> None:
        """Nothing is trained beside the student; the teacher is frozen."""

    def num_units(self, batch: Batch) -> Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput:
        per_token, _, out = jsd_terms(model, self.teacher, batch, self.beta, self.layout)  # (B, K), 0 off-label
        loss = per_token.sum()
        metrics = {"distill/jsd": loss.detach()} if wants(self.requested_metrics, "distill/jsd") else {}
        loss = add_moe_terms(out, loss, self.num_units(batch), self.aux_coef, metrics, self.requested_metrics)
        return LossOutput(loss, metrics)

