"""Command-line conventions shared by every `astrai` command, and the one dataclass-to-flags layer.

Every command builds its parser with this module's `ArgumentParser` (a drop-in for argparse's), so
its flags follow one set of rules without each call site repeating them:

- a flag written in snake_case, as in the YAML and the docs (`--max_model_len`), also answers to
  its kebab-case spelling, vLLM's (`--max-model-len`);
- an unrecognized flag is a usage error that names the nearest real one (`--max_tokns: did you
  mean --max_tokens?`);
- a boolean switch (`action="store_true"`) also has a `--no-` form (`--no-verify`), and a boolean
  setting (`action="bool"`, e.g. an engine field) takes `--x`, `--x true|false` or `--no-x`
  (`--no-enable-prefix-caching`).

A dataclass field becomes a flag by one rule, driven by its declared type and never by what the
text looks like (`parse_value`: an `int` field refuses "1.0", naming the flag, the value and the
fix). `add_dataclass_arguments` makes the flags of `EngineConfig` (`astrai generate`, `chat`,
`serve`) and of `SamplingParams` (infer/sampling_flags.py); `astrai train`'s config flags go
through the same `parse_value` (`astrai.config.parse_overrides`), and `astrai eval` types its
flags with `value_type`. A field made with `knob` carries its help text and its numeric `Range`
as metadata, read by every check of that number: the config validator (config_checks.py),
`SamplingParams`, the server's request models (serve/protocol.py), `--help` and the docs test.
Sub-parsers are built with the same class, so `astrai ckpt list --verify` follows the rules too.
This module imports nothing of astrai, so every layer may use it.
"""

from __future__ import annotations

import argparse
import math
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import reduce
from typing import Any, NoReturn

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


def kebab(option: str) -> str:
    """`--max_model_len` -> `--max-model-len` (the leading dashes are kept)."""
    body = option.lstrip("-")
    return option[: len(option) - len(body)] + body.replace("_", "-")


def spellings(option_strings: list[str] | tuple[str, ...]) -> list[str]:
    """The option strings with the kebab-case spelling of each long snake_case one after it."""
    out: list[str] = []
    for option in option_strings:
        out.append(option)
        if option.startswith("--") and "_" in option and kebab(option) not in option_strings:
            out.append(kebab(option))
    return out


def negations(option_strings: list[str] | tuple[str, ...]) -> list[str]:
    """`--no-x` and `--no_x` for the long option `--x` (its first long spelling)."""
    long = [o for o in option_strings if o.startswith("--")]
    if not long:
        return []
    name = long[0][2:]
    return [kebab(f"--no-{name}"), f"--no_{name.replace('-', '_')}"]


def parse_bool(text: str) -> bool:
    """`true/false` (also 1/0, yes/no, on/off) -> bool; anything else is a usage error."""
    lowered = text.lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class BoolFlag(argparse.Action):
    """A boolean flag: `--x` sets true, `--no-x` false; with `takes_value`, `--x false` too.

    A switch (`store_true`'s replacement) takes no value, so it never swallows a positional
    argument that follows it (`astrai ckpt list --verify DIR`)."""

    def __init__(self, option_strings: list[str], dest: str, default: Any = False, takes_value: bool = False,
                 required: bool = False, help: str | None = None, **_: Any) -> None:
        self.negative = negations(option_strings)
        super().__init__([*spellings(option_strings), *self.negative], dest, nargs="?" if takes_value else 0,
                         default=default, required=required, help=help, metavar="BOOL" if takes_value else None)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string in self.negative:
            if values not in (None, []):
                parser.error(f"{option_string} takes no value; use {self.option_strings[0]} {values} instead")
            setattr(namespace, self.dest, False)
            return
        if values in (None, []):
            setattr(namespace, self.dest, True)
            return
        try:
            setattr(namespace, self.dest, parse_bool(values))
        except argparse.ArgumentTypeError as e:
            parser.error(f"argument {option_string}: {e}")


class BoolSetting(BoolFlag):
    """`action="bool"`: a boolean setting that also takes a value (`--x`, `--x false`, `--no-x`)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.pop("type", None)  # parse_bool is built in
        super().__init__(option_strings, dest, takes_value=True, **kwargs)


def _with_kebab(base: type[argparse.Action]) -> type[argparse.Action]:
    """`base` whose long snake_case options also answer to their kebab-case spelling."""

    class Kebab(base):  # type: ignore[misc, valid-type]
        def __init__(self, option_strings: list[str], *args: Any, **kwargs: Any) -> None:
            super().__init__(spellings(option_strings), *args, **kwargs)

    Kebab.__name__ = base.__name__
    return Kebab


class HelpFormatter(argparse.HelpFormatter):
    """`--max_model_len, --max-model-len N`: every spelling, the value's name once (as Python 3.13)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        default = self._get_default_metavar_for_optional(action)
        return f"{', '.join(action.option_strings)} {self._format_args(action, default)}"


class RawEpilogHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter that prints the description and epilog as written (tables, e.g. `astrai train`)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with astrai's conventions (module docstring); sub-parsers inherit them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        for name, action in [(None, argparse._StoreAction), ("store", argparse._StoreAction),
                             ("store_const", argparse._StoreConstAction), ("append", argparse._AppendAction),
                             ("append_const", argparse._AppendConstAction), ("count", argparse._CountAction),
                             ("extend", argparse._ExtendAction)]:
            self.register("action", name, _with_kebab(action))
        self.register("action", "store_true", BoolFlag)
        self.register("action", "bool", BoolSetting)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)  # for error(): a required flag's typo
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """argparse's usage error, plus the nearest flag for each unrecognized one (as `astrai train`);
        a missing required flag also names the nearest flag of what was given instead (`--promt`)."""
        if message.startswith("unrecognized arguments: "):
            message += "".join(self._nearest_flag(arg) for arg in message.split(": ", 1)[1].split())
        elif "required" in message:
            known = {o for action in self._actions for o in action.option_strings}
            given = [a for a in getattr(self, "_argv", []) if a.startswith("--") and a.split("=", 1)[0] not in known]
            message += "".join(self._nearest_flag(arg) for arg in given)
        super().error(message)

    def _nearest_flag(self, arg: str) -> str:
        import difflib

        if not arg.startswith("--"):
            return ""
        name = arg.split("=", 1)[0]
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        return f"; {name}: did you mean {close[0]}?" if close else ""


# ------------------------------------------------------------------------ knobs: one field, one range


@dataclass(frozen=True)
class Range:
    """The numbers a field accepts: each bound inclusive (`ge`, `le`) or exclusive (`gt`, `lt`), or
    absent. Only finite numbers are in any range (NaN and infinities never are)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def text(self) -> str:
        """`>= 1`, `> 0`, `<= 2` or `within [0, 1)`: how errors, --help and the docs state it."""
        low = (f"[{_number(self.ge)}" if self.ge is not None else f"({_number(self.gt)}"
               if self.gt is not None else None)
        high = (f"{_number(self.le)}]" if self.le is not None else f"{_number(self.lt)})"
                if self.lt is not None else None)
        if low and high:
            return f"within {low}, {high}"
        if low:
            return f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
        if high:
            return f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"
        return "any finite number"

    def bounds(self) -> dict[str, float]:
        """The bounds as keywords (`{"gt": 0, "le": 10}`), the form pydantic's `Field` takes."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le), ("lt", self.lt))
                if v is not None}


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def knob(default: Any = MISSING, *, help: str = "", ge: float | None = None, gt: float | None = None,
         le: float | None = None, lt: float | None = None, flag: bool = True, note: str = "",
         default_factory: Any = MISSING) -> Any:
    """A dataclass field that carries its facts: help text, the range of its numbers (`ge`, `gt`,
    `le`, `lt`: a `Range` under metadata "range", read by `field_range`) and whether a command line
    shows it (`flag`). `note` follows the range in a config error (why the bound is what it is)."""
    metadata: dict[str, Any] = {"help": help, "flag": flag}
    if any(b is not None for b in (ge, gt, le, lt)):
        metadata["range"] = Range(ge, gt, le, lt)
    if note:
        metadata["note"] = note
    return field(default=default, default_factory=default_factory, metadata=metadata)


def field_range(cls: type, name: str) -> Range | None:
    """The `Range` of dataclass `cls`'s field `name` (from `knob`), or None when it has none."""
    return {f.name: f for f in fields(cls)}[name].metadata.get("range")


# ------------------------------------------------------------------- the type-to-parser rule


class FlagValueError(ValueError):
    """A command-line string that a field's type does not take; `problem` says what is wrong with
    it (e.g. " (an empty item)"), or is empty when the type alone is the reason."""

    def __init__(self, problem: str = "") -> None:
        super().__init__(problem)
        self.problem = problem


def type_name(tp: Any) -> str:
    """`int`, `float | None`, `list[str]`: a type as the docs and errors write it."""
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def is_optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


def base_types(tp: Any) -> tuple[Any, ...]:
    """`int | None` -> (int,); `str | list[str] | None` -> (str, list[str])."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(tp) if a is not type(None))
    return (tp,)


def parse_value(text: str, tp: Any) -> Any:
    """One command-line string -> a value of the declared type `tp`, by the type alone (never by
    what the text looks like): `int` takes whole numbers only ("1.0" is refused), `float` any
    number, `bool` true/false (1/0, yes/no, on/off), `str` anything, a `Literal` its values, a
    `dict` a JSON/YAML mapping, `list[X]` comma-separated items (`a,b`; one item without a comma
    is a one-item list) or the YAML flow form (`[a, b]`), and an optional type also `null`/`none`.
    A union takes the first of its types, in declared order, that accepts the text. Raises
    FlagValueError."""
    if text.lower() in ("null", "none") and is_optional(tp):
        return None
    problem = ""
    for base in base_types(tp):
        try:
            return _parse_one(text, base)
        except FlagValueError as e:
            problem = problem or e.problem
    raise FlagValueError(problem)


def _parse_one(text: str, tp: Any) -> Any:
    if tp is Any or tp is str:
        return text
    if tp is bool:
        if text.lower() in TRUE_WORDS + FALSE_WORDS:
            return text.lower() in TRUE_WORDS
        raise FlagValueError()
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            raise FlagValueError() from None
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        for choice in typing.get_args(tp):
            if text == str(choice):
                return choice
        raise FlagValueError()
    if origin is list:
        return _parse_list(text, (typing.get_args(tp) or (Any,))[0])
    if origin is dict or tp is dict:
        import yaml  # JSON objects are YAML too

        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = None
        if isinstance(value, dict):
            return value
        raise FlagValueError()
    raise TypeError(f"no command-line form for the type {type_name(tp)}; give the field metadata flag=False")


def _parse_list(text: str, item_tp: Any) -> list[Any]:
    """Plain comma-separated text is split as it stands, so `mymod:fn` or `./rm` stays one string
    (YAML would read `mymod:fn` as a scalar and `a: b` as a mapping)."""
    if text.strip().startswith("["):  # YAML flow form
        import yaml

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError:
            raise FlagValueError(" (not valid YAML)") from None
        if not isinstance(values, list):
            raise FlagValueError()
        texts = [v if isinstance(v, str) else None for v in values]
    else:
        values = texts = [t.strip() for t in text.split(",")] if text.strip() else []
        if "" in texts:
            raise FlagValueError(" (an empty item)")  # "a,,b" or a trailing comma: most likely a typo
    items = []
    for value, item_text in zip(values, texts):
        item = _item(value, item_text, item_tp)
        if item is _REFUSED:
            raise FlagValueError(f" (item {value!r} is not {type_name(item_tp)})")
        items.append(item)
    return items


_REFUSED = object()


def _item(value: Any, text: str | None, tp: Any) -> Any:
    """One list item: parsed from its text, or (a YAML flow item that is not a string) checked."""
    if text is not None:
        try:
            return parse_value(text, tp)
        except FlagValueError:
            return _REFUSED
    if tp is Any or (tp is float and isinstance(value, int | float) and not isinstance(value, bool)):
        return float(value) if tp is float else value
    return value if type(value) is tp else _REFUSED


EXAMPLES = {int: "1", float: "0.5", bool: "true"}


def expected(name: str, tp: Any) -> str:
    """`expected int (e.g. --engine_seed 1)`, or for a list its accepted forms: what an error about
    flag `name` of type `tp` says the fix is."""
    lists = [b for b in base_types(tp) if typing.get_origin(b) is list]
    if lists:
        item = (typing.get_args(lists[0]) or (Any,))[0]
        a, b = {int: ("0", "1"), float: ("0.5", "1.0")}.get(item, ("a", "b"))
        null = ", or null" if is_optional(tp) else ""
        return (f"expected {type_name(tp)} as comma-separated items (--{name} {a},{b}), one item (--{name} {a}) "
                f"or YAML flow (--{name} '[{a}, {b}]'){null}")
    mapping = [b for b in base_types(tp) if typing.get_origin(b) is dict]
    if mapping:
        key, value = (typing.get_args(mapping[0]) or (str, Any))
        shown = f'{{"{EXAMPLES.get(key, "a")}": {EXAMPLES.get(value, 1)}}}'
        return f"expected a JSON object (e.g. --{name} '{shown}')"
    literal = [b for b in base_types(tp) if typing.get_origin(b) is typing.Literal]
    if literal:
        return f"expected one of {', '.join(map(str, typing.get_args(literal[0])))}"
    example = next((EXAMPLES[b] for b in base_types(tp) if b in EXAMPLES), None)
    return f"expected {type_name(tp)}" + (f" (e.g. --{name} {example})" if example else "")


def value_type(name: str, tp: Any) -> Any:
    """argparse's `type=` for flag `--name` of type `tp`: `parse_value`, whose refusal argparse
    reports as `argument --name: value '1.0' is not int; expected int (e.g. --name 1)`."""

    def parse(text: str) -> Any:
        try:
            return parse_value(text, tp)
        except FlagValueError as e:
            raise argparse.ArgumentTypeError(f"value {text!r}{e.problem} is not {type_name(tp)}; "
                                             f"{expected(name, tp)}") from None

    parse.__name__ = type_name(tp)
    return parse


class ListFlag(argparse.Action):
    """A `list[X]` flag: `--x 1,2`, `--x 1 2`, `--x '[1, 2]'`: every value's items, in order."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(spellings(option_strings), dest, nargs="+", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [item for value in values for item in value])


def flag_kwargs(name: str, tp: Any) -> dict[str, Any]:
    """argparse keywords for a field of declared type `tp`, by one rule: a `bool` is a setting
    (`--x`, `--x false`, `--no-x`); a type that takes one X or a list of X (`str | list[str]`) is a
    repeatable flag (`--stop a --stop b`); a list takes items as `parse_value` does, also over
    several values (`--ids 1 2`); anything else is one value through `parse_value`."""
    bases = base_types(tp)
    if bases == (bool,):
        return {"action": "bool"}
    if len(bases) == 2 and typing.get_origin(bases[1]) is list and typing.get_args(bases[1]) == (bases[0],):
        return {"action": "append", "type": value_type(name, bases[0])}
    if len(bases) == 1 and typing.get_origin(bases[0]) is list:
        return {"action": ListFlag, "type": value_type(name, bases[0])}
    for base in bases:
        if base not in (Any, str, bool, int, float) and typing.get_origin(base) not in (typing.Literal, list, dict):
            raise TypeError(f"field {name!r} has type {type_name(tp)}, which no flag spells; give it metadata "
                            "flag=False or teach astrai.flags.parse_value the type")
    kwargs: dict[str, Any] = {"type": value_type(name, tp)}
    if any(typing.get_origin(b) is dict for b in bases):
        kwargs["metavar"] = "JSON"
    return kwargs


def add_dataclass_arguments(parser: Any, cls: type, names: list[str] | tuple[str, ...] | None = None, *,
                            defaults: dict[str, Any] | None = None, suppress: bool = False,
                            help: Callable[[Field, Any], str] | None = None,
                            aliases: dict[str, list[str]] | None = None, none_is_unset: bool = False) -> None:
    """One flag per field of dataclass `cls` (`names`, default all public fields) on `parser` (or an
    argument group), its parser from the field's declared type (`flag_kwargs`). A flag's default is
    `defaults[name]` when given, else the field's; with `suppress` an unset flag leaves no attribute
    (the caller passes on only what the command line gave). `help(field, default)` writes the help
    line; `aliases` adds option strings (`{"num_threads": ["--threads"]}`). With `none_is_unset` the
    caller reads None as "not given" (and fills its own defaults), so no flag takes `none`."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    defaults = defaults or {}
    for name in names if names is not None else [n for n in by_name if not n.startswith("_")]:
        f = by_name[name]
        if name in defaults:
            default = defaults[name]
        else:
            default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
        tp = reduce(lambda a, b: a | b, base_types(hints[name])) if none_is_unset else hints[name]
        kwargs = flag_kwargs(name, tp)
        shown = help(f, default) if help is not None else f.metadata.get("help") or None
        parser.add_argument(f"--{name}", *(aliases or {}).get(name, []),
                            default=argparse.SUPPRESS if suppress else default,
                            help=shown.replace("%", "%%") if shown else None, **kwargs)
