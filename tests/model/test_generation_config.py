"""generation_config.json of a saved model: every end-of-turn id, so transformers' `generate`
stops a chat reply where astrai does, and the source model's sampling defaults carried over."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.data.tokenizer import IM_END
from astrai.data.tokenizer_training import train_tokenizer
from astrai.model.config import ModelConfig
from astrai.model.hf import load_model, save_model
from astrai.model.hf_dir import load_generation_defaults
from astrai.model.transformer import CausalLM

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world 12 + 7 = 19"] * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, vocab_size=300, out_dir=None)


def always_says(token_id: int, tok) -> CausalLM:
    """A model whose next token is `token_id` after any input: the layers write nothing to the
    residual stream, every embedding is the same vector, and only one lm_head row sees it."""
    config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = CausalLM(config, seed=0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id] = 1.0
    return model


def test_eos_list_names_the_end_of_turn_token(tok, tmp_path):
    im_end = tok.convert_tokens_to_ids([IM_END])[0]
    assert im_end != tok.eos_token_id
    save_model(always_says(im_end, tok), tmp_path, tokenizer=tok)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_token_id, im_end]
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == tok.eos_token_id


def test_transformers_generate_stops_at_the_end_of_turn(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    im_end = tok.convert_tokens_to_ids([IM_END])[0]
    save_model(always_says(im_end, tok), tmp_path, tokenizer=tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, prompt.shape[1]:].tolist()
    assert new == [im_end]  # without im_end in the eos list, generate runs on for all 8 tokens


def test_sampling_defaults_travel_from_source_to_saves(tok, tmp_path):
    source, fine_tuned = tmp_path / "source", tmp_path / "fine_tuned"
    save_model(always_says(0, tok), source, tokenizer=tok)
    recommended = {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
    generation = json.loads((source / "generation_config.json").read_text())
    (source / "generation_config.json").write_text(json.dumps({**generation, **recommended,
                                                                "transformers_version": "4.0"}))
    model = load_model(source)
    assert model.generation_defaults == recommended
    save_model(model, fine_tuned, tokenizer=tok)  # as a training checkpoint would
    written = json.loads((fine_tuned / "generation_config.json").read_text())
    assert {k: written[k] for k in recommended} == recommended and "transformers_version" not in written
    assert load_generation_defaults(fine_tuned) == recommended
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GenerationConfig.from_pretrained(str(fine_tuned))
    assert (hf_config.temperature, hf_config.top_p, hf_config.top_k) == (0.2, 0.9, 50)


def test_a_model_built_here_writes_no_sampling_defaults(tok, tmp_path):
    save_model(always_says(0, tok), tmp_path, tokenizer=tok)
    assert load_generation_defaults(tmp_path) == {}
