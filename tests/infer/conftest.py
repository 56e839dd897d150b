"""Fixtures for inference tests: a tiny astrai model, a tiny tokenizer, reference decoding."""

from __future__ import annotations

import pytest
import torch

from astrai.model import CausalLM, ModelConfig

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_model(seed: int = 0, **overrides) -> CausalLM:
    return CausalLM(ModelConfig(**{**TINY, **overrides}), seed=seed).eval()


def random_prompts(lengths: list[int], vocab_size: int = 128, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def greedy_full_recompute(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference decoding: re-run the whole sequence every step, take the argmax."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def full_forward_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of one full forward, at each generated token (float32)."""
    ids = torch.tensor([prompt + output])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (T, V)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(output)[:, None])[:, 0]


@pytest.fixture(scope="session")
def model():
    return tiny_model()


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from astrai.data.tokenizer_training import train_tokenizer

    out = tmp_path_factory.mktemp("infer_tok")
    texts = ["The quick brown fox jumps over the lazy dog. Héllo wörld, ünïcode ☃ 日本語!",
             "Hello world! How are you today? I am fine, thanks. 1 + 2 = 3"] * 30
    train_tokenizer(texts, 300, out)
    return out


@pytest.fixture(scope="session")
def tok(tok_dir):
    from astrai.data.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)
