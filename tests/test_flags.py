"""astrai.flags: the one type-to-parser rule of every command's flags (by the declared type, never
by the text), `knob` ranges, and the dataclass-to-flags builder."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest

from astrai.flags import ArgumentParser, FlagValueError, Range, add_dataclass_arguments, knob, parse_value


@pytest.mark.parametrize("tp, text, value", [
    (int, "3", 3), (float, "3", 3.0), (float, "1e-3", 1e-3), (str, "1.0", "1.0"), (bool, "off", False),
    (int | None, "null", None), (str | None, "None", None), (int | float, "2", 2), (int | float, "0.5", 0.5),
    (list[int], "1,2", [1, 2]), (list[int], "[1, 2]", [1, 2]), (list[str], "a", ["a"]), (list[str], "[]", []),
    (int | list[int] | None, "4", 4), (int | list[int] | None, "4,5", [4, 5]),
    (Literal["token", "sequence"], "sequence", "sequence"), (dict[str, int] | None, '{"a": 1}', {"a": 1}),
])
def test_the_declared_type_decides(tp, text, value):
    got = parse_value(text, tp)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("tp, text", [
    (int, "1.0"), (int, "x"), (float, "fast"), (bool, "maybe"), (int, "null"), (list[int], "1,,2"),
    (list[int], "[1, a]"), (Literal["token", "sequence"], "tokens"), (dict[str, int], "[1]"),
])
def test_a_value_the_type_does_not_take_is_refused(tp, text):
    with pytest.raises(FlagValueError):
        parse_value(text, tp)


def test_range_states_and_checks_its_bounds():
    assert [Range(ge=1).text(), Range(gt=0).text(), Range(gt=0, le=10).text(), Range(ge=0, lt=0.5).text()] == [
        ">= 1", "> 0", "within (0, 10]", "within [0, 0.5)"]
    r = Range(gt=0, le=10)
    assert [r.contains(x) for x in (0, 1e-9, 10, 10.5, float("nan"), float("inf"))] == [
        False, True, True, False, False, False]
    assert r.bounds() == {"gt": 0, "le": 10}


@dataclass
class Knobs:
    seed: int = knob(0, help="a seed", ge=0)
    share: float | None = knob(None, help="a share", gt=0, le=1)
    names: list[str] = knob(default_factory=lambda: ["a"], help="names")
    level: Literal["token", "sequence"] = knob("token", help="level")
    fast: bool = knob(False, help="go fast")


def test_dataclass_flags_follow_the_rule(capsys):
    p = ArgumentParser(prog="probe")
    add_dataclass_arguments(p, Knobs)
    assert vars(p.parse_args([])) == {"seed": 0, "share": None, "names": ["a"], "level": "token", "fast": False}
    args = p.parse_args(["--seed", "3", "--share", "0.5", "--names", "x,y", "z", "--level", "sequence", "--fast"])
    assert vars(args) == {"seed": 3, "share": 0.5, "names": ["x", "y", "z"], "level": "sequence", "fast": True}
    for argv, message in [(["--seed", "1.0"], "argument --seed: value '1.0' is not int; expected int (e.g. --seed 1)"),
                          (["--level", "word"], "expected one of token, sequence"),
                          (["--sede", "1"], "did you mean --seed?")]:
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert message in capsys.readouterr().err
    p = ArgumentParser(prog="probe")
    add_dataclass_arguments(p, Knobs, ["seed"], suppress=True)
    assert vars(p.parse_args([])) == {} and p.parse_args(["--seed", "2"]).seed == 2


def test_a_type_no_flag_spells_fails_when_the_parser_is_built():
    @dataclass
    class Odd:
        thing: argparse.Namespace | None = None

    with pytest.raises(TypeError, match="'thing' has type .* which no flag spells"):
        add_dataclass_arguments(ArgumentParser(), Odd)
