"""The online RL loop: rollout -> micro-batches -> gradient step -> publish the new policy version.

Reads top to bottom in ``train``: every ``rollout_interval`` steps (or ``ppo_epochs`` passes of
``mini_batches`` steps, each on its share of the samples) a batch of prompt records is
drawn (the same seeded, resumable sampler as offline training) and the episode runner draws and
scores a rollout (``rl/runner.py``) through the rollout sampler (``rl/engine_sampler.py``: the
engine over the live policy); the objective pins its targets once; each optimizer step
backpropagates the rollout's micro-batches and ends the window in the shared gradient step
(``train/step.py``); then the policy version goes up by one and is published to the sampler, so
no KV of older weights is reused; the objective's companions (PPO's critic, with its own
optimizer) step last. The run itself is built by ``train/build.py``, as for the offline loop. A
rollout more than ``max_policy_lag`` versions old, or from a future version, is an error.
Checkpoints carry the policy version and, one file per rank, the rollout each rank is reusing
(ranks draw their own prompts) and that rank's RNG, so a stopped run resumes bit for bit on any
number of ranks. Under FSDP the engine generates on an unsharded replica of the policy, refreshed
once per policy version before a fresh rollout (``sync_weights``): no engine step is a collective.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from astrai.config import Config
from astrai.config_checks import steps_per_rollout
from astrai.data.sampler import ResumableSampler
from astrai.train import dist, resume
from astrai.train.build import (
    build_callbacks,
    build_datasets,
    build_run,
    callback_frame,
    common_state,
    companions,
    load_common_state,
    setup_objective,
)
from astrai.train.context import TrainContext
from astrai.train.host_memory import HeapTrim, set_mmap_threshold
from astrai.train.losses import IGNORE_INDEX
from astrai.train.objectives.base import update_reference
from astrai.train.objectives.logps import trainer_logps_pins
from astrai.train.rl.data import Rollout
from astrai.train.rl.draws import RolloutDraws
from astrai.train.rl.engine_sampler import engine_runner
from astrai.train.rl.environments import check_hooks
from astrai.train.rl.http_sampler import http_runner
from astrai.train.rl.pipeline import RolloutPipeline, rollout_source
from astrai.train.rl.process_sampler import ProcessSampler, process_runner
from astrai.train.rl.rewards import RewardSet
from astrai.train.signals import pause_point
from astrai.train.step import TrainStep


def prompt_lengths(prompts: Any) -> list[int]:
    """Every prompt's token count: from the record store when the data set has one (no decoding)."""
    store = getattr(prompts, "store", None)
    if store is not None and hasattr(store, "lengths"):
        return [int(n) for n in store.lengths("prompt_ids")]
    return [len(prompts[i]["prompt_ids"]) for i in range(len(prompts))]


def check_prompts_fit(lengths: list[int], max_prompt_len: int, room: int) -> None:
    """At start: a data set with no prompt within max_prompt_len would only ever be skipped.
    `room`: the longest prompt the model's positions allow beside rollout_max_tokens."""
    if not lengths or min(lengths) <= max_prompt_len:
        return
    shortest = min(lengths)
    fix = (f"raise --max_prompt_len to at least {shortest}" if shortest <= room else
           f"shorten the prompts or lower --rollout_max_tokens: the model's positions leave {room} tokens for one")
    raise ValueError(f"every one of the {len(lengths)} prompts is longer than max_prompt_len={max_prompt_len} "
                     f"tokens (the shortest has {shortest}), so no rollout could be drawn; {fix}")


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
        set_mmap_threshold(cfg.rl.host_mmap_threshold_mb)  # before the model: nothing fragments the heap first
        self.heap = HeapTrim()
        self.heap.start(cfg.rl.host_keep_heap, cfg.rl.host_mmap_threshold_mb)
        check_hooks(cfg.rl.environment, list(cfg.rl.tools))  # a mistyped name is the first error, before the model's
        run = build_run(cfg, model, tokenizer)  # ranks, seed, tokenizer, model, objective, wrapping
        self.dist, self.device, self.is_main = run.dist, run.device, run.is_main
        self.tokenizer, self.raw_model, self.model, self.objective = run.tokenizer, run.raw_model, run.model, run.objective
        self.prompts = prompts if prompts is not None else build_datasets(cfg, self.tokenizer)[0]
        self.sampler = ResumableSampler(len(self.prompts), seed=cfg.train.random_seed, rank=self.dist.rank,
                                        world_size=self.dist.world_size, shuffle=True)
        self.num_prompts = cfg.train.batch_per_device  # prompts per rollout on this rank
        rollouts_per_epoch = math.ceil(len(self.sampler) / self.num_prompts)
        self.steps_per_rollout = steps_per_rollout(cfg.rl)
        self.total_steps = cfg.train.max_steps or cfg.train.n_epoch * rollouts_per_epoch * self.steps_per_rollout
        self.optimizer, self.scheduler, self.grad_step = run.optimization(self.raw_model, cfg.optim, self.total_steps)
        setup_objective(run, self.total_steps)  # PPO: the critic's wrapping, optimizer and gradient step
        self.companions = companions(self.objective)
        self.train_step = TrainStep(self.model, self.objective, self.grad_step, self.device, cfg.train.bf16,
                                    self.companions)
        # a reward model with its own tokenizer re-encodes; a stop request interrupts a slow user reward
        # (async_steps: only the run's end does; a stop keeps the rollouts in flight for the checkpoint)
        self.pipeline: RolloutPipeline | None = None
        stop = (lambda: self.pipeline.cancelled) if cfg.rl.async_steps else (lambda: self.ctx.stop_requested)
        rewards = RewardSet(cfg.rl, self.device, tokenizer=self.tokenizer, should_stop=stop)
        if cfg.rl.rollout_servers:  # `astrai serve` replicas draw every turn over HTTP (rl/http_sampler.py)
            weights_dir = cfg.rl.rollout_weights_dir or str(Path(cfg.log.log_dir) / "rollout_weights")
            make_runner = lambda model: http_runner(model, self.tokenizer, cfg.rl, rewards, weights_dir,  # noqa: E731
                                                    cfg.train.random_seed, base_model=cfg.train.param_path)
        elif cfg.rl.async_steps and rollout_source(cfg.rl, self.model, self.device) == "process":  # rl/process_sampler.py
            make_runner = lambda model: process_runner(model, self.tokenizer, cfg.rl,  # noqa: E731
                                                       max(1, self.num_prompts * cfg.rl.group_size), rewards,
                                                       torch.get_num_threads(), cfg.train.random_seed, bf16=cfg.train.bf16)
        else:  # the in-process engine over the policy (rl/engine_sampler.py); bf16: the training precision
            make_runner = lambda model: engine_runner(model, self.tokenizer, cfg.rl,  # noqa: E731
                                                      max(1, self.num_prompts * cfg.rl.group_size), rewards,
                                                      cfg.train.random_seed, bf16=cfg.train.bf16)
        if cfg.rl.async_steps:  # a thread draws the rollouts k ahead from its own copy of the weights (rl/pipeline.py)
            self.pipeline = RolloutPipeline(self.model, cfg, self.prompts, self.num_prompts, make_runner,
                                            self.steps_per_rollout, math.ceil(self.total_steps / self.steps_per_rollout),
                                            torch.get_num_threads())
            self.runner = self.pipeline.runner
        else:  # the live policy
            self.runner = make_runner(self.raw_model)
        # the sampler over the training weights (evaluation uses it); async_steps: none, the copy's is the thread's
        self.rollout_sampler = self.runner.sampler if self.pipeline is None else None
        if self.pipeline is not None and self.is_main:
            size = sum(t.numel() * t.element_size() for t in [*self.pipeline.copy.parameters(),
                                                               *self.pipeline.copy.buffers()])
            where = "a thread, the engine in a process of its own" if isinstance(self.runner.sampler, ProcessSampler) \
                else "a thread"
            print(f"note: async_steps {cfg.rl.async_steps}: rollouts are drawn on {where} ({torch.get_num_threads()} "
                  f"torch thread(s)) over a copy of the weights ({size / 2**20:.1f} MiB), {cfg.rl.async_steps} "
                  "rollout(s) ahead of training", file=sys.stderr)
        if getattr(self.rollout_sampler, "replica", None) is not None and self.is_main:  # FSDP: the memory the replica costs, said once
            replica = self.rollout_sampler.replica
            size = sum(t.numel() * t.element_size() for t in [*replica.parameters(), *replica.buffers()])
            print(f"note: parallel_mode fsdp: each rank generates rollouts on an unsharded replica of the policy "
                  f"({size / 2**20:.1f} MiB per rank), refreshed once per policy version", file=sys.stderr)
        check_prompts_fit(prompt_lengths(self.prompts), self.runner.max_prompt_len,
                          self.raw_model.config.max_position_embeddings - cfg.rl.rollout_max_tokens)
        self.draws = RolloutDraws(self.runner, self.prompts, self.sampler, self.num_prompts, cfg.rl, self.dist.rank,
                                  self.dist.world_size, self._should_stop, self._any_rank, self.heap.rollout)
        self.callbacks = build_callbacks(self, run, callbacks)
        self.rollout: Rollout | None = None
        self.step_metrics: dict[str, Any] = {}

    # ---------------------------------------------------------------------------- the loop

    def train(self) -> TrainContext:
        try:
            ctx = self._train()
        finally:
            if self.pipeline is not None:  # after the last checkpoint, which saved the rollouts in flight
                self.pipeline.close()
        if self.pipeline is not None and self.config.rl.rollout_servers:  # the servers end on the final policy
            self.pipeline.end_on(self.model, ctx.policy_version)
        return ctx

    def _train(self) -> TrainContext:
        ctx, cbs, cfg = self.ctx, self.callbacks, self.config
        self._publish(ctx.policy_version)
        with callback_frame(self):
            if self.pipeline is not None:
                self.pipeline.start(ctx.epoch, ctx.consumed_samples)
            while ctx.step < self.total_steps and not self._should_stop():
                t0 = time.perf_counter()
                fresh = self.rollout is None or self.rollout.num_uses >= self.steps_per_rollout
                if fresh and self.pipeline is not None:
                    self.rollout = self._take_ahead()
                elif fresh:
                    # FSDP: the engine's replica gathers the new weights; rollout servers load them
                    # (rl/http_sampler.py); every rank, same point
                    sync_start = time.perf_counter()
                    self.rollout_sampler.sync_weights(ctx.policy_version)
                    sync_seconds = time.perf_counter() - sync_start
                    ctx.times.add("weight_sync", sync_seconds)
                    position, rng = (ctx.epoch, ctx.consumed_samples), resume.rng_state()
                    if (drawn := self._next_rollout()) is None:  # a stop request came while drawing
                        # as after the last step: a checkpoint now resumes into the same draws
                        ctx.epoch, ctx.consumed_samples = position
                        resume.set_rng_state(rng)
                        break
                    self.rollout = drawn
                    if cfg.rl.rollout_servers:
                        drawn.stats["weight_sync_seconds"] = sync_seconds
                    if cfg.rl.mini_batches > 1:
                        self._pin_old_logps(drawn)
                rollout = self.rollout
                check_policy_lag(rollout.policy_version, ctx.policy_version, cfg.rl.max_policy_lag)
                lag = ctx.policy_version - rollout.policy_version
                batches = self._step_batches(rollout, rollout.num_uses)
                # DDP: every rank runs as many backward passes (online DPO may have fewer pairs here)
                num = dist.max_over_ranks(len(batches)) if self.dist.world_size > 1 else len(batches)
                for i in range(num):
                    filler = i >= len(batches)  # a pass that only joins the gradient all-reduce
                    batch = self.objective.filler_batch(rollout, batches) if filler else batches[i]
                    out = self.train_step.micro_batch(batch, last=i == num - 1, filler=filler)
                    if out.pins:  # online RL: the trainer's log-probs at the rollout's weights
                        rollout.pin(batch["sample_index"], out.pins)
                # new weights: the sampler never serves older KV; the critic steps after that
                result, tokens = self.train_step.finish(ctx, before_update=lambda: cbs.before_optimizer_step(self),
                                                        publish=self._publish)
                rollout.num_uses += 1
                update_reference(self._moving_reference(), self.raw_model, ctx.step, cfg.rl.ref_reset_interval,
                                 cfg.rl.ref_ema)
                seconds = time.perf_counter() - t0
                result["tokens_per_s"] = tokens / max(seconds, 1e-9)  # trained tokens (all ranks), rollout included
                self.step_metrics = {**self._metrics(result, rollout, fresh, seconds), "policy_lag": lag}
                # time_*; async_steps: the rollout's part of the step is the trainer's wait for it
                timed = {"rollout_seconds": rollout.stats["async_wait_seconds"]} if fresh and self.pipeline else \
                    rollout.stats if fresh else None
                self.step_metrics.update(ctx.times.take(seconds, timed))
                pause_point(f"step:{ctx.step}")  # test hook: a kill or a stop lands exactly here
                cbs.after_optimizer_step(self)
            if cfg.rl.rollout_servers and self.pipeline is None:  # the servers end on the final policy
                self.rollout_sampler.sync_weights(ctx.policy_version)
            if self.runner.num_skipped_total:  # the total of what was warned about once
                where = f"rank {self.dist.rank}: " if self.dist.world_size > 1 else ""
                print(f"{where}skipped {self.runner.num_skipped_total} prompt(s) in all longer than max_prompt_len="
                      f"{self.runner.max_prompt_len}", file=sys.stderr)
        return ctx

    def _publish(self, version: int) -> None:
        """A new policy version to the sampler over the training weights (none with async_steps)."""
        if self.rollout_sampler is not None:
            self.rollout_sampler.set_policy_version(version)

    def _take_ahead(self) -> Rollout:
        """async_steps: the rollout of this step, drawn ahead (``rl/pipeline.py``), after handing the
        current weights to the rollouts still to be drawn; prepared by the objective now, with the
        critic and reference of this step. The ratio's old log-probs are the sampler's (the
        behaviour policy's, async_steps versions behind): the weights that drew it are gone."""
        ctx = self.ctx
        drawn, waited = self.pipeline.take(ctx.step // self.steps_per_rollout, self.model, ctx.policy_version)
        ctx.epoch, ctx.consumed_samples = drawn.epoch, drawn.consumed_samples  # after this rollout's prompts
        rollout = drawn.rollout
        rollout.stats["async_wait_seconds"] = waited
        with ctx.times.span("reference"):  # reference log-probs, critic values, advantages
            self.objective.prepare(rollout)
        if rollout.trainer_logps is not None:
            rollout.trainer_logps = torch.where(rollout.labels != IGNORE_INDEX, rollout.old_logps, 0.0)
        return rollout

    def _moving_reference(self) -> torch.nn.Module | None:
        """The objective's KL reference when ``ref_reset_interval`` or ``ref_ema`` moves it."""
        rl = self.config.rl
        return getattr(self.objective, "reference", None) if rl.ref_reset_interval or rl.ref_ema is not None else None

    def _step_batches(self, rollout: Rollout, use: int) -> list[Any]:
        """The micro-batches of the rollout's `use`-th optimizer step: the whole rollout, or with
        ``mini_batches`` > 1 its mini-batch ``use % mini_batches`` of samples in order (a rollout
        with fewer samples than mini-batches, dynamic sampling's last resort, repeats them)."""
        num_micro, num_mini = self.config.train.grad_accum_steps, self.config.rl.mini_batches
        if num_mini == 1:
            return self.objective.batches(rollout, num_micro)
        chunks = torch.arange(rollout.num_samples).tensor_split(min(num_mini, rollout.num_samples))
        return self.objective.batches(rollout, num_micro, chunks[use % num_mini % len(chunks)])

    def _pin_old_logps(self, rollout: Rollout) -> None:
        """``mini_batches`` > 1: the ratio's old log-probs of every sample (the trainer's at the
        rollout's weights), computed before the rollout's first step and pinned; each later
        mini-batch then measures its ratio against them, so the clip acts. Every rank runs as many
        forwards (FSDP gathers in each one)."""
        if rollout.trainer_logps is None:  # an objective that does not use them
            return
        batches = [b for k in range(self.config.rl.mini_batches) for b in self._step_batches(rollout, k)]
        num = dist.max_over_ranks(len(batches)) if self.dist.world_size > 1 else len(batches)
        with torch.no_grad(), dist.autocast(self.device, self.config.train.bf16):
            for i in range(num):
                batch = batches[i] if i < len(batches) else self.objective.filler_batch(rollout, batches)
                on_device = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                pins = trainer_logps_pins(self.objective, self.model, on_device)
                if i < len(batches):
                    rollout.pin(batch["sample_index"], pins)

    def _next_rollout(self) -> Rollout | None:
        """Draw prompts and generate a rollout (``rl/draws.py``) and let the objective prepare it;
        None when a stop request came first (agreed by every rank: checked after each draw, and a
        user reward waits for it in short slices)."""
        rollout = self.draws.rollout(self.ctx, self.ctx.step, self.ctx.policy_version)
        if rollout is not None:
            with self.ctx.times.span("reference"):  # reference log-probs, critic values, advantages
                self.objective.prepare(rollout)
        return rollout

    def _any_rank(self, flag: bool) -> bool:
        return dist.any_rank(flag) if self.dist.world_size > 1 else flag

    def _metrics(self, result: dict[str, Any], rollout: Rollout, fresh: bool, seconds: float) -> dict[str, Any]:
        """The step's metrics; rollout statistics are means over ranks (every rank drew its own)."""
        if not fresh:
            result.pop("sampler_logp_diff", None)  # measured on a rollout's first step only
        r = rollout.rewards
        lengths = (rollout.labels != -100).sum(dim=1).float()
        # reward_std is TRL's: the mean over groups of each group's std (what GRPO's advantages divide
        # by); reward_std_batch is the population std over the whole rollout
        group_std = r.std(dim=1) if r.size(1) > 1 else torch.zeros(r.size(0))
        stats = {"reward_mean": r.mean().item(), "reward_std": group_std.mean().item(),
                 "reward_std_batch": r.std(unbiased=False).item(),
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

    # ---------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        state = common_state(self)
        if self.pipeline is not None:  # the prompt position after the rollouts drawn ahead (saved with them)
            self.pipeline.settle()
            state["epoch"], state["consumed_samples"] = self.pipeline.position.epoch, self.pipeline.position.consumed_samples
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_common_state(self, state)

    def extra_state(self) -> dict[str, dict[str, Any]]:
        """Each companion's files (PPO: the critic, its optimizer and schedule) and, when
        ``ref_reset_interval`` or ``ref_ema`` moves it, the KL reference (``reference_model.pt``)."""
        states: dict[str, dict[str, Any]] = {}
        for companion in self.companions:
            states.update(companion.extra_state())
        if (reference := self._moving_reference()) is not None:  # no longer the initial policy
            states["reference_model"] = reference.state_dict()
        return states

    def load_extra_state(self, states: dict[str, dict[str, Any]]) -> None:
        for companion in self.companions:
            companion.load_extra_state(states)
        if (reference := self._moving_reference()) is not None:
            reference.load_state_dict(states["reference_model"])

    def rank_state(self) -> dict[str, dict[str, Any]]:
        """What this rank alone holds, saved as its own file (``rollout.pt`` on rank 0,
        ``rollout_rank<R>.pt`` on rank R): the rollout it drew and is reusing (none before the
        first), and its RNG (a user's reward may draw from it; the sampler's position and the
        counters are global, in trainer_state.json)."""
        state = self.rollout.state_dict() if self.rollout is not None else {}
        states = {"rollout": {**state, "rng": resume.rng_state()}}
        if self.pipeline is not None:  # async_steps: the rollouts drawn ahead, and the position of this one
            states["pipeline"] = {**self.pipeline.state_dict(), "taken": [self.ctx.epoch, self.ctx.consumed_samples]}
        return states

    def load_rank_state(self, states: dict[str, dict[str, Any]]) -> None:
        state = dict(states.get("rollout") or {})
        rng = state.pop("rng", None)  # absent from checkpoints written before it was saved per rank
        self.rollout = Rollout.from_state_dict(state) if state else None
        if rng is not None:
            resume.set_rng_state(rng)
        if self.pipeline is not None and states.get("pipeline"):
            self.pipeline.load_state_dict(states["pipeline"])
            self.ctx.epoch, self.ctx.consumed_samples = states["pipeline"]["taken"]
