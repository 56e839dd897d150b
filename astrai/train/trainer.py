"""The training loop: epochs -> micro-batches -> objective -> backward -> clip -> step -> hooks.

Sits in the middle of the training data flow: a dataset and ``ResumableSampler`` from
``astrai.data`` feed micro-batches; an objective (``train/objectives.py``) turns each into a
loss summed over its loss units; after ``grad_accum_steps`` micro-batches the accumulated
gradient is divided by the loss units of the whole window (all ranks), so the update does not
depend on how a batch is split into micro-batches. Then the gradient is clipped (its pre-clip
norm is the step's ``grad_norm``), the optimizer and the schedule step, and callbacks log and
publish checkpoints (``train/callbacks.py``). Windows may span epoch boundaries. The stop event
of ``TrainContext`` is checked at every batch boundary; a stop inside a window drops the partial
window, so a resumed run restarts at that window's first micro-batch and matches an
uninterrupted run bit for bit.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from astrai.config import Config
from astrai.data.sampler import ResumableSampler
from astrai.train import dist
from astrai.train.callbacks import CallbackList, CheckpointSaver, default_callbacks, requested_metrics
from astrai.train.context import TrainContext
from astrai.train.objectives import build_objective
from astrai.train.optim import LRSchedule, build_optimizer

Batch = dict[str, Any]


class Trainer:
    """Python API: ``Trainer(config, model=..., callbacks=[...]).train()``; anything not given is
    built from the config (model from ``model:`` or ``param_path``, data from ``data_path``)."""

    def __init__(self, config: Config, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 train_dataset: Any = None, val_dataset: Any = None, callbacks: list[Any] | None = None,
                 ctx: TrainContext | None = None, objective: Any = None):
        cfg = self.config = config
        self.ctx = ctx or TrainContext()
        self.dist = dist.init_distributed(cfg.train.device)
        self.is_main = self.dist.rank == 0
        self.device = self.dist.device
        seed_everything(cfg.train.random_seed)

        self.tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg)
        raw = model if model is not None else build_model(cfg)
        self.raw_model = raw.to(self.device)
        self.raw_model.gradient_checkpointing = cfg.train.gradient_checkpointing
        # objective first: DPO's frozen reference is a copy of the unwrapped initial policy
        self.objective = objective if objective is not None else build_objective(cfg, self.raw_model)
        if cfg.train.compile:
            self.raw_model.compile()  # in place: parameter names (and checkpoints) stay unprefixed
        self.model = dist.wrap_model(self.raw_model, cfg.dist.parallel_mode, self.dist)
        if train_dataset is None:
            train_dataset, built_val = build_datasets(cfg, self.tokenizer)
            val_dataset = val_dataset if val_dataset is not None else built_val
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.sampler = ResumableSampler(len(train_dataset), seed=cfg.train.random_seed, rank=self.dist.rank,
                                        world_size=self.dist.world_size, shuffle=True,
                                        lengths=self._sample_lengths() if cfg.data.group_by_length else None,
                                        group_size=cfg.train.batch_per_device * self.dist.world_size)

        self.total_steps = self._count_total_steps()
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.raw_model, cfg.optim)
        self.scheduler = LRSchedule(self.optimizer, cfg.optim, self.total_steps)
        user = list(callbacks or [])
        built = default_callbacks(self)
        # user callbacks see a step before the checkpoint of that step is published
        saver = [cb for cb in built if isinstance(cb, CheckpointSaver)]
        self.callbacks = CallbackList([cb for cb in built if cb not in saver] + user + saver)
        self._request_metrics(requested_metrics(self.callbacks.callbacks))
        self.step_metrics: dict[str, Any] = {}
        self._data_epoch, self._data_consumed = self.ctx.epoch, self.ctx.consumed_samples
        self._reset_window()

    def _request_metrics(self, wanted: frozenset[str] | None) -> None:
        """Metrics no callback reads are never computed: objective metrics and router statistics."""
        if hasattr(self.objective, "requested_metrics"):
            self.objective.requested_metrics = wanted
        router = wanted is None or any(name.startswith("router/") for name in wanted)
        for module in self.raw_model.modules():
            if hasattr(module, "collect_stats"):
                module.collect_stats = router

    # ---------------------------------------------------------------------------- the loop

    def train(self) -> TrainContext:
        ctx, cbs, accum = self.ctx, self.callbacks, self.config.train.grad_accum_steps
        self._t_last = time.perf_counter()
        cbs.on_train_begin(self)
        try:
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
                    last_micro_step = self._window_size == accum - 1
                    # DDP: gradients are all-reduced only in the window's last backward
                    with dist.no_sync(self.model, not last_micro_step), self._autocast():
                        out = self.objective(self.model, batch)
                    out.loss.backward()  # loss is summed over units; normalised in _optimizer_step
                    self._add_to_window(batch, out)
                    cbs.on_batch_end(self, batch, out)
                    if self._window_size == accum:
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
            self.optimizer.zero_grad(set_to_none=True)
        except BaseException as e:
            cbs.on_error(self, e)
            raise
        finally:
            cbs.on_train_end(self)
        return ctx

    def _optimizer_step(self) -> None:
        ctx, cfg, cbs = self.ctx, self.config, self.callbacks
        # one collective for the window's units, loss and metric sums over all ranks
        names = sorted(self._window_metrics)
        local = torch.stack([self._window_units.float(), self._window_loss, self._window_tokens.float(),
                             *[self._window_metrics[k] for k in names]])
        totals = dist.all_reduce_sum(local)
        units = totals[0].clamp(min=1)
        # DDP/FSDP average gradients over ranks; scaling by world_size / units turns that mean of
        # per-rank sums into (sum over the window and all ranks) / (the window's loss units)
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._foreach_mul_(grads, self.dist.world_size / units.item())
        max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # the pre-clip norm
        cbs.before_optimizer_step(self)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

        ctx.step += 1
        ctx.policy_version += 1
        ctx.epoch, ctx.consumed_samples = self._data_epoch, self._data_consumed
        now = time.perf_counter()
        num_tokens = int(totals[2].item())
        ctx.tokens_seen += num_tokens
        self.step_metrics = {
            "step": ctx.step, "epoch": ctx.epoch, "lr": lr,
            "loss": (totals[1] / units).item(),
            "grad_norm": _to_float(grad_norm),
            "tokens_per_s": num_tokens / max(now - self._t_last, 1e-9),
            "num_loss_units": int(units.item()),
            **{k: (totals[3 + i] / units).item() for i, k in enumerate(names)},
        }
        if self._validation_due():
            self.step_metrics.update(self.evaluate())
        self._reset_window()
        cbs.after_optimizer_step(self)
        self._t_last = time.perf_counter()  # time spent saving is not training throughput

    # ------------------------------------------------------------------ window bookkeeping

    def _reset_window(self) -> None:
        self._window_size = 0
        self._window_units = torch.zeros((), dtype=torch.long, device=self.device)
        self._window_tokens = torch.zeros((), dtype=torch.long, device=self.device)
        self._window_loss = torch.zeros((), device=self.device)
        self._window_metrics: dict[str, Tensor] = {}

    def _add_to_window(self, batch: Batch, out: Any) -> None:
        self._window_size += 1
        self._window_units += self.objective.num_units(batch)
        masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
        ids = [v for k, v in batch.items() if k.endswith("input_ids")]
        self._window_tokens += sum(m.sum() for m in masks) if masks else sum(t.numel() for t in ids)
        self._window_loss += out.loss.detach().float()
        for k, v in out.metrics.items():
            self._window_metrics[k] = self._window_metrics.get(k, 0.0) + v.detach().float()

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
        if self._window_size == 0:  # nothing pending: the epoch boundary is also the commit point
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
        if self._window_size != 0:
            return False
        stop = dist.any_rank(self.ctx.stop_requested)
        if stop and not self.ctx.stop_requested:
            self.ctx.request_stop("another rank stopped")
        return stop

    def _autocast(self):
        if not self.config.train.bf16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

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
        """JSON-able trainer state (trainer_state.json): counters, sampler, RNG, callbacks, config."""
        return {
            **self.ctx.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "callbacks": self.callbacks.state_dict(),
            "world_size": self.dist.world_size,
            "total_steps": self.total_steps,
            "config": self.config.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        report_mismatches(state, self.config, self.dist.world_size, self.total_steps)
        self.ctx.load_state_dict(state)
        self._data_epoch, self._data_consumed = self.ctx.epoch, self.ctx.consumed_samples
        self.sampler.set_epoch(self.ctx.epoch)
        self.sampler.set_consumed(self.ctx.consumed_samples)
        self.callbacks.load_state_dict(state.get("callbacks", {}))
        set_rng_state(state["rng"])


# ---------------------------------------------------------------------------- helpers


def _to_float(x: Tensor | float) -> float:
    if isinstance(x, Tensor):
        x = x.full_tensor() if hasattr(x, "full_tensor") else x  # FSDP2 returns a DTensor norm
        return float(x.item())
    return float(x)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states as JSON-able lists."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def report_mismatches(state: dict[str, Any], cfg: Config, world_size: int, total_steps: int) -> None:
    """Settings that change the sample order or the update break exact resume: say so."""
    saved = state.get("config", {})
    pairs = [
        ("batch_per_device", saved.get("train", {}).get("batch_per_device"), cfg.train.batch_per_device),
        ("grad_accum_steps", saved.get("train", {}).get("grad_accum_steps"), cfg.train.grad_accum_steps),
        ("random_seed", saved.get("train", {}).get("random_seed"), cfg.train.random_seed),
        ("world_size", state.get("world_size"), world_size),
        ("total_steps", state.get("total_steps"), total_steps),  # the LR schedule's length
    ]
    for name, old, new in pairs:
        if old is not None and old != new:
            print(f"warning: resuming with {name}={new} but the checkpoint was trained with {name}={old}; "
                  "the run continues but will not match an uninterrupted run exactly", file=sys.stderr)


def metrics_path(cfg: Config) -> Path:
    return Path(cfg.log.log_dir) / "metrics.jsonl"


# ---------------------------------------------------------------------------- building from config


def build_tokenizer(cfg: Config) -> Any:
    """The tokenizer at tokenizer_path (default: param_path); None when neither is set."""
    path = cfg.data.tokenizer_path or cfg.train.param_path
    if path is None:
        return None
    path = resolve_param_path(path)
    from astrai.data.tokenizer import load_tokenizer

    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer_path {str(path)!r} does not exist; check --tokenizer_path")
    return load_tokenizer(path)


def resolve_param_path(path: str) -> str:
    """A model or checkpoint directory as it is; a ckpt_dir (holding step_N checkpoints) stands
    for its newest complete checkpoint, so a config can chain stages without knowing N."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists():
        from astrai.train.checkpoint import latest_checkpoint

        latest = latest_checkpoint(p)
        if latest is not None:
            return str(latest)
    return path


def build_model(cfg: Config) -> torch.nn.Module:
    """Weights from param_path (any checkpoint or model dir), else a fresh model from ``model:``."""
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM

    if cfg.train.param_path is not None:
        from astrai.model.hf import load_model

        cfg.train.param_path = resolve_param_path(cfg.train.param_path)
        if not Path(cfg.train.param_path).is_dir():
            raise FileNotFoundError(f"param_path {cfg.train.param_path!r} is not a directory; "
                                    "give a model or checkpoint directory")
        extra = sorted(set(cfg.model) - {"router_aux_loss_coef"})
        if extra:
            raise ValueError(f"model fields {extra} are given together with param_path, whose config.json "
                             "defines the model; remove them or drop param_path")
        # fp32 master weights whatever the checkpoint's dtype; bf16 is an autocast option
        return load_model(cfg.train.param_path, dtype=torch.float32)
    if not cfg.model:
        raise ValueError("no model to train: give a 'model:' section (vocab_size, hidden_size, ...) "
                         "or --param_path DIR")
    return CausalLM(ModelConfig.from_dict(cfg.model), seed=cfg.train.random_seed)


class _Subset:
    """A view of some rows of a dataset that keeps its collate function."""

    def __init__(self, dataset: Any, indices: list[int]):
        self.dataset, self.indices = dataset, indices
        self.collate = dataset.collate

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i]]


def build_datasets(cfg: Config, tokenizer: Any) -> tuple[Any, Any]:
    """(train, val) datasets; val from val_data_path, else a seeded val_split of data_path, else None."""
    from astrai.data.datasets import build_dataset

    d = cfg.data
    for name in ("data_path", "val_data_path"):
        path = getattr(d, name)
        if name == "data_path" and path is None:
            raise ValueError("data_path is not set; give --data_path FILE.jsonl or a preprocessed shard dir")
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"{name} {path!r} does not exist; check --{name}")
    if tokenizer is None and Path(d.data_path).is_file():  # shard dirs are already tokenized
        raise ValueError("no tokenizer: set tokenizer_path (or param_path, whose directory holds one)")

    def build(path: str) -> Any:
        return build_dataset(d.train_type, path, tokenizer, d.max_seq_len, pack=d.pack, stride=d.seq_stride)

    train = build(d.data_path)
    if d.val_data_path is not None:
        return train, build(d.val_data_path)
    if d.val_split > 0:
        g = torch.Generator().manual_seed(cfg.train.random_seed)
        order = torch.randperm(len(train), generator=g).tolist()
        n_val = max(1, round(d.val_split * len(train)))
        return _Subset(train, sorted(order[n_val:])), _Subset(train, sorted(order[:n_val]))
    return train, None
