"""Tokenizer training: a byte-level BPE with ChatML special tokens, and `astrai tokenizer train`.

The start of a model from scratch: text and JSONL records (every string they hold) train the
vocabulary, and the result is tokenizer.py's `Tokenizer` with the ChatML template, saved as a
model directory's `tokenizer.json` + `tokenizer_config.json`. The pre-tokenizer splits digits
one by one (arithmetic stays learnable for tiny models); `chat_roles` adds the role names as
words. When the corpus cannot fill the vocabulary asked for, a warning says why and what would.
`astrai demo` and the tests call `train_tokenizer`; cli.py dispatches `astrai tokenizer` to `main`.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from astrai.data.tokenizer import CHATML_TEMPLATE, ENDOFTEXT, IM_END, IM_START, SPECIAL_TOKENS, Tokenizer
from astrai.flags import ArgumentParser

# Qwen2-style split: single digits (arithmetic stays learnable for tiny models), words with an
# optional leading symbol, punctuation runs, newlines, and other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The role names every chat record renders (`<|im_start|>assistant\n`), trained as words with
# `chat_roles` (`astrai demo`'s recipe): a corpus of digits and symbols has no words, so each role
# would cost a token per letter; with them the demo's record `3+4` -> `7` is 15 tokens, not 25.
CHAT_ROLE_TEXT = "user assistant system"
# Corpora up to this size are also cut into pre-tokenizer pieces to explain a vocabulary shortfall
_DIAGNOSE_CHARS = 10_000_000


def _record_texts(record: Any) -> Iterator[str]:
    # Every string a JSONL record holds (text, message contents, instruction fields, DPO pairs).
    if isinstance(record, str):
        yield record
    elif isinstance(record, dict):
        for value in record.values():
            yield from _record_texts(value)
    elif isinstance(record, list):
        for value in record:
            yield from _record_texts(value)


def _is_file(item: str | Path) -> bool:
    if isinstance(item, Path):
        return item.is_file()
    if "\n" in item or len(item) > 4096:
        return False
    try:
        return Path(item).is_file()
    except OSError:  # e.g. a long line of text is "a file name too long"
        return False


def _iter_training_texts(files_or_texts: Iterable[str | Path]) -> Iterator[str]:
    for item in files_or_texts:
        if _is_file(item):
            path = Path(item)
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if path.suffix == ".jsonl" and line.strip():
                        yield from _record_texts(json.loads(line))
                    else:
                        yield line
        elif isinstance(item, Path):
            raise FileNotFoundError(f"tokenizer training input '{item}' does not exist")
        else:
            yield str(item)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_tokenizer(files_or_texts: Iterable[str | Path], vocab_size: int, out_dir: str | Path | None = None,
                    min_frequency: int = 2, chat_roles: bool = False) -> Tokenizer:
    """Train a byte-level BPE with ChatML special tokens; save it to `out_dir` when given.

    `files_or_texts` mixes paths (Path objects or strings naming existing files; .jsonl files
    contribute every string in their records, other files their lines) and raw texts.
    `chat_roles` adds the chat roles' names (CHAT_ROLE_TEXT) as texts, often enough to be merged
    into one or two tokens each whatever the corpus (`astrai demo` and `--chat_roles` do).
    """
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens plus "
                         f"{len(SPECIAL_TOKENS)} special tokens; use --vocab_size {min_vocab} or more")
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = _pre_tokenizer()
    pieces_of = _pre_tokenizer().pre_tokenize_str  # its own: the backend is locked while it trains
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[AddedToken(t, special=True, normalized=False)
                                                  for t in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus: dict[str, Any] = {"texts": 0, "chars": 0, "pieces": set()}
    extra = [CHAT_ROLE_TEXT] * max(5, min_frequency) if chat_roles else []

    def counted() -> Iterator[str]:
        for text in itertools.chain(_iter_training_texts(files_or_texts), extra):
            corpus["texts"] += 1
            corpus["chars"] += len(text)
            if corpus["chars"] <= _DIAGNOSE_CHARS:  # the distinct pieces BPE may merge inside
                corpus["pieces"].update(p for p, _ in pieces_of(text) if len(p) > 1)
            yield text

    backend.train_from_iterator(counted(), trainer=trainer)
    trained = backend.get_vocab_size()
    if trained < vocab_size:
        _warn_shortfall(backend, corpus, vocab_size, trained - min_vocab, min_frequency, chat_roles)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False, "add_eos_token": False,
    }
    config = {k: v for k, v in config.items() if v is not None}
    tok = Tokenizer(backend, config, chat_template=CHATML_TEMPLATE)
    if out_dir is not None:
        tok.save(out_dir)
    return tok


def _warn_shortfall(backend: BackendTokenizer, corpus: dict[str, Any], vocab_size: int, num_merges: int,
                    min_frequency: int, chat_roles: bool) -> None:
    """Say why the vocabulary is smaller than asked, and what would make it larger.

    BPE merges only inside the pieces the pre-tokenizer cuts (words, single digits, punctuation
    runs). When every piece of the corpus is already one token, neither more of the same text nor
    a lower min_frequency adds a merge; otherwise a pair fell short of min_frequency."""
    size = f"the corpus of {corpus['texts']:,} texts, {corpus['chars']:,} characters"
    head = f"warning: the trained vocabulary has {backend.get_vocab_size()} tokens, not the {vocab_size} asked: "
    vocab = backend.get_vocab()
    if corpus["chars"] <= _DIAGNOSE_CHARS and all(p in vocab for p in corpus["pieces"]):
        roles = "" if chat_roles else " (--chat_roles adds the chat roles' names)"
        print(f"{head}after {num_merges} merges every piece the pre-tokenizer cut from {size} is one token "
              f"({len(corpus['pieces'])} distinct pieces longer than a byte; digits are split one by one, words "
              "from punctuation) and BPE merges only inside a piece, so neither more of the same text nor a lower "
              f"--min_frequency adds a token; train on text with other words{roles} or ask for --vocab_size "
              f"{backend.get_vocab_size()}", file=sys.stderr)
        return
    print(f"{head}after {num_merges} merges no pair of tokens occurs {min_frequency} or more times "
          f"(min_frequency) in {size}; train on more text or lower --min_frequency for a larger vocabulary",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """`astrai tokenizer train --input FILE... --vocab_size N --out DIR`."""
    parser = ArgumentParser(prog="astrai tokenizer", description="train a byte-level BPE tokenizer")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE with ChatML special tokens")
    train.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    train.add_argument("--vocab_size", type=int, required=True)
    train.add_argument("--out", required=True, help="output directory")
    train.add_argument("--min_frequency", type=int, default=2)
    train.add_argument("--chat_roles", action="store_true",
                       help=f"also train the chat roles' names ({CHAT_ROLE_TEXT}) as words, as `astrai demo` does: "
                            "a token or two each even when the corpus has no words")
    args = parser.parse_args(argv)
    missing = [f for f in args.input if not Path(f).is_file()]
    if missing:
        print(f"error: --input file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        tok = train_tokenizer([Path(f) for f in args.input], args.vocab_size, args.out, args.min_frequency,
                              chat_roles=args.chat_roles)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    asked = "" if tok.vocab_size == args.vocab_size else f" (asked {args.vocab_size}; see the warning above)"
    print(f"wrote {args.out}: vocab_size={tok.vocab_size}{asked}, special tokens {SPECIAL_TOKENS}")
    return 0
