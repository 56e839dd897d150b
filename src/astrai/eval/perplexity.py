"""Perplexity (`astrai eval --perplexity F`): token-level log-likelihood of a text corpus.

Each document (the whole of a text file, or the `text` of each JSONL record) is tokenised on
its own and scored in lm-eval's rolling windows of the model's length (`scoring.Scorer`, the
code the lm-eval adapter's `loglikelihood_rolling` runs), conditioned on the BOS (else EOS)
token, so the numbers equal lm-eval's for the same text. The report sums over documents:
nats per token, perplexity = exp(nats per token), and bits per byte of UTF-8 text (the measure
that compares models with different tokenizers).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from astrai.eval.exact import read_json_line, text_lines
from astrai.eval.scoring import Scorer, encode_text, prefix_token_id


def read_documents(path: str | Path) -> list[str]:
    """The texts of a .jsonl file (each record's "text") or the whole of any other text file."""
    path = Path(path)
    if path.suffix != ".jsonl":
        # read as read_text does (universal newlines, a BOM kept); a binary file is an error naming its line
        text = "".join(line for _, line in text_lines(path, strip_bom=False)).replace("\r\n", "\n").replace("\r", "\n")
        if not text:
            raise ValueError(f"{path} is empty; give a text file or JSONL with 'text' records")
        return [text]
    docs = []
    for line_no, line in text_lines(path):
        if not line.strip():
            continue
        record = read_json_line(path, line_no, line)
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{line_no}: a perplexity record needs a string 'text', got "
                             f"{sorted(record) if isinstance(record, dict) else type(record).__name__}")
        docs.append(record["text"])
    if not docs:
        raise ValueError(f"{path} holds no 'text' records")
    return docs


def perplexity(scorer: Scorer, tokenizer: Any, documents: list[str]) -> dict[str, Any]:
    """Rolling-window log-likelihood of `documents` summed into one report."""
    token_lists = [encode_text(tokenizer, doc) for doc in documents]
    logprobs = scorer.loglikelihood_rolling(token_lists, prefix_token_id(tokenizer))
    num_tokens = sum(len(t) for t in token_lists)
    num_bytes = sum(len(doc.encode("utf-8")) for doc in documents)
    total = sum(logprobs)
    nats = -total / max(num_tokens, 1)
    return {"nats_per_token": nats, "bits_per_byte": -total / max(num_bytes, 1) / math.log(2),
            "perplexity": math.exp(nats), "num_tokens": num_tokens, "num_bytes": num_bytes,
            "num_documents": len(documents), "loglikelihood": total, "window": scorer.max_length}
