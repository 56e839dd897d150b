"""Data layer: tokenizer, preprocessing to token shards, datasets, sampler, synthetic tasks."""

from __future__ import annotations

from astrai.data.datasets import build_dataset
from astrai.data.sampler import ResumableSampler
from astrai.data.tokenizer import Tokenizer, load_tokenizer
from astrai.data.tokenizer_training import train_tokenizer

__all__ = ["ResumableSampler", "Tokenizer", "build_dataset", "load_tokenizer", "train_tokenizer"]
