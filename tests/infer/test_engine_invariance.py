"""A request's tokens and log-probs do not depend on how the engine happened to schedule it."""

from __future__ import annotations

import torch

from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from tests.infer.conftest import full_forward_logprobs, random_prompts, tiny_model

SHARED = random_prompts([40], seed=9)[0]
PROMPTS = [SHARED[:37] + [5, 6], SHARED + [7], random_prompts([23], seed=10)[0], SHARED[:20]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=11, ignore_eos=True)


def results(engine: LLMEngine, params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    outs = engine.run_batch(PROMPTS, params)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def same(a, b) -> bool:
    return all(ta == tb and torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-5)
               for (ta, la), (tb, lb) in zip(a, b))


def test_alone_batched_chunked_cached_and_preempted_runs_agree(model):
    for params in (GREEDY, SEEDED):
        alone = []
        for prompt in PROMPTS:
            engine = LLMEngine(model, None, kv_cache_tokens=1024, enable_prefix_caching=False)
            out = engine.run_batch([prompt], params)[0].outputs[0]
            alone.append((out.token_ids, out.logprobs))
        batched = LLMEngine(model, None, kv_cache_tokens=1024, block_size=8)
        assert same(results(batched, params), alone)
        assert same(results(batched, params), alone)  # second run: prefix-cache hits
        assert batched.stats().prefix_cache_hit_rate > 0.3
        chunked = LLMEngine(model, None, kv_cache_tokens=1024, block_size=4, max_num_batched_tokens=7)
        assert same(results(chunked, params), alone)
        tight = LLMEngine(model, None, kv_cache_tokens=80, block_size=4)  # forces preemption
        assert same(results(tight, params), alone)
        assert tight.stats().num_preemptions > 0


def test_policy_version_bump_never_reuses_stale_kv():
    model = tiny_model(seed=1)
    engine = LLMEngine(model, None, kv_cache_tokens=1024, block_size=8)
    engine.run_batch(PROMPTS, GREEDY)  # fills the prefix cache with KV of the old weights
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    engine.set_policy_version(1)
    outs = engine.run_batch(PROMPTS, GREEDY)
    fresh = LLMEngine(model, None, kv_cache_tokens=1024, enable_prefix_caching=False).run_batch(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fresh]
    assert all(o.num_cached_tokens == 0 and o.policy_version == 1 for o in outs)


def test_version_bump_mid_generation_recomputes_running_sequences():
    model = tiny_model(seed=2)
    engine = LLMEngine(model, None, kv_cache_tokens=1024, block_size=8)
    engine.add_request("a", PROMPTS[1], GREEDY)
    for _ in range(5):
        engine.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    engine.set_policy_version(3)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    tokens = out.outputs[0].token_ids
    # the tokens after the bump are exactly what the new weights give for that context
    new_logprobs = full_forward_logprobs(model, PROMPTS[1], tokens)[5:]
    assert torch.allclose(torch.tensor(out.outputs[0].logprobs[5:]), new_logprobs, atol=1e-5)


def test_n_samples_share_the_prompt_and_copy_on_write_keeps_them_apart(model):
    engine = LLMEngine(model, None, kv_cache_tokens=1024, block_size=8)
    prompt = PROMPTS[0]  # 39 tokens: the last block is partial and shared by the samples
    params = SamplingParams(temperature=1.0, n=4, max_tokens=16, seed=3, ignore_eos=True)
    out = engine.run_batch([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:  # each sample's log-probs are those of its own full sequence
        want = full_forward_logprobs(model, prompt, c.token_ids)
        assert torch.allclose(torch.tensor(c.raw_logprobs), want, atol=1e-5)
    one = engine.run_batch([prompt], SamplingParams(temperature=1.0, max_tokens=16, seed=3, ignore_eos=True))[0]
    assert one.outputs[0].token_ids == out.outputs[0].token_ids  # sample 0 draws from the seed itself
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_seeded_sampling_is_reproducible_across_engines(model):
    a = LLMEngine(model, None, kv_cache_tokens=1024).run_batch(PROMPTS, SEEDED)
    b = LLMEngine(model, None, kv_cache_tokens=1024, block_size=4).run_batch(PROMPTS[::-1], SEEDED)[::-1]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
