"""A request's tokens and log-probs do not depend on how the engine happened to schedule it."""

from __future__ import annotations

import pytest
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


def _engine_pair(model, **config):
    """The same engine with and without the kept dense decode copy of the KV."""
    return LLMEngine(model, None, **config), LLMEngine(model, None, decode_view_memory_gb=0, **config)


def test_decode_view_gives_the_results_of_gathering_every_step(model):
    # steady decode, chunked prefill mixed with decodes, and preemption, each checked against
    # an engine that gathers the context from the paged cache in every step
    configs = [dict(kv_cache_tokens=1024, block_size=8), dict(kv_cache_tokens=1024, block_size=4, max_num_batched_tokens=7),
               dict(kv_cache_tokens=80, block_size=4)]
    long_greedy = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    for config in configs:
        for params in (GREEDY, SEEDED, long_greedy):
            kept, gathered = _engine_pair(model, **config)
            if config["kv_cache_tokens"] == 80 and params is long_greedy:
                continue  # 150 new tokens do not fit the tight pool
            assert same(results(kept, params), results(gathered, params))
            assert kept.runner.decode_view.num_rebuilds > 0 and gathered.runner.decode_view is None


def test_decode_view_is_reused_between_steps_and_rebuilt_when_needed(model):
    engine = LLMEngine(model, None, kv_cache_tokens=2048, block_size=8)
    view = engine.runner.decode_view
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    outs = engine.run_batch(PROMPTS, params)
    # prompts finish prefill in one step and grow together: one build, and one per finished row set
    assert view.num_rebuilds <= 3
    view.slack = 8  # capacity: 8 to 15 tokens past the longest context, so rebuilds come often
    before = view.num_rebuilds
    again = engine.run_batch(PROMPTS, params)
    assert view.num_rebuilds - before >= 100 // 16
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    small = LLMEngine(model, None, kv_cache_tokens=2048, block_size=8, decode_view_memory_gb=1e-6)
    assert [o.outputs[0].token_ids for o in small.run_batch(PROMPTS, params)] == [o.outputs[0].token_ids for o in outs]
    assert small.runner.decode_view.kv == []  # over budget: every step gathered instead


def test_decode_view_gathers_no_room_past_what_the_sequences_can_reach(model):
    # 6 new tokens at most: a rebuild copies each row up to the longest prompt + 6 (a block's
    # rounding), not `slack` (128) spare tokens it can never fill
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kept, gathered = _engine_pair(model, kv_cache_tokens=2048, block_size=8)
    for i, prompt in enumerate(PROMPTS):
        kept.add_request(str(i), prompt, params)
    widths = set()
    while kept.has_unfinished_requests():
        kept.step()
        widths |= {k.size(2) for k, _ in kept.runner.decode_view.kv}  # (Sd, Hkv, capacity, D)
    reach = max(len(p) for p in PROMPTS) + 6
    assert widths == {-(-reach // 8) * 8}
    assert same(results(kept, params), results(gathered, params))


def test_decode_view_follows_aborts_and_train_eval_switches_mid_generation():
    model = tiny_model(seed=4)
    kept, gathered = _engine_pair(model, kv_cache_tokens=1024, block_size=8)
    finals = []
    for engine in (kept, gathered):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        done = {}
        for step in range(60):
            if step == 8:
                engine.abort("1")  # a row leaves the decode batch
            if step in (12, 20):
                model.train(step == 12)  # no_grad for a module in training mode, inference_mode in eval
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        finals.append({k: (v.token_ids, v.logprobs) for k, v in done.items()})
    assert sorted(finals[0]) == ["0", "2", "3"]
    assert finals[0].keys() == finals[1].keys()
    assert same([finals[0][k] for k in "023"], [finals[1][k] for k in "023"])
    assert kept.stats().num_free_blocks == kept.stats().num_total_blocks


def test_decode_view_memory_is_released_when_nothing_runs(model):
    engine = LLMEngine(model, None, kv_cache_tokens=1024)
    engine.run_batch(PROMPTS, GREEDY)
    assert engine.runner.decode_view.kv == [] and engine.runner.decode_view.num_rebuilds > 0
    engine.add_request("r", PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.runner.decode_view.kv != []
    engine.abort("r")  # the last running request: a server would not step again
    assert engine.runner.decode_view.kv == []
    with pytest.raises(ValueError, match="decode_view_memory_gb must be >= 0"):
        LLMEngine(model, None, kv_cache_tokens=1024, decode_view_memory_gb=-1)
