"""Command-line conventions shared by every `astrai` command: kebab-case spellings and `--no-` booleans.

Every command builds its parser with this module's `ArgumentParser` (a drop-in for argparse's), so
its flags follow one set of rules without each call site repeating them:

- a flag written in snake_case, as in the YAML and the docs (`--max_model_len`), also answers to
  its kebab-case spelling, vLLM's (`--max-model-len`);
- an unrecognized flag is a usage error that names the nearest real one (`--max_tokns: did you
  mean --max_tokens?`);
- a boolean switch (`action="store_true"`) also has a `--no-` form (`--no-verify`), and a boolean
  setting (`action="bool"`, e.g. an engine field) takes `--x`, `--x true|false` or `--no-x`
  (`--no-enable-prefix-caching`).

Sub-parsers are built with the same class, so `astrai ckpt list --verify` follows the rules too.
`astrai train`'s config flags are parsed by `astrai.config.parse_overrides`, which follows the
same rules with the config fields' types.
"""

from __future__ import annotations

import argparse
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

    def error(self, message: str) -> NoReturn:
        """argparse's usage error, plus the nearest flag for each unrecognized one (as `astrai train`)."""
        if message.startswith("unrecognized arguments: "):
            message += "".join(self._nearest_flag(arg) for arg in message.split(": ", 1)[1].split())
        super().error(message)

    def _nearest_flag(self, arg: str) -> str:
        import difflib

        if not arg.startswith("--"):
            return ""
        name = arg.split("=", 1)[0]
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        return f"; {name}: did you mean {close[0]}?" if close else ""
