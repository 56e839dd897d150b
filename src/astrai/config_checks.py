"""Checks of a resolved ``Config`` that a field's type alone does not capture: choices, ranges and
the rules between fields. A range that is one field's fact is that field's ``knob`` metadata
(``astrai.flags.Range``), checked here for every field at once; only rules between fields are
written out. ``config.build_config`` calls ``validate`` last, so every way of
making a run (YAML, flags, the Python API) meets the same rules; each failure is one
``ConfigError`` line naming the field, the value and the fix. What depends on a table of the train
side (an advantage estimator's smallest ``group_size``: ``train/advantages.py``) is checked there,
by ``astrai train`` and ``build_run``: this layer imports nothing of ``train``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import TYPE_CHECKING

from astrai.config_values import (
    ALGORITHMS,
    CHOICES,
    PER_TOKEN_ESTIMATORS,
    REPORTERS,
    TRAIN_TYPES,
    ConfigError,
    algorithm_flags,
    did_you_mean,
    missing_package,
)
from astrai.flags import is_optional

if TYPE_CHECKING:
    from astrai.config import Config, RLConfig


def validate(cfg: Config) -> None:
    """Choices and ranges that a type alone does not capture."""
    flat = cfg.flat()
    if flat["train_type"] in ALGORITHMS:  # an algorithm's name where a train type goes: say which settings give it
        name = flat["train_type"]
        raise ConfigError(f"train_type={name!r} is not one of {', '.join(TRAIN_TYPES)}: it names an algorithm, "
                          f"{algorithm_flags(name)} (a ready run: configs/{name}.yaml)")
    for name, allowed in CHOICES.items():
        if flat[name] not in allowed:
            raise ConfigError(f"{name}={flat[name]!r} is not one of {', '.join(allowed)}")
    for name, value in flat.items():
        items = value if isinstance(value, list) else [value]  # reward_weights: [.nan] is a list
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ConfigError(f"{name}={value} is not a finite number; give a finite value")
    _validate_ranges(cfg)
    rl = cfg.rl
    if rl.reward_weights is not None and len(rl.reward_weights) != len(rl.rewards):
        raise ConfigError(f"reward_weights has {len(rl.reward_weights)} entries for {len(rl.rewards)} rewards "
                          f"{rl.rewards}; give one weight per reward")
    pure_distill = cfg.data.train_type == "online_distill" and cfg.objective.distill_coef == 0
    if not rl.rewards and not rl.environment and not pure_distill:  # pure distillation needs no reward
        raise ConfigError("rewards is empty; name at least one reward (e.g. [exact_match]) or an environment")
    if "overlong" in rl.rewards and not 0 < rl.overlong_buffer <= rl.rollout_max_tokens:
        raise ConfigError(f"overlong_buffer={rl.overlong_buffer} must be within [1, rollout_max_tokens="
                          f"{rl.rollout_max_tokens}] for the overlong reward; set --overlong_buffer in that range")
    if "judge" in rl.rewards and not rl.judge_url:
        raise ConfigError("rewards has judge but judge_url is not set; give --judge_url (an OpenAI-compatible "
                          "server, e.g. http://127.0.0.1:8000) or remove judge from rewards")
    if rl.rollout_interval > 1 and rl.mini_batches * rl.ppo_epochs > 1:
        raise ConfigError(f"rollout_interval={rl.rollout_interval} counts steps on a whole rollout, but mini_batches="
                          f"{rl.mini_batches} and ppo_epochs={rl.ppo_epochs} split it; with mini-batches set the passes "
                          "with --ppo_epochs and leave --rollout_interval 1")
    uses = steps_per_rollout(rl)
    if rl.async_steps and (rl.async_steps + 1) * uses - 1 > rl.max_policy_lag:
        lag = (rl.async_steps + 1) * uses - 1
        raise ConfigError(f"async_steps={rl.async_steps} with {uses} step(s) per rollout trains on rollouts up to {lag} "
                          f"policy versions old, more than max_policy_lag={rl.max_policy_lag}; raise --max_policy_lag "
                          f"to {lag} or lower --async_steps")
    if uses - 1 > rl.max_policy_lag:
        what, fix = (f"rollout_interval={uses} reuses", "--rollout_interval") if rl.rollout_interval > 1 else \
            (f"mini_batches={rl.mini_batches} x ppo_epochs={rl.ppo_epochs} = {uses} steps reuse", "them")
        raise ConfigError(f"{what} a rollout until it is {uses - 1} policy versions old, more than max_policy_lag="
                          f"{rl.max_policy_lag}; raise --max_policy_lag to {uses - 1} or lower {fix}")
    if rl.mini_batches > 1 and cfg.data.train_type not in ("online_grpo", "online_ppo"):
        raise ConfigError(f"mini_batches={rl.mini_batches} applies to online_grpo and online_ppo (samples split into "
                          f"mini-batches), not {cfg.data.train_type}; set --mini_batches 1 (--ppo_epochs gives passes)")
    _validate_objective_fields(cfg)
    if rl.ref_reset_interval or rl.ref_ema is not None:
        what = f"ref_reset_interval={rl.ref_reset_interval}" if rl.ref_reset_interval else f"ref_ema={rl.ref_ema}"
        if cfg.data.train_type not in ("online_grpo", "online_ppo") or rl.kl_coef == 0:
            raise ConfigError(f"{what} moves the reference of the KL term of online_grpo / online_ppo, but this run has "
                              f"{'no KL (kl_coef 0)' if rl.kl_coef == 0 else cfg.data.train_type}; set --kl_coef > 0 "
                              "on an online_grpo or online_ppo run, or remove it")
        if cfg.lora.lora_r > 0 or cfg.dist.parallel_mode == "fsdp":
            why = "under LoRA the reference is the base model with its adapters off, not a copy" if cfg.lora.lora_r \
                else "under fsdp the policy is sharded and the reference is not"
            raise ConfigError(f"{what} copies the policy into its reference, but {why}; remove it")
    if rl.turn_rewards:
        per_token = cfg.data.train_type == "online_ppo" or (cfg.data.train_type == "online_grpo"
                                                            and rl.advantage_estimator == "reinforce_pp")
        if not per_token or not rl.environment:
            why = "an environment whose step gives them" if per_token else \
                "per-token credit (online_ppo, or online_grpo with advantage_estimator reinforce_pp)"
            raise ConfigError(f"turn_rewards=true places each environment step's reward on its turn, which needs {why}; "
                              "set --environment / --train_type accordingly or --turn_rewards false")
    if rl.routing_replay and (cfg.data.train_type not in ("online_grpo", "online_ppo") or rl.rollout_servers):
        why = "the rollout servers do not send it over HTTP" if rl.rollout_servers else \
            f"train_type {cfg.data.train_type} trains on no such rollouts"
        raise ConfigError(f"routing_replay=true replays the experts the in-process rollout engine routed each token to "
                          f"(online_grpo, online_ppo), but {why}; set --routing_replay false")
    if rl.kl_in_reward and cfg.data.train_type in ("grpo", "online_dpo"):
        raise ConfigError(f"kl_in_reward=true applies to online_grpo (online_ppo always has the KL in its rewards), "
                          f"not train_type {cfg.data.train_type}; set --kl_in_reward false")
    if cfg.data.train_type == "online_dpo" and rl.group_size < 2:
        raise ConfigError(f"online_dpo needs group_size >= 2 (a best and a worst sample per prompt), got "
                          f"{rl.group_size}; set --group_size 2 or more")
    lora = cfg.lora
    from astrai.model.lora import PROJECTIONS

    unknown = [t for t in lora.lora_targets if t not in PROJECTIONS and t not in PROJECTIONS.values()]
    if unknown or not lora.lora_targets:
        raise ConfigError(f"lora_targets has {unknown or 'no entries'}; choose from {', '.join(PROJECTIONS)}")
    if cfg.train.eval_interval > 0 and cfg.data.eval_data_path is None:
        raise ConfigError(f"eval_interval={cfg.train.eval_interval} needs eval_data_path (held-out prompt records "
                          "with answers); set --eval_data_path FILE.jsonl or --eval_interval 0")
    bad = [k for k in cfg.train.eval_pass_k if not 1 <= k <= cfg.train.eval_num_samples]
    if bad:
        raise ConfigError(f"eval_pass_k has {bad}, but pass@k needs 1 <= k <= eval_num_samples="
                          f"{cfg.train.eval_num_samples} sampled answers per prompt; raise --eval_num_samples or drop them")
    if cfg.data.train_type == "reward":
        _validate_reward(cfg)
    if cfg.data.train_type == "online_distill":
        _validate_distill(cfg)
    if cfg.data.train_type == "kd" and (cfg.objective.teacher_path is None or cfg.objective.teacher_url is not None):
        raise ConfigError("kd compares full distributions with a teacher in this process; set --teacher_path DIR "
                          "(and no teacher_url)")
    _validate_data_columns(cfg)
    _validate_report_to(cfg)


def steps_per_rollout(rl: RLConfig) -> int:
    """Optimizer steps taken on one rollout: ``rollout_interval`` whole-rollout steps, or
    ``ppo_epochs`` passes of ``mini_batches`` steps (one of the two forms is 1)."""
    return rl.rollout_interval * rl.mini_batches * rl.ppo_epochs


def _validate_objective_fields(cfg: Config) -> None:
    """Fields an objective would otherwise ignore, or combine into a loss nobody means."""
    rl, train_type = cfg.rl, cfg.data.train_type
    if train_type == "online_ppo":  # GAE per token, one ratio per token: these choices are the GRPO family's
        for name, default in (("advantage_estimator", "grpo"), ("importance_sampling_level", "token")):
            if getattr(rl, name) != default:
                raise ConfigError(f"{name}={getattr(rl, name)!r} applies to the GRPO family, but online_ppo takes its "
                                  f"advantages from its critic (GAE) with a ratio per token; remove --{name} or use "
                                  "--train_type online_grpo")
    if rl.importance_sampling_level == "sequence" and rl.advantage_estimator in PER_TOKEN_ESTIMATORS:
        raise ConfigError(f"importance_sampling_level='sequence' (GSPO) needs one advantage per sample, but "
                          f"{rl.advantage_estimator} gives one per token; use --importance_sampling_level sequence_token "
                          "(GSPO-token) or another --advantage_estimator")
    if rl.policy_loss == "cispo" and (rl.importance_sampling_level != "token" or rl.clip_ratio_c is not None):
        what = "clip_ratio_c" if rl.clip_ratio_c is not None else "importance_sampling_level"
        raise ConfigError(f"policy_loss='cispo' weighs each token by its own clipped ratio, so {what}="
                          f"{getattr(rl, what)!r} (a form of PPO's clipped surrogate) does not apply; remove --{what} "
                          "or use --policy_loss clip")
    if rl.importance_sampling_level != "token" and rl.rl_loss_agg == "seq_mean_token_sum_norm":
        raise ConfigError(f"importance_sampling_level={rl.importance_sampling_level!r} (GSPO) averages its loss per "
                          "sequence, so rl_loss_agg='seq_mean_token_sum_norm' does not apply; use --rl_loss_agg "
                          "seq_mean")


def _validate_distill(cfg: Config) -> None:
    """One teacher, and the full-distribution loss only with a teacher in this process."""
    o = cfg.objective
    if (o.teacher_path is None) == (o.teacher_url is None):
        given = "both" if o.teacher_path is not None else "neither"
        raise ConfigError(f"online_distill needs one teacher, got {given} of teacher_path and teacher_url; set "
                          "--teacher_path DIR (in-process) or --teacher_url URL (an OpenAI-compatible server)")
    if cfg.rl.dynamic_sampling and o.distill_coef == 0:
        raise ConfigError("dynamic_sampling drops groups whose rewards are equal, but pure distillation "
                          "(distill_coef=0) learns from the teacher, not the rewards; set --dynamic_sampling false "
                          "or --distill_coef above 0")
    if o.teacher_api_key_env is not None and o.teacher_url is None:
        raise ConfigError(f"teacher_api_key_env={o.teacher_api_key_env!r} is the API key of teacher_url, which is not "
                          "set; an in-process teacher (teacher_path) needs none: remove teacher_api_key_env")
    if o.distill_loss == "jsd" and o.teacher_path is None:
        raise ConfigError("distill_loss=jsd compares full distributions, which a server does not return; set "
                          "--teacher_path DIR, or use --distill_loss reverse_kl_pg with teacher_url")


def _validate_reward(cfg: Config) -> None:
    """A reward model is judged on held-out pairs, not by generation."""
    if cfg.data.eval_data_path is not None:
        raise ConfigError(f"eval_data_path={cfg.data.eval_data_path!r} holds prompts answered by generation, which a "
                          "reward model cannot do; give held-out preference pairs as --val_data_path (metrics "
                          "val/accuracy, val/margin)")


def _validate_ranges(cfg: Config) -> None:
    """Every section field's knob range (its metadata, an astrai.flags.Range), in field order:
    `max_turns=0 must be >= 1 (assistant turns per multi-turn episode)`."""
    for section in vars(cfg).values():
        if not dataclasses.is_dataclass(section):
            continue  # the model's dict: ModelConfig checks its own fields
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            within, value = f.metadata.get("range"), getattr(section, f.name)
            if within is None or value is None or within.contains(value):
                continue  # None passed the type check: the field is optional
            null = " (or null)" if is_optional(hints[f.name]) else ""
            note = f" {f.metadata['note']}" if "note" in f.metadata else ""
            raise ConfigError(f"{f.name}={value} must be {within.text()}{null}{note}")


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
