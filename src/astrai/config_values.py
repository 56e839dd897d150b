"""Typed values of the run configuration: a YAML value or a command-line string checked against
a config field's annotation (``float | None``, ``list[str]``, ...) and coerced, or a ``ConfigError``
naming the field, the value and the expected type. ``astrai.config`` applies these to every key.

The closed choices of the config live here as data (``CHOICES``, ``TRAIN_TYPES``, ``REPORTERS``),
so the config module imports nothing of ``astrai.train``; the modules that implement each choice
(``train/objectives``, ``train/optim.py``, ``train/losses.py``, ``train/dist.py``,
``train/reporters.py``) are checked against these tables by ``tests/train/test_config.py``. This
module imports nothing of astrai but ``flags.py``, so every layer may use ``did_you_mean``."""

from __future__ import annotations

import difflib
import importlib.util
import typing
from typing import Any

from astrai.flags import FlagValueError, base_types, expected, is_optional, parse_value, type_name


class ConfigError(ValueError):
    """A bad config file, key, flag or value; the message names the field and the fix."""


def did_you_mean(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """'; did you mean 'x'?' when a close match exists, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


# train_type -> the record kind (astrai.data.records) its dataset reads; "prompt" kinds train on
# rollouts of the live policy (the online loop). train/objectives' OBJECTIVES has the same keys.
TRAIN_TYPES: dict[str, str] = {
    "seq": "seq",
    "sft": "sft",
    "dpo": "dpo",
    "grpo": "rollout",
    "online_grpo": "prompt",
    "online_dpo": "prompt",
    "online_ppo": "prompt",
    "online_distill": "prompt",  # the student samples, a teacher scores every sampled token
    "kd": "sft",  # offline distillation from a teacher on SFT records
    "reward": "dpo",  # a reward model (Bradley-Terry) on preference pairs
}

# the RL algorithms users know by name -> the settings that give each (train_type and rl fields);
# configs/<name>.yaml is a ready run of each, and a --train_type of one of these names says so
ALGORITHMS: dict[str, dict[str, Any]] = {
    "gspo": {"train_type": "online_grpo", "importance_sampling_level": "sequence", "clip_eps": 3.0e-4,
             "clip_eps_high": 4.0e-4},
    "rloo": {"train_type": "online_grpo", "advantage_estimator": "rloo"},
    "dapo": {"train_type": "online_grpo", "clip_eps_high": 0.28, "rl_loss_agg": "token_mean",
             "mask_truncated_completions": True, "dynamic_sampling": True},
    "dr_grpo": {"train_type": "online_grpo", "scale_rewards": "none", "rl_loss_agg": "seq_mean_token_sum_norm"},
    "reinforce_pp": {"train_type": "online_grpo", "advantage_estimator": "reinforce_pp", "kl_coef": 0.01},
    "ppo": {"train_type": "online_ppo"},
}


def algorithm_flags(name: str) -> str:
    """The command-line flags that give algorithm `name` (``ALGORITHMS``)."""
    return " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in ALGORITHMS[name].items())


# report_to's names -> (the module a run imports, the package that provides it)
REPORTERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny (or mlflow)"),
}

# fields that name a choice -> the allowed values
CHOICES: dict[str, tuple[str, ...]] = {
    "train_type": tuple(TRAIN_TYPES),
    "optimizer": ("adamw", "muon"),
    "schedule": ("constant", "cosine", "wsd"),
    "loss_type": ("sigmoid", "ipo", "hinge"),  # DPO
    "row_layout": ("pad", "pack", "flat", "share"),  # seq, sft, dpo, reward, kd (train/objectives/packing.py)
    "distill_loss": ("reverse_kl_pg", "jsd"),  # online_distill
    "early_stopping_mode": ("min", "max"),
    "parallel_mode": ("none", "ddp", "fsdp"),
    "scale_rewards": ("group", "none"),
    "rl_loss_agg": ("token_mean", "seq_mean", "seq_mean_token_sum_norm"),
    "rollout_weight_transport": ("filesystem", "broadcast"),
    "async_rollout_source": ("auto", "thread", "process"),  # train/rl/pipeline.py
    "rollout_is_level": ("none", "token", "sequence"),
    "rollout_is_mode": ("truncate", "mask"),
    "policy_loss": ("clip", "cispo"),
    "kl_estimator": ("k1", "k2", "k3", "k1+", "k3+"),
    "advantage_estimator": ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"),
    "importance_sampling_level": ("token", "sequence", "sequence_token"),
    "eval_match": ("exact", "final_number"),  # data/tasks.py SCORERS
    "cpu_matmul": ("auto", "onednn", "blas"),  # model/matmul.py
}


# the advantage estimators that give one advantage per token (train/advantages.py's table states it
# by its functions; tests/train/test_advantages.py checks the two agree)
PER_TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")


def is_online(train_type: str) -> bool:
    """Whether `train_type` trains on rollouts of the live policy (the online RL loop)."""
    return TRAIN_TYPES.get(train_type) == "prompt"


DEFAULT_MAX_PROMPT_LEN = 256  # rl.max_prompt_len when unset and the model's positions have room


def default_max_prompt_len(rollout_max_tokens: int, max_positions: int) -> int:
    """``rl.max_prompt_len`` when it is unset (None): 256 tokens, or what the model's positions
    leave beside ``rollout_max_tokens``, so a prompt + completion row always fits the model."""
    return min(DEFAULT_MAX_PROMPT_LEN, max_positions - rollout_max_tokens)


def missing_package(name: str) -> str | None:
    """The fix when report_to's backend `name` cannot be imported (checked without importing it)."""
    top = "tensorboard" if name == "tensorboard" else REPORTERS[name][0]  # torch.utils.tensorboard needs it
    if importlib.util.find_spec(top) is None:
        return f"report_to has {name!r} but its package is not installed; pip install {REPORTERS[name][1]}, " \
               f"or remove {name} from report_to"
    return None


def _check_one(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, coerced value) for one non-None base type."""
    origin = typing.get_origin(tp) or tp
    if tp is Any:
        return True, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin in (list, tuple):
        return isinstance(value, list | tuple), list(value) if isinstance(value, tuple) else value
    if origin is dict:
        return isinstance(value, dict), value
    return True, value  # unknown annotation: let the owning dataclass validate it


def check_value(name: str, section: str, value: Any, tp: Any) -> Any:
    """Return ``value`` coerced to ``tp`` or raise a ConfigError naming field, value and type."""
    if value is None:
        if is_optional(tp):
            return None
        raise ConfigError(f"config key {name!r} in section {section!r} may not be null; expected {type_name(tp)}")
    for base in base_types(tp):
        ok, coerced = _check_one(value, base)
        if ok:
            return coerced
    raise ConfigError(
        f"config key {name!r} in section {section!r} has value {value!r} of type "
        f"{type(value).__name__}; expected {type_name(tp)}"
    )


def parse_flag_value(name: str, section: str, text: str, tp: Any) -> Any:
    """Parse a command-line string for config field ``name`` of type ``tp`` by the one rule every
    command's flags follow (``astrai.flags.parse_value``): a list field takes comma-separated items
    (``a,b``; one item without a comma is a one-item list) or the YAML flow form ``[a, b]``."""
    try:
        return parse_value(text, tp)
    except FlagValueError as e:
        raise ConfigError(f"flag --{name} has value {text!r}{e.problem}; {expected(name, tp)}") from None
