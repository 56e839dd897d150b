"""The `astrai` command: a thin dispatcher to each layer's own `main(argv)`.

Each sub-command lives next to the code it drives (the trainer's flags beside the trainer,
the server's beside the server) and is imported only when used, so `astrai serve` never
imports the trainer and `astrai --help` is instant. Output piped into a reader that stops early
(`astrai eval ... | head`) ends the command quietly, for every command, here.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module

from astrai.config_values import did_you_mean

COMMANDS = {
    "train": ("astrai.train.cli", "train a model from a YAML config and --flag overrides"),
    "serve": ("astrai.serve.cli", "OpenAI-compatible HTTP server"),
    "generate": ("astrai.infer.generate", "generate text from a prompt or a JSONL file"),
    "chat": ("astrai.infer.chat", "talk to a model in the terminal (history, streaming, /reset)"),
    "preprocess": ("astrai.data.preprocess", "tokenise JSONL into memory-mapped shards"),
    "tokenizer": ("astrai.data.tokenizer_training", "train a byte-level BPE tokenizer"),
    "ckpt": ("astrai.train.ckpt_cli", "list, verify or pick the latest checkpoint"),
    "convert": ("astrai.model.gguf", "convert a GGUF checkpoint into a model directory"),
    "lora": ("astrai.model.lora_merge", "merge a LoRA adapter into its base model (a plain model directory)"),
    "eval": ("astrai.eval.cli", "evaluate: exact match, lm-eval tasks, perplexity"),
    "plot": ("astrai.train.plot", "plot training curves from metrics.jsonl"),
    "report": ("astrai.train.report_page", "one self-contained HTML page of a run: curves, samples, config, checkpoints"),
    "traces": ("astrai.train.traces_cli", "print a run's rollout traces: samples, rewards, advantages"),
    "demo": ("astrai.demo", "the quickstart: tokenizer -> pre-train -> SFT -> online RL -> evaluate"),
    "bench": ("astrai.bench", "run the benchmarks against peer frameworks"),
}


def usage() -> str:
    lines = ["usage: astrai <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `astrai <command> --help` for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        code = dispatch(argv)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, rather than at exit
        return code
    except BrokenPipeError:
        # Python's recipe (docs of `signal`, "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's final flush cannot raise again, then exit as a SIGPIPE'd command does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def dispatch(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from astrai import __version__

        print(f"astrai {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"astrai: unknown command '{name}'{did_you_mean(name, list(COMMANDS))}\n\n{usage()}", file=sys.stderr)
        return 2
    module = import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
