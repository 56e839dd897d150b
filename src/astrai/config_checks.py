"""Checks of a resolved ``Config`` that a field's type alone does not capture: choices, ranges and
the rules between fields. ``config.build_config`` calls ``validate`` last, so every way of
making a run (YAML, flags, the Python API) meets the same rules; each failure is one
``ConfigError`` line naming the field, the value and the fix. What depends on a table of the train
side (an advantage estimator's smallest ``group_size``: ``train/advantages.py``) is checked there,
by ``astrai train`` and ``build_run``: this layer imports nothing of ``train``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from astrai.config_values import CHOICES, REPORTERS, TRAIN_TYPES, ConfigError, did_you_mean, missing_package

if TYPE_CHECKING:
    from astrai.config import Config


def validate(cfg: Config) -> None:
    """Choices and ranges that a type alone does not capture."""
    flat = cfg.flat()
    for name, allowed in CHOICES.items():
        if flat[name] not in allowed:
            raise ConfigError(f"{name}={flat[name]!r} is not one of {', '.join(allowed)}")
    for name, value in flat.items():
        items = value if isinstance(value, list) else [value]  # reward_weights: [.nan] is a list
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ConfigError(f"{name}={value} is not a finite number; give a finite value")
    if cfg.rl.max_resample_batches < 0:
        raise ConfigError(f"max_resample_batches={cfg.rl.max_resample_batches} must be >= 0")
    positive = ["n_epoch", "batch_per_device", "grad_accum_steps", "max_seq_len", "nprocs", "max_nonfinite_steps",
                "group_size", "rollout_interval", "rollout_max_tokens"]
    for name in positive:
        if flat[name] < 1:
            raise ConfigError(f"{name}={flat[name]} must be >= 1")
    for name in ["max_steps", "warmup_steps", "seq_stride", "val_max_batches", "keep_last", "max_prompt_len"]:
        if flat[name] is not None and flat[name] < (0 if name == "warmup_steps" else 1):
            raise ConfigError(f"{name}={flat[name]} must be positive (or null)")
    for name in ["max_lr", "weight_decay", "max_grad_norm", "ckpt_interval", "val_interval", "beta",
                 "eval_interval", "eval_num_samples"]:
        if flat[name] < 0:
            raise ConfigError(f"{name}={flat[name]} must be >= 0")
    for name in ["warmup_ratio", "min_lr_ratio", "decay_ratio", "label_smoothing"]:
        if not 0.0 <= flat[name] <= 1.0:
            raise ConfigError(f"{name}={flat[name]} must be within [0, 1]")
    if not 0.0 <= cfg.objective.dpo_label_noise < 0.5:
        raise ConfigError(f"dpo_label_noise={cfg.objective.dpo_label_noise} must be within [0, 0.5)")
    rl = cfg.rl
    if rl.reward_weights is not None and len(rl.reward_weights) != len(rl.rewards):
        raise ConfigError(f"reward_weights has {len(rl.reward_weights)} entries for {len(rl.rewards)} rewards "
                          f"{rl.rewards}; give one weight per reward")
    if not rl.rewards and not rl.environment:
        raise ConfigError("rewards is empty; name at least one reward (e.g. [exact_match]) or an environment")
    if not 0 <= rl.host_mmap_threshold_mb <= 32:
        raise ConfigError(f"host_mmap_threshold_mb={rl.host_mmap_threshold_mb} must be within [0, 32] (MiB; glibc "
                          f"accepts at most 32); use 1, or 0 to keep the C allocator's default")
    if rl.max_turns < 1:
        raise ConfigError(f"max_turns={rl.max_turns} must be >= 1 (assistant turns per multi-turn episode)")
    if "overlong" in rl.rewards and not 0 < rl.overlong_buffer <= rl.rollout_max_tokens:
        raise ConfigError(f"overlong_buffer={rl.overlong_buffer} must be within [1, rollout_max_tokens="
                          f"{rl.rollout_max_tokens}] for the overlong reward; set --overlong_buffer in that range")
    if rl.rollout_is_cap < 1:
        raise ConfigError(f"rollout_is_cap={rl.rollout_is_cap} must be >= 1 (a weight of 1 is no correction)")
    for name in ["rollout_temperature", "clip_eps", "kl_coef", "max_policy_lag", "ppo_vf_coef", "reward_timeout"]:
        if flat[name] < 0:
            raise ConfigError(f"{name}={flat[name]} must be >= 0")
    if not (0.0 <= rl.ppo_gamma <= 1.0 and 0.0 <= rl.ppo_gae_lambda <= 1.0):
        raise ConfigError(f"ppo_gamma={rl.ppo_gamma} and ppo_gae_lambda={rl.ppo_gae_lambda} must be within [0, 1]")
    for name in ("critic_lr", "value_clip"):
        if getattr(rl, name) is not None and getattr(rl, name) <= 0:
            raise ConfigError(f"{name}={getattr(rl, name)} must be > 0 (or null)")
    if rl.rollout_interval - 1 > rl.max_policy_lag:
        raise ConfigError(f"rollout_interval={rl.rollout_interval} reuses a rollout until it is "
                          f"{rl.rollout_interval - 1} policy versions old, more than max_policy_lag={rl.max_policy_lag}; "
                          f"raise --max_policy_lag to {rl.rollout_interval - 1} or lower --rollout_interval")
    if not 0.0 < rl.rollout_top_p <= 1.0:
        raise ConfigError(f"rollout_top_p={rl.rollout_top_p} must be within (0, 1]")
    if cfg.data.train_type == "online_dpo" and rl.group_size < 2:
        raise ConfigError(f"online_dpo needs group_size >= 2 (a best and a worst sample per prompt), got "
                          f"{rl.group_size}; set --group_size 2 or more")
    lora = cfg.lora
    if lora.lora_r < 0 or lora.lora_alpha <= 0 or not 0.0 <= lora.lora_dropout < 1.0:
        raise ConfigError(f"lora_r={lora.lora_r} must be >= 0 (0 = off), lora_alpha={lora.lora_alpha} > 0 and "
                          f"lora_dropout={lora.lora_dropout} within [0, 1)")
    from astrai.model.lora import PROJECTIONS

    unknown = [t for t in lora.lora_targets if t not in PROJECTIONS and t not in PROJECTIONS.values()]
    if unknown or not lora.lora_targets:
        raise ConfigError(f"lora_targets has {unknown or 'no entries'}; choose from {', '.join(PROJECTIONS)}")
    if not 0.0 <= cfg.data.val_split < 1.0:
        raise ConfigError(f"val_split={cfg.data.val_split} must be within [0, 1)")
    if cfg.train.eval_interval > 0 and cfg.data.eval_data_path is None:
        raise ConfigError(f"eval_interval={cfg.train.eval_interval} needs eval_data_path (held-out prompt records "
                          "with answers); set --eval_data_path FILE.jsonl or --eval_interval 0")
    _validate_data_columns(cfg)
    _validate_report_to(cfg)


def _validate_data_columns(cfg: Config) -> None:
    """data_columns maps record fields of the train type's record kind onto column names."""
    from astrai.data.records import RECORD_FIELDS

    columns = cfg.data.data_columns
    if not columns:
        return
    kind = TRAIN_TYPES[cfg.data.train_type]
    fields = RECORD_FIELDS[kind]
    for name, column in columns.items():
        if name not in fields:
            raise ConfigError(f"data_columns has record field {name!r}, which {cfg.data.train_type} records "
                              f"({kind}) do not read{did_you_mean(name, list(fields))}; map columns onto "
                              f"{', '.join(fields)} as 'field: column'")
        if not isinstance(column, str) or not column:
            raise ConfigError(f"data_columns[{name!r}] is {column!r}; give the dataset's column name as a string")
    if len(set(columns.values())) != len(columns):
        raise ConfigError(f"data_columns {columns} maps one column onto two fields; give each field its own column")


def _validate_report_to(cfg: Config) -> None:
    for name in cfg.log.report_to:
        if name not in REPORTERS:
            raise ConfigError(f"report_to has {name!r}{did_you_mean(name, list(REPORTERS))}; choose from "
                              f"{', '.join(REPORTERS)} (or leave report_to empty: metrics.jsonl is always written)")
        if (problem := missing_package(name)) is not None:
            raise ConfigError(problem)
