"""Compiled decode (`EngineConfig.compile`): bucketed torch.compile graphs give eager's tokens."""

from __future__ import annotations

import pytest

from astrai.infer.compiled import decode_buckets
from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from tests.infer.conftest import random_prompts, tiny_model


def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert decode_buckets(1) == [1]
    assert decode_buckets(5) == [1, 2, 4, 8]
    assert decode_buckets(8) == [1, 2, 4, 8]


@pytest.mark.slow
def test_compiled_decode_gives_eager_greedy_tokens():
    model = tiny_model(seed=5)
    prompts = random_prompts([9, 30], seed=6)  # 2 sequences, then 1 when the shorter finishes: buckets 2, 1
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 10)]
    eager = LLMEngine(model, None, kv_cache_tokens=512, max_num_seqs=2).run_batch(prompts, params)
    engine = LLMEngine(model, None, kv_cache_tokens=512, max_num_seqs=2, compile=True)
    compiled = engine.runner.compiled
    info = engine.describe()["probes"]["compile"]
    assert info["buckets"] == [1, 2] and info["warmup_seconds"] > 0
    outs = engine.run_batch(prompts, params)
    assert compiled.num_calls > 0  # decode steps ran the compiled graphs
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    for a, b in zip(outs, eager):
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-4)
    compiled.remove()
    assert "forward" not in model.model.layers[0].mlp.__dict__
