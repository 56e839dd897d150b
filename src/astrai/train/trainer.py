"""The offline training loop: epochs -> micro-batches -> objective -> backward -> step -> hooks.

Sits in the middle of the training data flow: a dataset and ``ResumableSampler`` from
``astrai.data`` feed micro-batches; an objective (``train/objectives/``) turns each into a
loss summed over its loss units; after ``grad_accum_steps`` micro-batches the gradient-step window
(``train/step.py``, shared with every loop, as is the micro-batch itself: ``TrainStep``)
normalises by the loss units of the whole window (all ranks), clips and steps, and callbacks log
and publish checkpoints (``train/callbacks.py``).
The run (ranks, model, objective, optimizer, callbacks) is built by ``train/build.py``, as
for the online loop; resume is ``train/resume.py``. Windows may span epochs. The stop event
of ``TrainContext`` is checked at every batch boundary; a stop inside a window drops the partial
window, so a resumed run restarts at that window's first micro-batch and matches an
uninterrupted run bit for bit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from astrai.config import Config
from astrai.data.sampler import ResumableSampler
from astrai.train import dist, resume
from astrai.train.build import (
    build_callbacks,
    build_datasets,
    build_run,
    callback_frame,
    common_state,
    load_common_state,
    setup_objective,
)
from astrai.train.context import TrainContext
from astrai.train.signals import pause_point
from astrai.train.step import TrainStep

Batch = dict[str, Any]


class Trainer:
    """Python API: ``Trainer(config, model=..., callbacks=[...]).train()``; anything not given is
    built from the config (model from ``model:`` or ``param_path``, data from ``data_path``)."""

    def __init__(self, config: Config, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 train_dataset: Any = None, val_dataset: Any = None, callbacks: list[Any] | None = None,
                 ctx: TrainContext | None = None, objective: Any = None):
        cfg = self.config = config
        self.ctx = ctx or TrainContext()
        run = build_run(cfg, model, tokenizer, objective)  # ranks, seed, tokenizer, model, objective, wrapping
        self.dist, self.device, self.is_main = run.dist, run.device, run.is_main
        self.tokenizer, self.raw_model, self.model, self.objective = run.tokenizer, run.raw_model, run.model, run.objective
        if train_dataset is None:
            train_dataset, built_val = build_datasets(cfg, self.tokenizer)
            val_dataset = val_dataset if val_dataset is not None else built_val
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.sampler = ResumableSampler(len(train_dataset), seed=cfg.train.random_seed, rank=self.dist.rank,
                                        world_size=self.dist.world_size, shuffle=True,
                                        lengths=self._sample_lengths() if cfg.data.group_by_length else None,
                                        group_size=cfg.train.batch_per_device * self.dist.world_size)

        self.total_steps = self._count_total_steps()
        self.optimizer, self.scheduler, self.grad_step = run.optimization(self.raw_model, cfg.optim, self.total_steps)
        setup_objective(run, self.total_steps)
        self.train_step = TrainStep(self.model, self.objective, self.grad_step, self.device, cfg.train.bf16)
        self.callbacks = build_callbacks(self, run, callbacks)
        self.step_metrics: dict[str, Any] = {}
        self._data_epoch, self._data_consumed = self.ctx.epoch, self.ctx.consumed_samples

    # ---------------------------------------------------------------------------- the loop

    def train(self) -> TrainContext:
        ctx, cbs, accum = self.ctx, self.callbacks, self.config.train.grad_accum_steps
        self._t_last = time.perf_counter()
        self._window_rng = resume.rng_state()
        with callback_frame(self):
            stopping = False
            t = self.config.train
            # max_steps, when set, decides alone (as many epochs as it takes); else n_epoch does
            while ctx.step < self.total_steps and (t.max_steps is not None or self._data_epoch < t.n_epoch):
                cbs.on_epoch_begin(self)
                for batch in self._epoch_batches():  # this rank's micro-batches, from the resume point on
                    stopping = self._should_stop()
                    if stopping:
                        break
                    cbs.on_batch_begin(self, batch)
                    # forward, backward, the window's sums; DDP all-reduces only in its last backward
                    out = self.train_step.micro_batch(batch, last=self.grad_step.size == accum - 1)
                    cbs.on_batch_end(self, batch, out)
                    if self.grad_step.size == accum:
                        self._optimizer_step()
                        if ctx.step >= self.total_steps:
                            break
                data_done = t.max_steps is None and ctx.step >= self.total_steps  # only a tail < 1 window left
                if self._data_consumed >= self.sampler.total_size or data_done:  # the epoch's data is used up
                    cbs.on_epoch_end(self)
                    self._next_epoch()
                if stopping:
                    break
            # a stop inside a window drops it: the resumed run starts again at its first micro-batch
            self.grad_step.drop()
        return ctx

    def _optimizer_step(self) -> None:
        ctx, cbs = self.ctx, self.callbacks
        result, tokens = self.train_step.finish(ctx, before_update=lambda: cbs.before_optimizer_step(self))
        ctx.epoch, ctx.consumed_samples = self._data_epoch, self._data_consumed
        now = time.perf_counter()
        self.step_metrics = {"step": ctx.step, "epoch": ctx.epoch, **result,
                             "tokens_per_s": tokens / max(now - self._t_last, 1e-9)}
        self.step_metrics.update(ctx.times.take(now - self._t_last))  # time_* (train/timing.py)
        if self._validation_due():
            self.step_metrics.update(self.evaluate())
        pause_point(f"step:{ctx.step}")  # test hook: a kill or a stop lands exactly here
        # where a resumed run restarts: a stop inside the next window must not save the RNG that
        # its dropped micro-batches consumed (dropout, e.g. lora_dropout)
        self._window_rng = resume.rng_state()
        cbs.after_optimizer_step(self)
        self._t_last = time.perf_counter()  # time spent saving is not training throughput

    # ------------------------------------------------------------------------- data

    def _epoch_batches(self) -> Iterator[Batch]:
        """This rank's micro-batches of the current data epoch, from the current position on;
        advances the data position (committed to ctx only by optimizer steps)."""
        self.sampler.set_epoch(self._data_epoch)
        self.sampler.set_consumed(self._data_consumed)
        indices: list[int] = []
        bs = self.config.train.batch_per_device
        for idx in self.sampler:
            indices.append(idx)
            if len(indices) == bs:
                self._data_consumed = self.sampler.consumed_samples
                yield self._to_device(self.train_dataset.collate([self.train_dataset[i] for i in indices]))
                indices = []
        if indices:  # the epoch's short last batch (same length on every rank: the sampler pads)
            self._data_consumed = self.sampler.consumed_samples
            yield self._to_device(self.train_dataset.collate([self.train_dataset[i] for i in indices]))

    def _next_epoch(self) -> None:
        self._data_epoch, self._data_consumed = self._data_epoch + 1, 0
        if self.grad_step.size == 0:  # nothing pending: the epoch boundary is also the commit point
            self.ctx.epoch, self.ctx.consumed_samples = self._data_epoch, 0

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}

    def _sample_lengths(self) -> Any:
        if not hasattr(self.train_dataset, "lengths"):
            raise ValueError(f"group_by_length=true needs a dataset with a lengths() method; "
                             f"{type(self.train_dataset).__name__} has none: set group_by_length false")
        return self.train_dataset.lengths()

    def _micro_batches_per_epoch(self) -> int:
        return math.ceil(len(self.sampler) / self.config.train.batch_per_device)

    def _count_total_steps(self) -> int:
        t = self.config.train
        if t.max_steps is not None:
            return t.max_steps
        total = t.n_epoch * self._micro_batches_per_epoch() // t.grad_accum_steps
        if total < 1:
            raise ValueError(
                f"{len(self.train_dataset)} samples give {self._micro_batches_per_epoch()} micro-batches per epoch, "
                f"fewer than grad_accum_steps={t.grad_accum_steps} over n_epoch={t.n_epoch}; "
                "lower grad_accum_steps or batch_per_device, or raise n_epoch"
            )
        return total

    # ------------------------------------------------------------------------- control

    def _should_stop(self) -> bool:
        """Single process: every batch boundary. Several ranks agree at window starts only, so a
        collective in the middle of a window never waits for a rank that already left."""
        if self.dist.world_size == 1:
            return self.ctx.stop_requested
        if self.grad_step.size != 0:
            return False
        return dist.stop_agreed(self.ctx)

    def _autocast(self):
        return dist.autocast(self.device, self.config.train.bf16)

    def _validation_due(self) -> bool:
        if self.val_dataset is None:
            return False
        interval = self.config.train.val_interval
        return (interval > 0 and self.ctx.step % interval == 0) or self.ctx.step == self.total_steps

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Objective on the validation data (this rank's shard), averaged over all loss units."""
        ds, cfg = self.val_dataset, self.config
        sampler = ResumableSampler(len(ds), rank=self.dist.rank, world_size=self.dist.world_size, shuffle=False)
        order = list(sampler)
        bs = cfg.train.batch_per_device
        sums: dict[str, Tensor] = {}  # "units", "loss" and the objective's metrics, summed over units
        self.raw_model.eval()
        try:
            for n, start in enumerate(range(0, len(order), bs)):
                if cfg.train.val_max_batches is not None and n >= cfg.train.val_max_batches:
                    break
                batch = self._to_device(ds.collate([ds[i] for i in order[start:start + bs]]))
                with self._autocast():
                    out = self.objective(self.raw_model, batch)
                for k, v in {"units": self.objective.num_units(batch), "loss": out.loss, **out.metrics}.items():
                    sums[k] = sums.get(k, 0.0) + v.detach().float()
        finally:
            self.raw_model.train()
        names = sorted(sums)
        totals = dict(zip(names, dist.all_reduce_sum(torch.stack([sums[k] for k in names])).tolist()))
        units = max(totals.pop("units"), 1.0)
        return {f"val/{k}": v / units for k, v in totals.items()}

    # ------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """JSON-able trainer state (trainer_state.json): the loops' common keys and the sampler;
        the RNG as it was at the last window boundary."""
        return {**common_state(self, getattr(self, "_window_rng", None)), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_common_state(self, state)
        self._data_epoch, self._data_consumed = self.ctx.epoch, self.ctx.consumed_samples
        self.sampler.set_epoch(self.ctx.epoch)
        self.sampler.set_consumed(self.ctx.consumed_samples)

    def extra_state(self) -> dict[str, dict[str, Any]]:
        """Checkpoint files beyond model, optimizer and schedule: none for the offline loop."""
        return {}

    def load_extra_state(self, states: dict[str, dict[str, Any]]) -> None:
        pass


