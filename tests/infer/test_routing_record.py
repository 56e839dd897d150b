"""The engine records each token's experts (record_routing): the ones a full forward of the row
chooses, through chunked prefill, forks of n samples, and prefixes served from the cache."""

from __future__ import annotations

import pytest
import torch

from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from tests.infer.conftest import random_prompts, tiny_model

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, num_hidden_layers=3, mlp_only_layers=[1])


def moe_model():
    model = tiny_model(**MOE)
    with torch.no_grad():  # decisive routers: no near-ties that rounding between two forwards could flip
        for layer in (0, 2):
            model.model.layers[layer].mlp.gate.weight.mul_(30)
    return model


@torch.no_grad()
def full_routing(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), return_routing=True).routing[0].to(torch.int16)  # (T, L, k)


def test_completions_carry_the_routing_of_every_computed_token():
    model = moe_model()
    engine = LLMEngine(model, record_routing=True, block_size=4, kv_cache_tokens=256, max_num_batched_tokens=8,
                       long_prefill_token_threshold=0)
    prompts = random_prompts([11, 6])
    params = SamplingParams(temperature=1.0, max_tokens=5, n=2, seed=3, ignore_eos=True)
    first = engine.run_batch(prompts, params)
    rows = []
    for prompt, out in zip(prompts, first):
        for c in out.outputs:
            row = prompt + c.token_ids
            assert c.routing.shape == (len(row) - 1, 2, 2)  # the last sampled token never ran
            assert torch.equal(c.routing, full_routing(model, row[:-1]))
            rows.append(row)
    # a next turn: the row so far (its full blocks served from the prefix cache) and new tokens
    follow = [rows[0] + [5, 6, 7], rows[2] + [8, 9]]
    second = engine.run_batch(follow, SamplingParams(temperature=1.0, max_tokens=3, seed=4, ignore_eos=True))
    for prompt, out in zip(follow, second):
        assert out.num_cached_tokens > 0
        row = prompt + out.outputs[0].token_ids
        assert torch.equal(out.outputs[0].routing, full_routing(model, row[:-1]))


def test_routing_is_recorded_only_when_asked_and_only_for_moe_models():
    out = LLMEngine(moe_model(), kv_cache_tokens=64).run_batch(random_prompts([5]), SamplingParams(max_tokens=2))
    assert out[0].outputs[0].routing is None
    with pytest.raises(ValueError, match="record_routing is for mixture-of-experts models"):
        LLMEngine(tiny_model(), record_routing=True, kv_cache_tokens=64)
