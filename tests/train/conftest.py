"""Fixtures of the training tests: the tiny tokenizer that every run directory of tests/train
names (`tests/train/resume_data.py`), made once per test module."""

from __future__ import annotations

import pytest

from tests.train.resume_data import write_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))
