"""Fixtures for data tests: one tiny tokenizer trained once per session."""

from __future__ import annotations

import pytest

from astrai.data.tasks import corpus_records, generate_items
from astrai.data.tokenizer import load_tokenizer
from astrai.data.tokenizer_training import train_tokenizer

_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thanks.",
    "system user assistant tool call result answer question",
] * 20


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    items = generate_items(300, ["add", "sub", "mul", "reverse"], digits=2, seed=0)
    texts = _TEXTS + [r["text"] for r in corpus_records(items)]
    train_tokenizer(texts, 400, out)
    return out


@pytest.fixture(scope="session")
def tok(tok_dir):
    return load_tokenizer(tok_dir)
