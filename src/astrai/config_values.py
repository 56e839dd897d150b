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
import types
import typing
from typing import Any

import yaml

from astrai.flags import FALSE_WORDS, TRUE_WORDS


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
}

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
    "early_stopping_mode": ("min", "max"),
    "parallel_mode": ("none", "ddp", "fsdp"),
    "scale_rewards": ("group", "none"),
    "rl_loss_agg": ("token_mean", "seq_mean", "seq_mean_token_sum_norm"),
    "rollout_is_level": ("none", "token", "sequence"),
    "kl_estimator": ("k1", "k2", "k3"),
    "advantage_estimator": ("grpo", "rloo", "reinforce_pp"),
    "importance_sampling_level": ("token", "sequence"),
}


def is_online(train_type: str) -> bool:
    """Whether `train_type` trains on rollouts of the live policy (the online RL loop)."""
    return TRAIN_TYPES.get(train_type) == "prompt"


def missing_package(name: str) -> str | None:
    """The fix when report_to's backend `name` cannot be imported (checked without importing it)."""
    top = "tensorboard" if name == "tensorboard" else REPORTERS[name][0]  # torch.utils.tensorboard needs it
    if importlib.util.find_spec(top) is None:
        return f"report_to has {name!r} but its package is not installed; pip install {REPORTERS[name][1]}, " \
               f"or remove {name} from report_to"
    return None


def type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _is_optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


def base_types(tp: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(tp) if a is not type(None))
    return (tp,)


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
        if _is_optional(tp):
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
    """Parse a command-line string for a field of type ``tp``."""
    if text.lower() in ("null", "none") and _is_optional(tp):
        return None
    for base in base_types(tp):
        if base is bool:
            if text.lower() in TRUE_WORDS:
                return True
            if text.lower() in FALSE_WORDS:
                return False
        elif base is int:
            try:
                return int(text)
            except ValueError:
                pass
        elif base is float:
            try:
                return float(text)
            except ValueError:
                pass
        elif base is str:
            return text
        else:  # lists, dicts: YAML syntax on the command line
            try:
                return check_value(name, section, yaml.safe_load(text), base)
            except (yaml.YAMLError, ConfigError):
                pass
    raise ConfigError(f"flag --{name} has value {text!r}; expected {type_name(tp)}")
