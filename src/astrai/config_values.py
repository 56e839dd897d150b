"""Typed values of the run configuration: a YAML value or a command-line string checked against
a config field's annotation (``float | None``, ``list[str]``, ...) and coerced, or a ``ConfigError``
naming the field, the value and the expected type. ``astrai.config`` applies these to every key."""

from __future__ import annotations

import types
import typing
from typing import Any

import yaml

from astrai.flags import FALSE_WORDS, TRUE_WORDS


class ConfigError(ValueError):
    """A bad config file, key, flag or value; the message names the field and the fix."""


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
