"""SmolLM2-135M-Instruct (converted by `make real-model` into .cache/smollm2): astrai's logits
against transformers' on the same directory. Skips when the folder has not been made."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from astrai.model.hf import load_model

MODEL_DIR = Path(__file__).resolve().parents[2] / ".cache" / "smollm2"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(),
                       reason=f"{MODEL_DIR} not found; run `make real-model` to create it"),
]


def test_logits_match_transformers_on_real_model():
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
        expected = hf(input_ids=ids, attention_mask=mask).logits
        del hf
        model = load_model(MODEL_DIR).eval()
        got = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    scale = expected[keep].abs().max().item()
    assert (got[keep] - expected[keep]).abs().max().item() < 1e-4 * max(scale, 1.0)
    assert torch.equal(got[keep].argmax(-1), expected[keep].argmax(-1))


def test_converted_tokenizer_matches_transformers_chat_ids():
    from transformers import AutoTokenizer

    from astrai.data.tokenizer import load_tokenizer

    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    expected = AutoTokenizer.from_pretrained(MODEL_DIR).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    tok = load_tokenizer(MODEL_DIR)
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == list(expected)
    assert tok.eos_token_id == 2 and tok.decode([2], skip_special_tokens=False) == "<|im_end|>"


def test_operations_md_example_answers_with_the_model_card_sampling(capsys):
    """docs/operations.md's example, as written: the converted model's generation_config.json
    carries the recommended temperature/top_p, which `astrai generate` applies."""
    from astrai.infer.generate import main

    assert main(["--model", str(MODEL_DIR), "--chat", "--prompt", "What is the capital of France?",
                 "--max_tokens", "32", "--seed", "0"]) == 0
    captured = capsys.readouterr()
    assert "temperature=0.2" in captured.err and "Paris" in captured.out
