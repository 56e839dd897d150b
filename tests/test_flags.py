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


def _request_bounds(model: type, name: str) -> dict[str, float]:
    """The numeric bounds pydantic enforces on a request field (annotated_types' Ge, Gt, Le, Lt)."""
    out = {}
    for m in model.model_fields[name].metadata:
        for key in ("ge", "gt", "le", "lt"):
            if type(m).__name__.lower() == key:
                out[key] = getattr(m, key)
    return out


def test_a_knob_range_is_enforced_alike_by_sampling_params_the_server_and_the_config():
    """SamplingParams.repetition_penalty's range (0, 10] is its field's metadata: SamplingParams
    raises ValueError outside it and the server answers 400 naming the parameter at the same bound
    (it once let 20 through to SamplingParams); the config's rollout sampling fields carry the
    ranges of the SamplingParams fields they feed, so a run is refused where its rollouts would be."""
    import json

    from astrai.config import ConfigError, RLConfig, load_config
    from astrai.flags import field_range
    from astrai.infer.sampling import SamplingParams
    from astrai.serve.protocol import ChatCompletionRequest, CompletionRequest
    from astrai.serve.requests import APIError, parse_request

    assert field_range(SamplingParams, "repetition_penalty") == Range(gt=0, le=10)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}

    def request(**fields) -> ChatCompletionRequest:
        return parse_request(json.dumps({**chat, **fields}).encode(), ChatCompletionRequest)

    for value in (1e-3, 1, 10):
        assert SamplingParams(repetition_penalty=value).repetition_penalty == value
        assert request(repetition_penalty=value).repetition_penalty == value
    for value in (0, -1, 10.5, 20):
        with pytest.raises(ValueError, match=r"SamplingParams.repetition_penalty must be a finite number within "
                                             r"\(0, 10\], got"):
            SamplingParams(repetition_penalty=value)
        with pytest.raises(APIError) as e:
            request(repetition_penalty=value)
        assert (e.value.status, e.value.param) == (400, "repetition_penalty")
        assert ("less than or equal to 10" if value > 10 else "greater than 0") in e.value.message
    # every bounded sampling field of a request has SamplingParams' bounds, tighter only where the API is
    narrower = {"temperature": {"le": 2.0}, "n": {"le": 128}}  # OpenAI's caps
    chat_names = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs", "logprobs": None}  # a bool
    for model, renamed in ((ChatCompletionRequest, chat_names), (CompletionRequest, {})):
        checked = 0
        for name in model.model_fields:
            field_name = renamed.get(name, name)
            within = field_range(SamplingParams, field_name) if field_name in SamplingParams.__dataclass_fields__ else None
            if within is not None:
                assert _request_bounds(model, name) == {**within.bounds(), **narrower.get(name, {})}, name
                checked += 1
        assert checked >= 11, f"{model.__name__}: {checked} bounded sampling fields"
    for option, name in {"rollout_temperature": "temperature", "rollout_top_p": "top_p",
                         "rollout_top_k": "top_k"}.items():
        assert field_range(RLConfig, option) == field_range(SamplingParams, name)
    with pytest.raises(ConfigError, match=r"^rollout_top_p=1.5 must be within \(0, 1\]$"):
        load_config(None, ["--rollout_top_p", "1.5"])
    with pytest.raises(ValueError, match=r"SamplingParams.top_p must be a finite number within \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(APIError, match="less than or equal to 1"):
        request(top_p=1.5)


def test_a_typo_of_a_required_flag_names_the_flag_it_meant(capsys):
    from astrai.flags import ArgumentParser

    parser = ArgumentParser(prog="astrai probe")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt")
    group.add_argument("--input_jsonl")
    with pytest.raises(SystemExit):
        parser.parse_args(["--promt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("astrai probe: error: one of the arguments --prompt --input_jsonl/--input-jsonl is required; "
                   "--promt: did you mean --prompt?")
