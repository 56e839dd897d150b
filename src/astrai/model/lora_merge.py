"""`astrai lora merge`: fold a PEFT adapter into its base and write a plain model directory.

The command-line end of LoRA: `astrai.load_model(adapter_dir)` (in `hf.py`) loads base +
adapter merged; this writes that model out with the tokenizer files, so it opens anywhere a
normal Hugging Face model directory does. A reward model's adapter (PEFT's SEQ_CLS, a LoRA
`train_type: reward` checkpoint) merges into a sequence-classification directory the same way.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from astrai.flags import ArgumentParser
from astrai.model.classifier import load_classifier
from astrai.model.hf import load_model, save_model
from astrai.model.hf_dir import resolve_dtype
from astrai.model.lora import load_adapter, merge_lora, read_adapter_config, resolve_base

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The tokenizer of a model directory, copied as files (the model layer reads no tokenizer)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def main(argv: list[str] | None = None) -> int:
    """`astrai lora merge --adapter DIR [--base DIR] --out DIR`: a plain HF model directory."""
    parser = ArgumentParser(prog="astrai lora", description="LoRA adapter tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="fold an adapter into its base and write a plain model directory")
    merge.add_argument("--adapter", required=True, help="PEFT adapter directory (e.g. a LoRA run's checkpoint)")
    merge.add_argument("--base", default=None, help="base model directory (default: the adapter's "
                                                     "base_model_name_or_path)")
    merge.add_argument("--out", required=True, help="where the merged model directory goes")
    merge.add_argument("--dtype", default="auto", help="weights dtype (default: the base's)")
    args = parser.parse_args(argv)
    try:
        base = resolve_base(args.adapter, args.base)
        if read_adapter_config(args.adapter).get("task_type") == "SEQ_CLS":  # a reward model
            model = load_classifier(base)
            load_adapter(model, args.adapter)
            merge_lora(model).to(resolve_dtype(args.dtype, model.config))
        else:
            model = load_model(base, dtype=args.dtype, lora=args.adapter)
        save_model(model, args.out)
        copy_tokenizer_files(Path(args.adapter) if (Path(args.adapter) / "tokenizer.json").is_file() else base,
                             Path(args.out))
    except (ValueError, FileNotFoundError) as e:
        print(f"astrai lora merge: {e}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {base}: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
