"""The online RL loop: rollout -> micro-batches -> gradient step -> publish the new policy version -> critic step.

Reads top to bottom in ``train``: every ``rollout_interval`` steps a batch of prompt records is
drawn (the same seeded, resumable sampler as offline training) and the live policy generates and
scores a rollout (``rl/rollout.py``); the objective pins its targets once; each optimizer step
backpropagates the rollout's micro-batches and ends the window in the shared gradient step
(``train/step.py``); then the policy version goes up by one and is published to the engine, so
no KV of older weights is reused; PPO's critic steps last, with its own optimizer. A rollout more than ``max_policy_lag`` versions old, or from a
future version, is an error. Checkpoints carry the policy version and, as extra state, the
rollout being reused, so a stopped run resumes bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import ExitStack
from typing import Any

import torch

from astrai.config import Config
from astrai.data.sampler import ResumableSampler
from astrai.model.lora import has_lora
from astrai.train import dist, resume
from astrai.train.build import (
    build_datasets,
    build_model,
    build_tokenizer,
    check_vocab,
    log_trainable,
    seed_everything,
)
from astrai.train.callbacks import arrange_callbacks, default_callbacks, requested_metrics
from astrai.train.context import TrainContext
from astrai.train.objectives import num_tokens
from astrai.train.optim import LRSchedule, build_optimizer
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.rollout import Rollout, RolloutRunner
from astrai.train.signals import pause_point
from astrai.train.step import GradientStep
from astrai.train.types import build_objective


def check_policy_lag(rollout_version: int, current: int, max_lag: int) -> None:
    """A rollout may be used only by the version that drew it and the next `max_lag` ones."""
    if rollout_version > current:
        raise ValueError(f"rollout was generated at policy version {rollout_version}, newer than the current "
                         f"version {current}; a rollout cannot come from the future")
    if current - rollout_version > max_lag:
        raise ValueError(f"rollout from policy version {rollout_version} is {current - rollout_version} versions "
                         f"behind the current version {current}, more than max_policy_lag={max_lag}; lower "
                         "--rollout_interval or raise --max_policy_lag")


class OnlineLoop:
    """Python API: ``OnlineLoop(config).train()``; the model and prompts come from the config."""

    def __init__(self, config: Config, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 prompts: Any = None, callbacks: list[Any] | None = None, ctx: TrainContext | None = None):
        cfg = self.config = config
        self.ctx = ctx or TrainContext()
        self.dist = dist.init_distributed(cfg.train.device)
        self.is_main = self.dist.rank == 0
        self.device = self.dist.device
        seed_everything(cfg.train.random_seed)
        self.tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg)
        if self.tokenizer is None:
            raise ValueError("online RL needs a tokenizer with a chat template: set tokenizer_path or param_path")
        self.raw_model = (model if model is not None else build_model(cfg)).to(self.device)
        log_trainable(self.raw_model, self.is_main)
        self.raw_model.gradient_checkpointing = cfg.train.gradient_checkpointing
        check_vocab(self.raw_model, self.tokenizer, cfg)
        self.objective = build_objective(cfg, self.raw_model)  # a KL reference copies the initial policy
        self.model = dist.wrap_model(self.raw_model, cfg.dist.parallel_mode, self.dist)
        self.prompts = prompts if prompts is not None else build_datasets(cfg, self.tokenizer)[0]
        self.sampler = ResumableSampler(len(self.prompts), seed=cfg.train.random_seed, rank=self.dist.rank,
                                        world_size=self.dist.world_size, shuffle=True)
        self.num_prompts = cfg.train.batch_per_device  # prompts per rollout on this rank
        rollouts_per_epoch = math.ceil(len(self.sampler) / self.num_prompts)
        self.total_steps = cfg.train.max_steps or cfg.train.n_epoch * rollouts_per_epoch * cfg.rl.rollout_interval
        self.optimizer = build_optimizer(self.raw_model, cfg.optim)
        self.scheduler = LRSchedule(self.optimizer, cfg.optim, self.total_steps)
        params = [p for p in self.raw_model.parameters() if p.requires_grad]  # LoRA: the adapters only
        self.grad_step = GradientStep(params, self.optimizer, self.scheduler,
                                      max_grad_norm=cfg.train.max_grad_norm, world_size=self.dist.world_size,
                                      device=self.device, max_nonfinite_steps=cfg.train.max_nonfinite_steps)
        self._build_critic()
        rewards = RewardSet(cfg.rl, self.device)
        self.runner = RolloutRunner(self.raw_model, self.tokenizer, cfg.rl, self.num_prompts, rewards,
                                    cfg.train.random_seed)
        # user callbacks see a step before the checkpoint of that step is published
        self.callbacks = arrange_callbacks(default_callbacks(self), list(callbacks or []))
        self.objective.requested_metrics = requested_metrics(self.callbacks.callbacks)
        self.rollout: Rollout | None = None
        self.step_metrics: dict[str, Any] = {}

    def _build_critic(self) -> None:
        """PPO: the objective's critic gets its own optimizer, schedule and gradient step, and is
        wrapped for DDP/FSDP like the policy."""
        cfg = self.config
        self.critic = getattr(self.objective, "critic", None)
        if self.critic is None:
            return
        self.critic_model = dist.wrap_model(self.critic, cfg.dist.parallel_mode, self.dist)
        self.objective.critic_module = self.critic_model
        optim = dataclasses.replace(cfg.optim, max_lr=cfg.rl.critic_lr or cfg.optim.max_lr)
        self.critic_optimizer = build_optimizer(self.critic, optim)
        self.critic_scheduler = LRSchedule(self.critic_optimizer, optim, self.total_steps)
        trainable = [p for p in self.critic.parameters() if p.requires_grad]  # LoRA: adapters and head
        self.critic_step = GradientStep(trainable, self.critic_optimizer, self.critic_scheduler,
                                        max_grad_norm=cfg.train.max_grad_norm, world_size=self.dist.world_size,
                                        device=self.device, max_nonfinite_steps=cfg.train.max_nonfinite_steps,
                                        name="critic")

    # ---------------------------------------------------------------------------- the loop

    def train(self) -> TrainContext:
        ctx, cbs, cfg = self.ctx, self.callbacks, self.config
        self.runner.set_policy_version(ctx.policy_version)
        cbs.on_train_begin(self)
        try:
            while ctx.step < self.total_steps and not self._should_stop():
                t0 = time.perf_counter()
                fresh = self.rollout is None or self.rollout.num_uses >= cfg.rl.rollout_interval
                if fresh:
                    self.rollout = self._next_rollout()
                rollout = self.rollout
                check_policy_lag(rollout.policy_version, ctx.policy_version, cfg.rl.max_policy_lag)
                batches = self.objective.batches(rollout, cfg.train.grad_accum_steps)
                # DDP: every rank runs as many backward passes (online DPO may have fewer pairs here)
                num = dist.max_over_ranks(len(batches)) if self.dist.world_size > 1 else len(batches)
                for i in range(num):
                    filler = i >= len(batches)  # a pass that only joins the gradient all-reduce
                    batch = batches[-1] if filler and batches else (
                        self.objective.filler_batch(rollout) if filler else batches[i])
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    with self._no_sync(i < num - 1), self._autocast():
                        out = self.objective(self.model, batch)
                    if filler:  # zero loss, zero units; its metric names keep the window's sums aligned
                        (out.loss * 0).backward()
                        self.grad_step.add(out.loss * 0, 0, 0, {k: torch.zeros_like(v) for k, v in out.metrics.items()})
                        if self.critic is not None:
                            self.critic_step.add(out.loss * 0, 0, 0)
                        continue
                    out.loss.backward()  # a sum over loss units; the window normalises it
                    units = self.objective.num_units(batch)
                    self.grad_step.add(out.loss, units, num_tokens(batch), out.metrics)
                    if self.critic is not None:
                        self.critic_step.add(out.metrics.get("value_loss", out.loss), units, 0)
                result = self.grad_step.step(ctx.step + 1, before_update=lambda: cbs.before_optimizer_step(self))
                rollout.num_uses += 1
                ctx.step += 1
                ctx.policy_version += 1
                self.runner.set_policy_version(ctx.policy_version)  # new weights: older KV is never served
                if self.critic is not None:  # after the policy step, outside the version publication
                    critic = self.critic_step.step(ctx.step)
                    result.update({"critic_lr": critic["lr"], "critic_grad_norm": critic["grad_norm"],
                                   "critic_skipped": critic["skipped"]})
                tokens = result.pop("num_tokens")
                ctx.tokens_seen += tokens
                seconds = time.perf_counter() - t0
                result["tokens_per_s"] = tokens / max(seconds, 1e-9)  # trained tokens (all ranks), rollout included
                self.step_metrics = self._metrics(result, rollout, fresh, seconds)
                pause_point(f"step:{ctx.step}")  # test hook: a kill or a stop lands exactly here
                cbs.after_optimizer_step(self)
        except BaseException as e:
            cbs.on_error(self, e)
            raise
        finally:
            cbs.on_train_end(self)
        return ctx

    def _next_rollout(self) -> Rollout:
        """Draw prompts (skipping batches whose prompts are all too long) and generate a rollout."""
        while True:
            batch = self._next_prompts()
            rollout = self.runner.generate(batch, self.ctx.step, self.ctx.policy_version,
                                           first_index=self.dist.rank * self.num_prompts)
            if rollout is not None:
                self.objective.prepare(rollout)
                return rollout

    def _next_prompts(self) -> dict[str, list[Any]]:
        """The next `batch_per_device` prompts of the seeded order; epochs roll over."""
        ctx = self.ctx
        if ctx.consumed_samples >= self.sampler.total_size:
            ctx.epoch, ctx.consumed_samples = ctx.epoch + 1, 0
        self.sampler.set_epoch(ctx.epoch)
        self.sampler.set_consumed(ctx.consumed_samples)
        indices = []
        for idx in self.sampler:
            indices.append(idx)
            if len(indices) == self.num_prompts:
                break
        ctx.consumed_samples = self.sampler.consumed_samples if len(indices) == self.num_prompts else \
            self.sampler.total_size
        return self.prompts.collate([self.prompts[i] for i in indices])

    def _metrics(self, result: dict[str, Any], rollout: Rollout, fresh: bool, seconds: float) -> dict[str, Any]:
        """The step's metrics; rollout statistics are means over ranks (every rank drew its own)."""
        if not fresh:
            result.pop("sampler_logp_diff", None)  # measured on a rollout's first step only
        r = rollout.rewards
        lengths = (rollout.labels != -100).sum(dim=1).float()
        stats = {"reward_mean": r.mean().item(), "reward_std": r.std(unbiased=False).item(),
                 "response_length_mean": lengths.mean().item(), "response_length_max": lengths.max().item()}
        for name, terms in rollout.reward_terms.items():
            stats[f"rewards/{name}"] = terms.mean().item()
            if not dist.any_rank(not bool(((terms == 0) | (terms == 1)).all())):  # 0/1 everywhere: a rate
                stats[f"rewards/{name}_rate"] = terms.mean().item()
        if fresh:
            stats.update(rollout.stats)
            stats["rollout_time_share"] = rollout.stats["rollout_seconds"] / max(seconds, 1e-9)
        return {"step": self.ctx.step, "epoch": self.ctx.epoch, "policy_version": self.ctx.policy_version,
                "rollout_policy_version": rollout.policy_version, **result, **dist.all_reduce_metrics(stats)}

    def _should_stop(self) -> bool:
        return dist.stop_agreed(self.ctx)  # every step boundary is a window boundary here

    def _no_sync(self, enabled: bool):
        """DDP: gradients are all-reduced only in the window's last backward (policy and critic)."""
        stack = ExitStack()
        stack.enter_context(dist.no_sync(self.model, enabled))
        if self.critic is not None:
            stack.enter_context(dist.no_sync(self.critic_model, enabled))
        return stack

    def _autocast(self):
        return dist.autocast(self.device, self.config.train.bf16)

    # ---------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        steps = {"grad_step": self.grad_step.state_dict()}
        if self.critic is not None:
            steps["critic_step"] = self.critic_step.state_dict()
        return {**self.ctx.state_dict(), **steps, "rng": resume.rng_state(),
                "callbacks": self.callbacks.state_dict(), "world_size": self.dist.world_size,
                "total_steps": self.total_steps, "config": self.config.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        resume.report_mismatches(state, self.config, self.dist.world_size, self.total_steps)
        self.ctx.load_state_dict(state)
        self.grad_step.load_state_dict(state.get("grad_step", {}))
        if self.critic is not None:
            self.critic_step.load_state_dict(state.get("critic_step", {}))
        self.callbacks.load_state_dict(state.get("callbacks", {}))
        resume.set_rng_state(state["rng"])

    def extra_state(self) -> dict[str, dict[str, Any]]:
        """The rollout being reused (empty when the next step draws a fresh one) and, for PPO, the
        critic and its optimizer and schedule (value_model.pt, value_optimizer.pt)."""
        states = {"rollout": self.rollout.state_dict() if self.rollout is not None else {}}
        if self.critic is not None:
            full = dist.is_fsdp(self.critic_model)
            value_model = dist.full_model_state_dict(self.critic_model) if full else self.critic.state_dict()
            trained = {n for n, p in self.critic.named_parameters() if p.requires_grad}
            if has_lora(self.critic):  # the frozen base is the policy's, already on disk: not saved again
                value_model = {k: v for k, v in value_model.items() if k in trained}
            states["value_model"] = value_model
            states["value_optimizer"] = {
                "optimizer": dist.full_optimizer_state_dict(self.critic_model, self.critic_optimizer),
                "scheduler": self.critic_scheduler.state_dict()}
        return states

    def load_extra_state(self, states: dict[str, dict[str, Any]]) -> None:
        state = states.get("rollout") or {}
        self.rollout = Rollout.from_state_dict(state) if state else None
        if self.critic is not None:
            saved = states["value_model"]
            if has_lora(self.critic):  # adapters and head only; the base is the policy's
                saved = {**self.critic.state_dict(), **saved}
            dist.load_full_model_state_dict(self.critic_model, saved)
            configured = [{k: v for k, v in g.items() if k != "params"} for g in self.critic_optimizer.param_groups]
            dist.load_full_optimizer_state_dict(self.critic_model, self.critic_optimizer,
                                                states["value_optimizer"]["optimizer"])
            for group, values in zip(self.critic_optimizer.param_groups, configured, strict=True):
                group.update(values)  # the config's critic_lr and betas win, as for the policy
            self.critic_scheduler.load_state_dict(states["value_optimizer"]["scheduler"])
