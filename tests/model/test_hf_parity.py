"""Parity with transformers: HF-saved tiny models load with equal logits, and astrai-saved
models load in transformers with equal logits, for every supported family."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.model.hf import load_model, save_model
from tests.model.hf_util import MODEL_TYPES, max_diff_on_real_tokens, padded_batch, tiny_hf_model

pytest.importorskip("transformers")
TOL = 1e-4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_transformers_saved_model_loads_with_equal_logits(model_type, tmp_path):
    hf = tiny_hf_model(model_type)
    hf.save_pretrained(tmp_path)
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        model = load_model(tmp_path).eval()
        got = model(ids, attention_mask=mask).logits
    assert model.config.model_type == model_type
    assert got.shape == expected.shape
    assert max_diff_on_real_tokens(got, expected, mask) < TOL


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_saved_model_loads_in_transformers_with_equal_logits(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_hf_model(model_type, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf").eval()
    save_model(model, tmp_path / "astrai")
    assert json.loads((tmp_path / "astrai" / "config.json").read_text())["model_type"] == model_type
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "astrai", dtype=torch.float32).eval()
    ids, mask = padded_batch(hf.config.vocab_size, seed=4)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        got = reloaded(input_ids=ids, attention_mask=mask).logits
        original = hf(input_ids=ids, attention_mask=mask).logits
    assert max_diff_on_real_tokens(got, expected, mask) < TOL
    assert max_diff_on_real_tokens(got, original, mask) < TOL


def test_bfloat16_load_runs(tmp_path):
    tiny_hf_model("qwen3").save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="bfloat16")
    ids, mask = padded_batch(model.config.vocab_size)
    logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_mistral_with_a_short_window_matches_transformers_inside_it(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_hf_model("mistral", sliding_window=8)
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf").eval()
    assert model.config.sliding_window == 8
    ids = torch.randint(3, hf.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(ids).logits - hf(input_ids=ids).logits).abs().max() < TOL
        with pytest.raises(ValueError, match="sliding_window is 8"):
            model(torch.cat([ids, ids], dim=1))  # past the window transformers masks, astrai refuses
    save_model(model, tmp_path / "astrai")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "astrai", dtype=torch.float32).eval()
    assert reloaded.config.sliding_window == 8
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - hf(input_ids=ids).logits).abs().max() < TOL
