"""SamplingParams' fields as command-line flags: one flag per field, derived from the dataclass.

`astrai generate` and `astrai chat` call `add_sampling_arguments` to get a flag for every
SamplingParams field (name, type, help and default from the dataclass; a field whose metadata says
`flag=False`, like the compiled `guide`, has none), and `sampling_params_from_args` to build the
SamplingParams of a parsed command line. A field that the model's generation_config.json may set
(defaults.py) is None in the namespace when the command line leaves it unset, and takes the
model's value, else SamplingParams' own default. Adding a field to SamplingParams adds the flag to both commands.
Each flag's parser comes from the field's declared type and its help shows the field's range, both
by `astrai.flags`' one rule (as `astrai serve`'s and `astrai train`'s flags), with its conventions
(kebab-case spellings, `--no-ignore-eos`).
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import Field, fields
from typing import Any

from astrai.flags import add_dataclass_arguments, flag_kwargs
from astrai.infer.defaults import DEFAULT_FIELDS, GENERATION_CONFIG_HELP, with_defaults
from astrai.infer.sampling import SamplingParams

_HINTS = typing.get_type_hints(SamplingParams)
FLAG_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if f.metadata.get("flag", True))


def add_sampling_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """A `sampling` group with one flag per SamplingParams field, plus `--generation_config`.

    A flag's default is SamplingParams', or this command's own from `defaults` (`astrai chat`:
    `{"max_tokens": 512}`); a field the model's generation_config.json may set is None (unset)."""
    defaults = defaults or {}
    unknown = sorted(set(defaults) - set(FLAG_FIELDS))
    if unknown:
        raise ValueError(f"defaults for {unknown}, which are not SamplingParams flags; expected some of {FLAG_FIELDS}")

    def help_(f: Field, default: Any) -> str:
        if f.name in defaults:
            shown = f"default: {defaults[f.name]}"
        elif f.name in DEFAULT_FIELDS.values():  # unset: the model's generation_config.json, then ours
            shown = f"default: the model's, else {f.default}"
        else:
            shown = f"default: {f.default}"
        within = f"{f.metadata['range'].text()}; " if "range" in f.metadata else ""
        repeatable = " (repeatable)" if flag_kwargs(f.name, _HINTS[f.name]).get("action") == "append" else ""
        return f"{f.metadata['help']}{repeatable} ({within}{shown})"

    unset = {name: None for name in DEFAULT_FIELDS.values() if name not in defaults}
    group = parser.add_argument_group("sampling")
    add_dataclass_arguments(group, SamplingParams, FLAG_FIELDS, defaults={**unset, **defaults}, help=help_,
                            none_is_unset=True)  # None = unset: the model's default, then SamplingParams'
    group.add_argument("--generation_config", default="auto", help=GENERATION_CONFIG_HELP)


def sampling_params_from_args(args: argparse.Namespace, generation_defaults: dict[str, Any]) -> SamplingParams:
    """The SamplingParams of a parsed command line: the flags given, then the model's
    generation_config.json defaults, then SamplingParams' own (ValueError names a bad field)."""
    given = {name: getattr(args, name) for name in FLAG_FIELDS}
    return SamplingParams(**with_defaults(given, generation_defaults))
