"""`astrai convert --gguf FILE --out DIR`: a GGUF checkpoint -> an astrai (Hugging Face) model directory.

The weights are dequantised through transformers + gguf (both optional; a clear error names
what to install), mapped onto `ModelConfig` / `CausalLM` by hf_config.py's `config_from_hf` and
hf.py's `build_model`, and written back with `save_model`, next to the tokenizer files (the chat
template kept in tokenizer_config.json). It sits beside hf.py, at the border of the model layer,
and is used by `make real-model`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from astrai.flags import ArgumentParser
from astrai.model.config import ModelConfig
from astrai.model.hf import save_model
from astrai.model.hf_config import config_from_hf
from astrai.model.hf_dir import GENERATION_SAMPLING_KEYS, build_model, resolve_dtype, write_generation_config


def convert_gguf(gguf_file: str | Path, out: str | Path, dtype: str = "float32",
                 generation_defaults: dict[str, Any] | None = None) -> Path:
    """Dequantise a GGUF checkpoint through transformers + gguf into an astrai model directory.
    `generation_defaults` (e.g. the model card's recommended temperature and top_p, which GGUF
    files rarely carry) go into generation_config.json, where generate/chat/serve apply them."""
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"--gguf {gguf_file}: no such file")
    missing = [name for name in ("transformers", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"converting GGUF needs the packages {missing}; install them with "
            f"`pip install {' '.join(missing)}`"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    torch_dtype = resolve_dtype(dtype, ModelConfig())
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch_dtype
    )
    hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # a GGUF-loaded model refuses save_pretrained, so take its config and (dequantised) weights
    raw = hf_model.config.to_diff_dict()
    raw.pop("quantization_config", None)
    model = build_model(config_from_hf(raw), hf_model.state_dict(), torch_dtype, where=str(gguf_file))
    model.generation_defaults = dict(generation_defaults or {})
    save_model(model, out)
    _save_hf_tokenizer(hf_tokenizer, out)
    from astrai.data.tokenizer import load_tokenizer

    # again, now that the tokenizer (and its chat template's end-of-turn token) is on disk
    write_generation_config(model, out, load_tokenizer(out))
    return out


def parse_generation_defaults(items: list[str]) -> dict[str, Any]:
    """`["temperature=0.2", "top_p=0.9"]` -> {"temperature": 0.2, "top_p": 0.9} (HF's names)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in GENERATION_SAMPLING_KEYS:
            raise ValueError(f"--generation {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(GENERATION_SAMPLING_KEYS)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"--generation {item!r}: {value!r} is not a number or true/false") from None
    return out


def _save_hf_tokenizer(hf_tokenizer: Any, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json, with the chat template inside the latter."""
    hf_tokenizer.save_pretrained(str(out))
    config_file = out / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if getattr(hf_tokenizer, "chat_template", None) and "chat_template" not in tok_config:
        tok_config["chat_template"] = hf_tokenizer.chat_template
    config_file.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    """`astrai convert --gguf FILE --out DIR [--dtype float32]`."""
    parser = ArgumentParser(prog="astrai convert", description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, help="GGUF checkpoint to dequantise")
    parser.add_argument("--out", required=True, help="model directory to write")
    parser.add_argument("--dtype", default="float32", help="dtype of the written weights")
    parser.add_argument("--generation", nargs="+", default=[], metavar="KEY=VALUE",
                        help="sampling defaults for generation_config.json, e.g. temperature=0.2 top_p=0.9")
    args = parser.parse_args(argv)
    try:
        out = convert_gguf(args.gguf, args.out, args.dtype, parse_generation_defaults(args.generation))
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"astrai convert: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
