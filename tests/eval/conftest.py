"""Fixtures for evaluation tests: a tiny random model directory with a trained tokenizer, and
local lm-eval task YAMLs over JSONL files (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

WORDS = "the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun".split()
TEXTS = [f"Question: {a}+{b}=\nAnswer: {a + b}" for a in range(12) for b in range(8)] + [" ".join(WORDS)] * 20

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
"""
ROLLING_YAML = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def mc_records(num: int) -> list[dict]:
    rows = []
    for i in range(num):
        a, b = i % 10, (3 * i) % 7
        choices = [str(a + b), str(a + b + 1), str(a * b + 2), str(abs(a - b) + 3)]
        rows.append({"question": f"{a}+{b}=", "choices": choices, "label": i % 4, "answer": str(a + b)})
    return rows


def long_text(n_words: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n_words,), generator=gen))


def write_tasks(folder: Path, num: int = 8) -> Path:
    """Three local lm-eval tasks (multiple choice, rolling log-likelihood, generate_until)."""
    folder.mkdir(parents=True, exist_ok=True)
    mc = folder / "mc.jsonl"
    mc.write_text("".join(json.dumps(r) + "\n" for r in mc_records(num)))
    docs = folder / "docs.jsonl"  # one short, one a few windows long (the model takes 64 tokens)
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in [long_text(12, 0), long_text(150, 1)]))
    (folder / "mc.yaml").write_text(MC_YAML.format(data=mc))
    (folder / "rolling.yaml").write_text(ROLLING_YAML.format(data=docs))
    (folder / "gen.yaml").write_text(GEN_YAML.format(data=mc))
    return folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from astrai.data.tokenizer_training import train_tokenizer
    from astrai.model import CausalLM, ModelConfig
    from astrai.model.hf import save_model

    out = tmp_path_factory.mktemp("eval_model")
    tok = train_tokenizer(TEXTS, 320)
    config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = CausalLM(config, seed=0)
    with torch.no_grad():  # sharper logits than a fresh init: greedy choices are not near-ties
        model.model.norm.weight.mul_(8.0)
    save_model(model, out, tokenizer=tok)
    return out


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("eval_tasks"))


@pytest.fixture(scope="session")
def astrai_lm(model_dir):
    from astrai.eval.harness import AstraiLM

    return AstraiLM(pretrained=str(model_dir), batch_size=16)


@pytest.fixture(scope="session")
def hf_lm(model_dir):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=1)
