"""Constrained decoding in the engine: guided rows follow their grammar, unguided rows in the
same batch are untouched, and every sample of an n > 1 request has its own matcher."""

from __future__ import annotations

import json

import pytest

from astrai.data.tokenizer_training import train_tokenizer
from astrai.infer.engine import LLMEngine
from astrai.infer.guided import GuideCompiler, GuideError
from astrai.infer.sampling import SamplingParams
from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "maxLength": 5}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    tok = train_tokenizer(["the quick brown fox", '{"ok": true, "n": 2}', "hello world"] * 10, vocab_size=300,
                          out_dir=None)
    config = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id)
    return LLMEngine(CausalLM(config, seed=0), tok, max_model_len=512, kv_cache_tokens=8192)


def test_guided_rows_match_the_schema_and_plain_rows_are_untouched(engine):
    tok = engine.tokenizer
    guide = GuideCompiler(tok, engine.vocab_size).json_schema(SCHEMA)
    prompt = tok.encode("hello world")
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = engine.run_batch([prompt], plain)[0].outputs[0].token_ids
    guided = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=100, guide=guide)
    mixed = engine.run_batch([prompt, prompt], [guided, plain])
    assert mixed[1].outputs[0].token_ids == alone
    for out in mixed[0].outputs:
        assert out.finish_reason == "stop"
        value = json.loads(out.text)
        assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and len(value["tag"]) <= 5


def test_unsupported_schema_keyword_is_named(engine):
    with pytest.raises(GuideError, match="uniqueItems"):
        GuideCompiler(engine.tokenizer, engine.vocab_size).json_schema({"type": "array", "uniqueItems": True})
