"""Sampling flags are SamplingParams' fields (issue 26 item 5): `astrai generate` and `astrai chat`
take the same ones, each field's value reaches SamplingParams, unset ones take the model's
defaults, and a field without a command-line spelling is refused loudly."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from astrai.flags import ArgumentParser
from astrai.infer import chat, generate
from astrai.infer.sampling import SamplingParams
from astrai.infer.sampling_flags import FLAG_FIELDS, add_sampling_arguments, sampling_params_from_args

# a value other than the default for every field that is a flag
VALUES = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "frequency_penalty": 0.5,
          "presence_penalty": 0.25, "repetition_penalty": 1.1, "max_tokens": 7, "min_tokens": 2,
          "stop": ["a", "b"], "stop_token_ids": [3, 4], "ignore_eos": True, "seed": 3, "n": 2, "logprobs": 1,
          "prompt_logprobs": 1, "logit_bias": {5: 1.5}}
PARSERS = {"generate": (generate.build_parser, ["--model", "m", "--prompt", "x"]),
           "chat": (chat.build_parser, ["--model", "m"])}


def _argv(values: dict) -> list[str]:
    argv: list[str] = []
    for name, value in values.items():
        flag = f"--{name.replace('_', '-')}"  # the kebab spelling, to check it is there too
        if value is True:
            argv.append(flag)
        elif name == "stop":
            for s in value:
                argv += [flag, s]
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def test_flag_fields_are_the_dataclass_fields_but_the_compiled_guide():
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert list(FLAG_FIELDS) == [n for n in names if n != "guide"]
    assert set(VALUES) == set(FLAG_FIELDS), "give the new SamplingParams field a test value in VALUES"


def test_generate_and_chat_accept_the_same_sampling_flags():
    expected = set()
    for f in dataclasses.fields(SamplingParams):
        if f.metadata.get("flag", True):
            expected |= {f"--{f.name}", f"--{f.name.replace('_', '-')}"}
    gen, chat_opts = (_options(build()) for build, _ in PARSERS.values())
    assert expected <= gen and expected <= chat_opts
    sampling = {o for o in gen | chat_opts if o.lstrip("-").replace("-", "_") in FLAG_FIELDS}
    assert {o for o in gen if o in sampling} == {o for o in chat_opts if o in sampling}
    assert "--guide" not in gen | chat_opts and {"--no-ignore-eos", "--generation_config"} <= gen & chat_opts


@pytest.mark.parametrize("command", PARSERS)
def test_every_sampling_flag_reaches_sampling_params(command):
    build, base = PARSERS[command]
    args = build().parse_args(base + _argv(VALUES))
    params = sampling_params_from_args(args, {"temperature": 0.0, "top_k": 40})  # the flags win
    got = {name: getattr(params, name) for name in VALUES}
    assert got == VALUES


@pytest.mark.parametrize(("command", "max_tokens"), [("generate", 16), ("chat", 512)])
def test_unset_flags_take_the_models_defaults_then_sampling_params(command, max_tokens):
    build, base = PARSERS[command]
    params = sampling_params_from_args(build().parse_args(base), {"temperature": 0.3, "top_k": 20})
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 20, max_tokens)
    defaults = SamplingParams()
    rest = [n for n in FLAG_FIELDS if n not in ("temperature", "top_k", "max_tokens")]
    assert {n: getattr(params, n) for n in rest} == {n: getattr(defaults, n) for n in rest}
    args = build().parse_args(base + ["--temperature", "1.5", "--top-k", "0"])
    params = sampling_params_from_args(args, {"temperature": 0.3, "top_k": 20})
    assert (params.temperature, params.top_k) == (1.5, 0)


def test_a_bad_flag_value_is_a_usage_error_or_names_the_field(capsys):
    build, base = PARSERS["chat"]
    with pytest.raises(SystemExit):
        build().parse_args(base + ["--logit_bias", "[1, 2]"])
    assert "expected a JSON object" in capsys.readouterr().err
    with pytest.raises(ValueError, match="SamplingParams.n"):
        sampling_params_from_args(build().parse_args(base + ["--n", "0"]), {})
    # None in the namespace means "unset" (the model's default, then SamplingParams'), so no sampling
    # flag takes none, and an int field refuses "1.0" (the type decides, not the text)
    for argv, message in [(["--max_tokens", "none"], "value 'none' is not int; expected int (e.g. --max_tokens 1)"),
                          (["--seed", "1.0"], "value '1.0' is not int; expected int (e.g. --seed 1)")]:
        with pytest.raises(SystemExit):
            build().parse_args(base + argv)
        assert message in capsys.readouterr().err


def test_defaults_must_name_sampling_flags():
    with pytest.raises(ValueError, match="not SamplingParams flags"):
        add_sampling_arguments(ArgumentParser(), {"max_token": 5})
