"""`astrai generate`: offline generation from the command line.

Loads a model directory into an `LLM` (llm.py, over engine.py's engine) and either completes one
`--prompt`, printing the result, or reads `--input_jsonl` (one record per line with a "prompt"
string or a "messages" conversation) and writes each record back to `--output_jsonl` with the
generated "completion" (and every sample under "outputs"), with a progress bar. `--chat` applies
the model's chat template to plain prompts. The sampling flags are SamplingParams' fields
(sampling_flags.py, shared with `astrai chat`); those left unset take the model's
generation_config.json defaults (`--generation_config`, defaults.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from astrai.flags import ArgumentParser, add_dataclass_arguments
from astrai.infer.config import EngineConfig
from astrai.infer.defaults import describe, generation_defaults
from astrai.infer.llm import LLM
from astrai.infer.sampling import SamplingParams
from astrai.infer.sampling_flags import add_sampling_arguments, sampling_params_from_args
from astrai.model.hf_dir import check_device
from astrai.model.lora import split_adapter
from astrai.model.manifest import VERIFY_HELP, check_model_dir, model_argument, nearest_model_dir


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="astrai generate", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", required=True, help="model or checkpoint directory (config.json, weights, tokenizer), "
                   "or a run's ckpt_dir (its newest complete checkpoint)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt; the completion is printed")
    src.add_argument("--input_jsonl", help="records with a 'prompt' or 'messages' field")
    p.add_argument("--output_jsonl", help="where the records go with their completions (with --input_jsonl)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template as a user turn")
    p.add_argument("--verify", action="store_true", default=None, help=VERIFY_HELP)
    add_sampling_arguments(p)
    add_engine_arguments(p)
    return p


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a flag (shared by `astrai generate` and `astrai chat`)."""
    add_dataclass_arguments(parser.add_argument_group("engine"), EngineConfig)


def check_model_dirs(args: argparse.Namespace) -> None:
    """The model's and the --lora adapter's manifests, checked as --verify / --no-verify say (the
    load that follows keeps that decision); a damaged file is a ValueError naming it."""
    check_model_dir(args.model, verify=args.verify)
    if getattr(args, "lora", None):
        check_model_dir(args.lora, verify=args.verify)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.input_jsonl and not args.output_jsonl:
        print("astrai generate: --input_jsonl needs --output_jsonl", file=sys.stderr)
        return 2
    try:
        # a Hub id -> its cached snapshot directory; a run's ckpt_dir -> its newest checkpoint
        args.model = model_argument(args.model, "astrai generate")
        args.model, args.lora = split_adapter(args.model, args.lora, "astrai generate")  # a LoRA checkpoint
        if not (Path(args.model) / "config.json").is_file():
            raise FileNotFoundError(f"--model '{args.model}' is not a model directory (no config.json)"
                                    f"{nearest_model_dir(args.model)}")
        defaults = generation_defaults(args.model, args.generation_config)
        if defaults:
            print(f"astrai generate: {describe(defaults)}", file=sys.stderr)
        params = sampling_params_from_args(args, defaults)
        check_device(args.device)
        check_model_dirs(args)
        llm = LLM(args.model, **{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
        if args.prompt is not None:
            outs = _generate(llm, [{"prompt": args.prompt}], params, args.chat, use_tqdm=False)
            for c in outs[0].outputs:
                print(c.text)
            return 0
        records = _read_jsonl(Path(args.input_jsonl))
        outs = _generate(llm, records, params, args.chat, use_tqdm=True)
        with open(args.output_jsonl, "w", encoding="utf-8") as f:
            for record, out in zip(records, outs):
                samples = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                            "num_tokens": len(c.token_ids)} for c in out.outputs]
                f.write(json.dumps({**record, "completion": out.outputs[0].text, "outputs": samples},
                                   ensure_ascii=False) + "\n")
    except (ValueError, FileNotFoundError) as exc:
        print(f"astrai generate: {exc}", file=sys.stderr)
        return 2
    return 0


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
            raise ValueError(f"{path}:{lineno}: each line needs a 'prompt' string or a 'messages' list")
        records.append(record)
    return records


def _generate(llm: LLM, records: list[dict], params: SamplingParams, chat: bool, use_tqdm: bool) -> list:
    tok = llm.get_tokenizer()
    prompts: list = []
    for record in records:
        messages = record.get("messages")
        if messages is None and chat:
            messages = [{"role": "user", "content": record["prompt"]}]
        if messages is not None:
            if tok is None:
                raise ValueError("chat prompts need a tokenizer in the model directory")
            prompts.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        else:
            prompts.append(record["prompt"])
    return llm.generate(prompts, params, use_tqdm=use_tqdm)
