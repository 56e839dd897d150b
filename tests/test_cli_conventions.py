"""Command-line conventions: kebab-case flags, `--no-X` booleans, `astrai train --help` listing the
config fields, a misspelled YAML section or flag suggesting the right one, output into a closed pipe
ending quietly."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
import typing

import pytest

from astrai import config as run_config
from astrai.cli import COMMANDS
from astrai.cli import main as astrai_main
from astrai.config import ConfigError, build_config, parse_overrides
from astrai.config_values import type_name
from astrai.flags import ArgumentParser


def help_of(*words: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        astrai_main([*words, "--help"])
    return out.getvalue()


def sub_commands(command: str) -> list[str]:
    m = re.search(r"\{([\w,]+)\} \.\.\.", help_of(command).split("\n\n")[0])
    return m.group(1).split(",") if m else []


def every_parser() -> list[tuple[str, ...]]:
    found = []
    for command in COMMANDS:
        subs = sub_commands(command)
        found += [(command, sub) for sub in subs] if subs else [(command,)]
    return found


@pytest.mark.parametrize("words", every_parser(), ids=" ".join)
def test_every_snake_case_flag_also_has_its_kebab_spelling(words: tuple[str, ...]) -> None:
    text = help_of(*words)
    assert "usage:" in text, f"astrai {' '.join(words)} --help printed no usage"
    flags = set(re.findall(r"(?<![\w-])--([a-z][\w-]*)", text))
    if words == ("train",):  # its own options; config fields are parse_overrides' (tested below)
        options = text.split("\noptions:")[1].split("config fields")[0]
        flags = set(re.findall(r"(?<![\w-])--([a-z][\w-]*)", options))
        assert {"dry_run", "dry-run", "no-dry-run"} <= flags
    missing = sorted(f for f in flags if "_" in f and f.replace("_", "-") not in flags)
    assert not missing, f"astrai {' '.join(words)}: flags without a kebab-case spelling: {missing}"


def test_kebab_case_and_no_booleans_parse_in_generate() -> None:
    from astrai.infer.generate import build_parser

    p = build_parser()
    args = p.parse_args(["--model", "m", "--prompt", "x", "--max-model-len", "64", "--no-enable-prefix-caching",
                         "--enable-chunked-prefill", "false", "--ignore-eos", "--max-tokens", "3"])
    assert (args.max_model_len, args.enable_prefix_caching, args.enable_chunked_prefill) == (64, False, False)
    assert (args.ignore_eos, args.max_tokens) == (True, 3)
    # the snake_case forms the docs use keep working, and a bare boolean setting means true
    args = p.parse_args(["--model", "m", "--prompt", "x", "--max_model_len", "32", "--enable_prefix_caching", "false",
                         "--enable_chunked_prefill", "--no_ignore_eos"])
    assert (args.max_model_len, args.enable_prefix_caching, args.enable_chunked_prefill, args.ignore_eos) == (
        32, False, True, False)
    assert p.parse_args(["--model", "m", "--prompt", "x"]).enable_prefix_caching is True


@pytest.mark.parametrize("argv, message", [
    (["--no-enable-prefix-caching", "false"], "takes no value"),
    (["--enable-prefix-caching", "maybe"], "expected true or false, got 'maybe'"),
])
def test_bad_boolean_flags_are_usage_errors(argv: list[str], message: str, capsys) -> None:
    from astrai.infer.generate import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--model", "m", "--prompt", "x", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_flags_take_both_spellings_and_no_booleans() -> None:
    from astrai.serve.cli import build_parser

    args = build_parser().parse_args(["--model", "m", "--api-key", "k", "--max-num-seqs", "3",
                                      "--no-enable-prefix-caching", "--served-model-name", "tiny"])
    assert (args.api_key, args.max_num_seqs, args.enable_prefix_caching, args.served_model_name) == (
        "k", 3, False, "tiny")
    args = build_parser().parse_args(["--model", "m", "--enable_prefix_caching", "true"])
    assert args.enable_prefix_caching is True
    assert not hasattr(build_parser().parse_args(["--model", "m"]), "enable_prefix_caching")  # unset: engine's


def test_a_switch_never_swallows_the_positional_after_it() -> None:
    p = ArgumentParser(prog="probe")
    p.add_argument("dir")
    p.add_argument("--verify", action="store_true")
    assert vars(p.parse_args(["--verify", "out/ckpt"])) == {"dir": "out/ckpt", "verify": True}
    assert vars(p.parse_args(["--no-verify", "out/ckpt"])) == {"dir": "out/ckpt", "verify": False}


def test_train_overrides_take_kebab_case_and_no_booleans() -> None:
    got = parse_overrides(["--max-lr", "3e-4", "--no-pack", "--group-by-length", "--no_bf16", "--optim.weight-decay=0.1"])
    assert got == {"max_lr": 3e-4, "pack": False, "group_by_length": True, "bf16": False, "weight_decay": 0.1}
    assert parse_overrides(["--pack", "false", "--bf16=true"]) == {"pack": False, "bf16": True}


@pytest.mark.parametrize("argv, message", [
    (["--no-max-lr"], "flag --no-max-lr sets 'max_lr' false, but 'max_lr' is float | None, not a boolean; "
                      "give --max_lr VALUE"),
    (["--no-pack=true"], "flag --no-pack=true takes no value; use --pack true instead"),
    (["--max-lrr", "1"], "unknown flag --max_lrr; did you mean 'max_lr'?"),
])
def test_bad_train_overrides_name_the_flag_and_the_fix(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_overrides(argv)
    assert str(e.value) == message


@pytest.mark.parametrize("yaml_data, message", [
    ({"optimiser": {"max_lr": 1e-3}}, "unknown config section 'optimiser'; did you mean 'optim'?"),
    ({"trian": {"n_epoch": 1}}, "unknown config section 'trian'; did you mean 'train'?"),
    ({"hyper": {"max_lr": 1e-3, "weight_decay": 0.1}},
     "unknown config section 'hyper'; did you mean 'optim' (the section of max_lr, weight_decay)?"),
    ({"rope_scalin": {"rope_type": "linear"}}, "unknown config section or key 'rope_scalin'; did you mean "
                                               "'rope_scaling'?"),
    ({"max_lrr": 1e-3}, "unknown config section or key 'max_lrr'; did you mean 'max_lr'?"),
])
def test_a_misspelled_section_suggests_the_section(yaml_data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_config(yaml_data, {})
    assert str(e.value).startswith(message), str(e.value)


def test_unknown_section_lists_the_sections() -> None:
    with pytest.raises(ConfigError) as e:
        build_config({"zzz": {"qqq": 1}}, {})
    assert str(e.value) == ("unknown config section 'zzz' (sections: model, data, train, optim, objective, rl, "
                            "lora, ckpt, log, dist)")


def test_train_help_lists_every_config_field_by_section_with_type_and_default() -> None:
    from astrai.model.config import ModelConfig

    text = help_of("train").split("config fields by YAML section")[1]
    blocks = {}  # section -> its lines
    for block in text.split("\n\n")[1:]:
        head, *lines = block.strip("\n").splitlines()
        blocks[head.split(":")[0]] = lines
    sections = {"model": ModelConfig, **run_config.SECTIONS}
    assert list(blocks) == list(sections)
    for section, cls in sections.items():
        hints = typing.get_type_hints(cls)
        rows = {line.split()[0]: line for line in blocks[section]}
        names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        assert list(rows) == names, f"section {section}: help lists {list(rows)}"
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            cells = re.split(r"\s{2,}", rows[f.name].strip())
            assert cells[1] == type_name(hints[f.name]), rows[f.name]
            assert run_config.yaml.safe_load(cells[2]) == default, rows[f.name]
    assert "restore the full training state" in " ".join(blocks["train"])  # the field's comment is its meaning


@pytest.mark.parametrize("args", [["--help"], ["eval", "--model", "MODEL", "--data", "DATA"]])
def test_output_into_a_closed_pipe_ends_quietly(args, addition_model_dir, addition_task_dir):
    args = [str(addition_model_dir) if a == "MODEL" else str(addition_task_dir / "data" / "eval.jsonl") if a == "DATA" else a
            for a in args]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte: `| head` that already quit
    try:
        done = subprocess.run([sys.executable, "-m", "astrai", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 141 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


@pytest.mark.parametrize("module, argv, nearest", [
    ("astrai.infer.generate", ["--model", "m", "--prompt", "hi", "--max_tokns", "5"], "--max_tokens"),
    ("astrai.serve.cli", ["--model", "m", "--prot", "8000"], "--port"),
])
def test_serve_and_generate_suggest_the_nearest_flag(module, argv, nearest, capsys):
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).build_parser().parse_args(argv)
    assert f"did you mean {nearest}?" in capsys.readouterr().err
