"""SamplingParams' fields as command-line flags: one flag per field, derived from the dataclass.

`astrai generate` and `astrai chat` call `add_sampling_arguments` to get a flag for every
SamplingParams field (name, type, help and default from the dataclass; a field whose metadata says
`flag=False`, like the compiled `guide`, has none), and `sampling_params_from_args` to build the
SamplingParams of a parsed command line. A field that the model's generation_config.json may set
(defaults.py) is None in the namespace when the command line leaves it unset, and takes the
model's value, else SamplingParams' own default. Adding a field to SamplingParams adds the flag to both commands.
The flag conventions (kebab-case spellings, `--no-ignore-eos`) come from `astrai.flags`.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from dataclasses import Field, fields
from typing import Any

from astrai.infer.defaults import DEFAULT_FIELDS, GENERATION_CONFIG_HELP, with_defaults
from astrai.infer.sampling import SamplingParams

_HINTS = typing.get_type_hints(SamplingParams)
FLAG_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if f.metadata.get("flag", True))


def _json_object(text: str) -> dict[str, Any]:
    """`--logit_bias '{"50256": -100}'`: a JSON object (keys are token ids as strings)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"50256\": -100}}', got {text!r}")
    return value


def _base_types(tp: Any) -> tuple[Any, ...]:
    """`int | None` -> (int,); `str | list[str] | None` -> (str, list[str])."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(tp) if a is not type(None))
    return (tp,)


def _flag_kind(f: Field) -> dict[str, Any]:
    """argparse keywords for a field's type: a switch, a number, a repeatable string, a list, JSON."""
    kinds = _base_types(_HINTS[f.name])
    if kinds == (bool,):
        return {"action": "store_true"}
    if kinds in ((int,), (float,)):
        return {"type": kinds[0]}
    if kinds == (str, list[str]):
        return {"action": "append", "help_suffix": " (repeatable)"}
    if kinds == (list[int],):
        return {"type": int, "nargs": "+"}
    if typing.get_origin(kinds[0]) is dict:
        return {"type": _json_object, "metavar": "JSON"}
    raise TypeError(f"SamplingParams.{f.name} has type {_HINTS[f.name]}, which no flag spells; "
                    "give it metadata flag=False or teach sampling_flags._flag_kind the type")


def add_sampling_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """A `sampling` group with one flag per SamplingParams field, plus `--generation_config`.

    A flag's default is SamplingParams', or this command's own from `defaults` (`astrai chat`:
    `{"max_tokens": 512}`); a field the model's generation_config.json may set is None (unset)."""
    defaults = defaults or {}
    unknown = sorted(set(defaults) - set(FLAG_FIELDS))
    if unknown:
        raise ValueError(f"defaults for {unknown}, which are not SamplingParams flags; expected some of {FLAG_FIELDS}")
    group = parser.add_argument_group("sampling")
    for f in fields(SamplingParams):
        if f.name not in FLAG_FIELDS:
            continue
        kind = _flag_kind(f)
        suffix = kind.pop("help_suffix", "")
        if f.name in defaults:
            default, shown = defaults[f.name], f"default: {defaults[f.name]}"
        elif f.name in DEFAULT_FIELDS.values():  # unset: the model's generation_config.json, then ours
            default, shown = None, f"default: the model's, else {f.default}"
        else:
            default, shown = f.default, f"default: {f.default}"
        help_ = f"{f.metadata['help']}{suffix} ({shown})".replace("%", "%%")
        group.add_argument(f"--{f.name}", default=default, help=help_, **kind)
    group.add_argument("--generation_config", default="auto", help=GENERATION_CONFIG_HELP)


def sampling_params_from_args(args: argparse.Namespace, generation_defaults: dict[str, Any]) -> SamplingParams:
    """The SamplingParams of a parsed command line: the flags given, then the model's
    generation_config.json defaults, then SamplingParams' own (ValueError names a bad field)."""
    given = {name: getattr(args, name) for name in FLAG_FIELDS}
    return SamplingParams(**with_defaults(given, generation_defaults))
