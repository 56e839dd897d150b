"""Builders: a resolved ``Config`` -> a ``Run`` (ranks, tokenizer, model, objective, optimizer,
gradient step, callbacks), built once for every training loop, and what both loops share.

Sits before the loops in the training data flow: the offline ``Trainer`` and the online RL loop
both call ``build_run`` (objects the caller hands in are used as given), then ``Run.optimization``
once they know their length, then ``build_callbacks``; ``callback_frame`` is the begin / error /
end frame of both ``train()`` methods, and ``common_state`` / ``load_common_state`` the
trainer_state.json keys they share. ``check_config`` refuses, before anything is built, settings
that the config alone cannot judge. ``param_path`` may name a model directory, a checkpoint
directory, a Hub id, or another run's ``ckpt_dir`` (its newest complete checkpoint), so configs can
chain stages. A train type's record kind is stated in ``astrai.config_values.TRAIN_TYPES``; the
data layer knows only record kinds.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from astrai.config import Config, OptimConfig
from astrai.config_values import DEFAULT_MAX_PROMPT_LEN, TRAIN_TYPES, default_max_prompt_len, is_online
from astrai.model.matmul import set_cpu_matmul
from astrai.train import dist, resume
from astrai.train.advantages import check_group_size, learns_from_group_differences
from astrai.train.callbacks import CallbackList, arrange_callbacks, default_callbacks, requested_metrics
from astrai.train.context import Loop
from astrai.train.objectives import build_objective, objective_builder
from astrai.train.optim import LRSchedule, build_optimizer
from astrai.train.step import GradientStep


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)



def build_tokenizer(cfg: Config) -> Any:
    """The tokenizer at tokenizer_path (default: param_path); None when neither is set."""
    path = cfg.data.tokenizer_path or cfg.train.param_path
    if path is None:
        return None
    path = resolve_param_path(path, "tokenizer_path" if cfg.data.tokenizer_path else "param_path")
    from astrai.data.tokenizer import load_tokenizer

    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer_path {str(path)!r} does not exist; check --tokenizer_path")
    return load_tokenizer(path)


def resolve_param_path(path: str, what: str = "param_path") -> str:
    """A model or checkpoint directory as it is; a ckpt_dir (holding step_N checkpoints) stands
    for its newest complete checkpoint, so a config can chain stages without knowing N; a Hugging
    Face Hub id (`org/name`) that is not a local path stands for its cached snapshot."""
    from astrai.model.hub import resolve_model_path
    from astrai.model.manifest import resolve_model_dir  # the rule `astrai generate --model` follows too

    path = resolve_model_path(path, what)
    resolved = resolve_model_dir(path)
    return path if resolved == Path(path) else str(resolved)


def build_model(cfg: Config) -> torch.nn.Module:
    """Weights from param_path (any checkpoint or model dir), else a fresh model from ``model:``;
    with ``lora_r > 0`` the base is frozen and only fresh adapters on ``lora_targets`` train."""
    model = _build_base(cfg)
    if cfg.lora.lora_r > 0:
        from astrai.model.lora import apply_lora

        if cfg.train.param_path is None:
            raise ValueError(f"lora_r={cfg.lora.lora_r} needs --param_path: the base model directory the adapter "
                             "trains on (its checkpoints name it as base_model_name_or_path)")
        apply_lora(model, cfg.lora.lora_r, cfg.lora.lora_alpha, cfg.lora.lora_dropout, cfg.lora.lora_targets)
    return model


def log_trainable(model: torch.nn.Module, is_main: bool = True) -> None:
    """The run's first log line: how many parameters train, and their share of the model."""
    from astrai.model.lora import count_parameters

    trainable, total = count_parameters(model)
    if is_main:
        print(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.2f}%)",
              file=sys.stderr, flush=True)


def _build_base(cfg: Config) -> torch.nn.Module:
    from astrai.model.classifier import SequenceClassifier, load_classifier
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM

    scorer = cfg.data.train_type == "reward"  # a reward model: the trunk with a scalar head, no LM head

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
        if cfg.lora.lora_r > 0 and (Path(cfg.train.param_path) / "adapter_config.json").is_file():
            raise ValueError(f"param_path {cfg.train.param_path!r} is a LoRA adapter; a LoRA run trains on a plain "
                             "base model: write one with `astrai lora merge` and pass that as --param_path")
        # fp32 master weights whatever the checkpoint's dtype; bf16 is an autocast option
        if scorer:
            return load_classifier(cfg.train.param_path, seed=cfg.train.random_seed)
        return load_model(cfg.train.param_path, dtype=torch.float32)
    if not cfg.model:
        raise ValueError("no model to train: give a 'model:' section (vocab_size, hidden_size, ...) "
                         "or --param_path DIR")
    config = ModelConfig.from_dict(cfg.model)
    return SequenceClassifier(config, cfg.train.random_seed) if scorer else CausalLM(config, seed=cfg.train.random_seed)


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
    from astrai.data.hf_datasets import parse_dataset_path
    from astrai.data.records import RecordKindError
    d = cfg.data
    for name in ("data_path", "val_data_path"):
        path = getattr(d, name)
        if name == "data_path" and path is None:
            raise ValueError("data_path is not set; give --data_path FILE.jsonl, a preprocessed shard dir or a "
                             "dataset (hf:NAME@SPLIT, a save_to_disk dir)")
        if path is not None and parse_dataset_path(path) is None and not Path(path).exists():
            raise FileNotFoundError(f"{name} {path!r} does not exist; check --{name} (a dataset on the Hub is "
                                    f"written hf:{path})")
    if tokenizer is None and (Path(d.data_path).is_file() or parse_dataset_path(d.data_path) is not None):
        # shard dirs are already tokenized; JSONL and datasets are not
        raise ValueError("no tokenizer: set tokenizer_path (or param_path, whose directory holds one)")

    def build(path: str) -> Any:
        kind = TRAIN_TYPES[d.train_type]
        # prompts are checked against max_prompt_len at rollout time: skipped and counted there
        max_len = 1 << 30 if kind == "prompt" else d.max_seq_len
        return build_dataset(kind, path, tokenizer, max_len, pack=d.pack, stride=d.seq_stride, columns=d.data_columns)

    try:
        train = build(d.data_path)
    except RecordKindError as e:  # say which train types read what the file holds
        readers = [t for t, k in TRAIN_TYPES.items() if k == e.found]
        raise ValueError(f"--train_type {d.train_type} does not read these records: {e}; for {e.found} records use "
                         f"--train_type {' or '.join(readers)}") from None
    if d.val_data_path is not None:
        return train, build(d.val_data_path)
    if d.val_split > 0:
        g = torch.Generator().manual_seed(cfg.train.random_seed)
        order = torch.randperm(len(train), generator=g).tolist()
        n_val = max(1, round(d.val_split * len(train)))
        return _Subset(train, sorted(order[n_val:])), _Subset(train, sorted(order[:n_val]))
    return train, None


def check_vocab(model: torch.nn.Module, tokenizer: Any, cfg: Config) -> None:
    """Before any step: every token id the tokenizer can produce must have an embedding row."""
    if tokenizer is None:
        return
    model_vocab, size = model.config.vocab_size, len(tokenizer)
    if size > model_vocab:
        source = cfg.data.tokenizer_path or cfg.train.param_path
        raise ValueError(f"model vocab_size is {model_vocab} but the tokenizer at {source} has {size} tokens; "
                         f"set vocab_size to at least {size} (or use the model's own tokenizer)")


# ------------------------------------------------------------------------------- the run


@dataclass
class Run:
    """What every loop is built from: ranks, tokenizer, the policy (``raw_model`` unwrapped, its
    weights are the checkpoints'; ``model`` wrapped for DDP/FSDP, the one the objective trains
    through, compiled when ``train.compile``), and the objective."""

    config: Config
    dist: dist.DistInfo
    tokenizer: Any
    raw_model: nn.Module
    model: nn.Module
    objective: Any

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def is_main(self) -> bool:
        return self.dist.rank == 0

    def wrap(self, module: nn.Module) -> nn.Module:
        """`module` wrapped for the run's data parallelism, as the policy is (a critic, say)."""
        return dist.wrap_model(module, self.config.dist.parallel_mode, self.dist)

    def optimization(self, module: nn.Module, optim: OptimConfig, total_steps: int,
                     name: str = "policy") -> tuple[Any, LRSchedule, GradientStep]:
        """(optimizer, schedule, gradient step) over `module`'s trainable parameters (LoRA: the
        adapters only), for a run of `total_steps` optimizer steps."""
        t = self.config.train
        optimizer = build_optimizer(module, optim)
        scheduler = LRSchedule(optimizer, optim, total_steps)
        params = [p for p in module.parameters() if p.requires_grad]
        step = GradientStep(params, optimizer, scheduler, max_grad_norm=t.max_grad_norm,
                            world_size=self.dist.world_size, device=self.device,
                            max_nonfinite_steps=t.max_nonfinite_steps, name=name)
        return optimizer, scheduler, step


def check_config(cfg: Config) -> None:
    """What the train side refuses before anything is built, beyond ``astrai.config``'s checks
    (which see only the config's own tables): the train type must have an objective here, and
    ``group_size`` must suit the advantage estimator (``train/advantages.py``, whose check ``astrai
    train`` also runs right after reading the config, before any rank starts)."""
    objective_builder(cfg.data.train_type)
    check_group_size(cfg.rl)


def build_run(cfg: Config, model: nn.Module | None = None, tokenizer: Any = None, objective: Any = None) -> Run:
    """Ranks, seed, tokenizer, model, objective and the wrapped model, in that order (the order
    fixes the RNG stream, so runs and resumed runs draw the same numbers)."""
    check_config(cfg)
    set_cpu_matmul(cfg.train.cpu_matmul)  # before any product: the probes, the model, the engine
    info = dist.init_distributed(cfg.train.device)
    seed_everything(cfg.train.random_seed)
    online = is_online(cfg.data.train_type)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg)
    if tokenizer is None and online:
        raise ValueError("online RL needs a tokenizer with a chat template: set tokenizer_path or param_path")
    raw = (model if model is not None else build_model(cfg)).to(info.device)
    log_trainable(raw, info.rank == 0)
    check_vocab(raw, tokenizer, cfg)
    raw.gradient_checkpointing = cfg.train.gradient_checkpointing
    if online:
        fit_rollouts_to_model(cfg, raw.config.max_position_embeddings, info.rank == 0)
        warn_if_no_signal(cfg, info.rank == 0)
        disable_dropout(raw)  # before the objective: its reference and critic copies inherit it
    elif cfg.rl.max_prompt_len is None:  # evaluation during training renders prompts with it
        positions = getattr(getattr(raw, "config", None), "max_position_embeddings", None)
        cfg.rl.max_prompt_len = DEFAULT_MAX_PROMPT_LEN if positions is None else \
            max(1, default_max_prompt_len(cfg.rl.rollout_max_tokens, positions))
    # objective first: a frozen reference (DPO, a KL term) is a copy of the unwrapped initial policy
    objective = objective if objective is not None else build_objective(cfg, raw)
    if cfg.train.compile and not online:
        raw.compile()  # in place: parameter names (and checkpoints) stay unprefixed
    wrapped = dist.wrap_model(raw, cfg.dist.parallel_mode, info)
    if cfg.train.compile and online:
        # the engine runs the raw module eagerly (paged-KV shapes vary every step); only the
        # trainer's forward and backward go through the compiled graph
        wrapped = torch.compile(wrapped)
    return Run(cfg, info, tokenizer, raw, wrapped, objective)


def setup_objective(run: Run, total_steps: int) -> None:
    """Let the objective build what it trains beside the policy (PPO: its critic's optimizer and
    gradient step). A user's own objective needs only ``__call__`` and ``num_units``."""
    setup = getattr(run.objective, "setup", None)
    if setup is not None:
        setup(run, total_steps)


def companions(objective: Any) -> tuple[Any, ...]:
    """The modules trained beside the policy on the same micro-batches (``objectives.base.Companion``;
    none for an objective that does not say)."""
    return tuple(getattr(objective, "companions", ()))


def fit_rollouts_to_model(cfg: Config, max_positions: int, is_main: bool = True) -> None:
    """A rollout row (prompt + completion) must fit the model's positions. An unset
    ``max_prompt_len`` becomes 256 or what the positions leave beside ``rollout_max_tokens``
    (the run says so when that is less); a given one that does not fit is refused, never
    quietly lowered: longer prompts would then be skipped without the user having chosen it."""
    rl = cfg.rl
    if rl.rollout_max_tokens >= max_positions:
        raise ValueError(f"rollout_max_tokens={rl.rollout_max_tokens} leaves no room for a prompt in the model's "
                         f"max_position_embeddings={max_positions}; lower --rollout_max_tokens")
    room = max_positions - rl.rollout_max_tokens
    if rl.max_prompt_len is None:
        rl.max_prompt_len = default_max_prompt_len(rl.rollout_max_tokens, max_positions)
        if is_main and rl.max_prompt_len < DEFAULT_MAX_PROMPT_LEN:
            print(f"note: max_prompt_len is {rl.max_prompt_len} (the model's max_position_embeddings={max_positions} "
                  f"less rollout_max_tokens={rl.rollout_max_tokens}); longer prompts are skipped and counted",
                  file=sys.stderr)
    elif rl.max_prompt_len + rl.rollout_max_tokens > max_positions:
        raise ValueError(f"max_prompt_len={rl.max_prompt_len} + rollout_max_tokens={rl.rollout_max_tokens} = "
                         f"{rl.max_prompt_len + rl.rollout_max_tokens} exceeds the model's max_position_embeddings="
                         f"{max_positions}; set --max_prompt_len to at most {room} (or lower --rollout_max_tokens)")


def warn_if_no_signal(cfg: Config, is_main: bool = True) -> str | None:
    """One line when the settings make every advantage zero, so the run trains nothing: a group of
    one sample (GRPO's group-relative estimators) or greedy sampling (temperature 0: the group's
    samples are identical; online DPO finds no pair). Returns the line (None when there is none)."""
    rl, train_type = cfg.rl, cfg.data.train_type
    if not learns_from_group_differences(train_type, rl):
        return None
    what = "online_dpo's pairs" if train_type == "online_dpo" else f"advantage_estimator {rl.advantage_estimator}"
    if rl.group_size == 1:
        why = f"group_size=1: {what} compare a prompt's samples, so every advantage is zero"
    elif rl.rollout_temperature == 0:
        why = (f"rollout_temperature=0 samples each prompt's group greedily, all {rl.group_size} alike, so "
               f"{what} see no difference and every advantage is zero")
    else:
        return None
    line = f"warning: {why} and the run trains nothing; raise --group_size / --rollout_temperature"
    if is_main:
        print(line, file=sys.stderr)
    return line


def disable_dropout(model: nn.Module) -> int:
    """Online RL trains without dropout (TRL's ``disable_dropout``): the engine samples with the
    module in eval mode, so a trainer forward with dropout would move the ratio away from 1 for a
    reason that is not the policy changing. Each ``nn.Dropout`` (e.g. ``lora_dropout``) becomes
    the identity; its ``p`` is kept, so a saved adapter's config still says what was configured.
    Returns how many modules were switched off."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.forward = _identity  # an instance attribute: this module only, kept by deepcopy
            count += 1
    return count


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def build_callbacks(loop: Loop, run: Run, user: list[Any] | None) -> CallbackList:
    """The default callbacks and the user's (user callbacks see a step before the checkpoint of
    that step is published). Metrics no callback reads are never computed: objective metrics
    and MoE router statistics are switched off unless asked for."""
    callbacks = arrange_callbacks(default_callbacks(loop), list(user or []))
    wanted = requested_metrics(callbacks.callbacks)
    run.objective.requested_metrics = wanted
    router = wanted is None or any(name.startswith("router/") for name in wanted)
    for module in run.raw_model.modules():
        if hasattr(module, "collect_stats"):
            module.collect_stats = router
    return callbacks


@contextmanager
def callback_frame(loop: Any) -> Iterator[None]:
    """The frame of every loop's ``train()``: callbacks begin, see an error, and always end."""
    cbs = loop.callbacks
    cbs.on_train_begin(loop)
    try:
        yield
    except BaseException as e:
        cbs.on_error(loop, e)
        raise
    finally:
        cbs.on_train_end(loop)


def common_state(loop: Any, rng: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trainer_state.json keys of every loop: counters, gradient-step counters (the policy's
    and each companion's), RNG, callbacks, world size, length and config."""
    steps = {"grad_step": loop.grad_step.state_dict()}
    steps.update({f"{c.name}_step": c.state_dict() for c in companions(loop.objective)})
    return {**loop.ctx.state_dict(), **steps, "rng": rng or resume.rng_state(),
            "callbacks": loop.callbacks.state_dict(), "world_size": loop.dist.world_size,
            "total_steps": loop.total_steps, "config": loop.config.to_dict()}


def load_common_state(loop: Any, state: dict[str, Any]) -> None:
    """Restore what ``common_state`` saved, after checking it against this run's config and ranks."""
    resume.report_mismatches(state, loop.config, loop.dist.world_size, loop.total_steps)
    loop.ctx.load_state_dict(state)
    loop.grad_step.load_state_dict(state.get("grad_step", {}))
    for c in companions(loop.objective):
        c.load_state_dict(state.get(f"{c.name}_step", {}))
    loop.callbacks.load_state_dict(state.get("callbacks", {}))
    resume.set_rng_state(state["rng"])
