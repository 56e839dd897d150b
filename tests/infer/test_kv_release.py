"""The engine's KV pool can be freed while the engine is idle and made again (`release_kv_cache`,
`reserve_kv_cache`): the tensors are gone (nothing else holds them), a pool made again, of
another size, gives the same tokens and log-probs as a pool that was kept (greedy, seeded
sampling with n > 1, prefix caching on), the prefix cache starts empty, and the CUDA graphs'
static forward (run eagerly on CPU) is rebuilt over the new pool."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from astrai.infer.sizing import batch_kv_tokens, pool_blocks
from tests.infer.conftest import random_prompts, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(model, **kw) -> LLMEngine:
    # a step budget of 24 tokens spreads a batch's prefill over steps: the last prompt is admitted
    # after the one before it has computed the full blocks of their shared prefix
    return LLMEngine(model, None, kv_cache_tokens=1024, block_size=8, max_num_seqs=8, max_num_batched_tokens=24,
                     **kw)


def _batches():
    """Two batches, each of two prompts with one long prefix and a third prompt, with seeded
    samples (n = 3 for one)."""
    batches = []
    for k in range(2):
        shared = random_prompts([20], seed=3 + k)[0]
        tails = random_prompts([3, 9], seed=10 + k)
        prompts = [random_prompts([30], seed=20 + k)[0], shared + tails[0], shared + tails[1]]
        params = [SamplingParams(temperature=0.7, top_k=20, max_tokens=8, seed=11 + k, ignore_eos=True), GREEDY,
                  SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, n=3, seed=7 + k, ignore_eos=True)]
        batches.append((prompts, params))
    return batches


def _flat(outputs):
    return [(c.token_ids, c.logprobs, c.raw_logprobs) for o in outputs for c in o.outputs]


def test_release_frees_the_pool_tensors_and_everything_over_them():
    engine = _engine(tiny_model(seed=1))
    engine.run_batch(random_prompts([9, 14], seed=2), GREEDY)
    refs = [weakref.ref(t) for pair in engine.runner.kv_caches for t in pair]
    assert engine.has_kv_cache and engine.runner.kv_caches[0][0].numel() > 0
    engine.release_kv_cache()
    gc.collect()
    assert not engine.has_kv_cache and engine.runner.kv_caches is None
    assert all(ref() is None for ref in refs), "a KV tensor is still referenced after release_kv_cache"
    assert engine.runner.decode_view.kv == [] and engine.runner.decode_view.mask is None
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks  # nothing is held
    engine.release_kv_cache()  # a second release is a no-op


def test_a_remade_pool_generates_what_a_kept_pool_does():
    model = tiny_model(seed=4)
    (p1, s1), (p2, s2) = _batches()
    kept = _engine(model)
    ref1 = kept.run_batch(p1, s1)
    assert kept.block_manager.num_prefix_hits > 0  # the shared prefix was served from the cache
    ref2 = kept.run_batch(p2, s2)

    remade = _engine(model)
    remade.release_kv_cache()
    seqs = 1 + 3 + 1
    remade.reserve_kv_cache(batch_kv_tokens(seqs, max(map(len, p1)) + 12, 8))
    assert remade.block_manager.num_blocks < kept.block_manager.num_blocks  # a pool of the batch's size
    out1 = remade.run_batch(p1, s1)
    remade.release_kv_cache()
    remade.reserve_kv_cache(batch_kv_tokens(seqs, max(map(len, p2)) + 12, 8))
    out2 = remade.run_batch(p2, s2)
    assert remade.block_manager.num_prefix_hits == 16  # the second batch's shared prefix, 2 full blocks
    assert _flat(out1) == _flat(ref1) and _flat(out2) == _flat(ref2)  # bitwise: same tokens and log-probs


def test_a_request_remakes_a_released_pool_at_its_last_size():
    model = tiny_model(seed=5)
    prompts = random_prompts([7, 12], seed=6)
    ref = _engine(model).run_batch(prompts, GREEDY)
    engine = _engine(model)
    engine.reserve_kv_cache(100)  # 13 blocks of 8
    engine.release_kv_cache()
    out = engine.run_batch(prompts, GREEDY)
    assert engine.has_kv_cache and engine.block_manager.num_blocks == 13
    assert engine.runner.kv_caches[0][0].size(0) == 13
    assert _flat(out) == _flat(ref)
    engine.reserve_kv_cache()  # None: the size the engine started with
    assert engine.block_manager.num_blocks == 1024 // 8 == engine.describe()["kv_cache_tokens"] // 8


def test_the_prefix_cache_starts_empty_and_keeps_the_policy_version():
    engine = _engine(tiny_model(seed=8))
    prompt = random_prompts([33], seed=9)
    engine.run_batch(prompt, GREEDY)
    engine.set_policy_version(3)
    engine.run_batch(prompt, GREEDY)  # cached under version 3
    engine.release_kv_cache()
    engine.reserve_kv_cache(512)
    assert engine.block_manager.policy_version == 3
    engine.run_batch(prompt, GREEDY)
    assert engine.block_manager.num_prefix_hits == 0  # nothing survived the release
    engine.run_batch(prompt, GREEDY)
    assert engine.block_manager.num_prefix_hits == 32  # 4 full blocks, cached again in the new pool


def test_release_and_reserve_refuse_while_requests_are_in_flight():
    engine = _engine(tiny_model(seed=2))
    engine.add_request("a", random_prompts([5], seed=1)[0], GREEDY)
    engine.step()
    for call in (engine.release_kv_cache, lambda: engine.reserve_kv_cache(256)):
        with pytest.raises(RuntimeError, match=r"1 request\(s\) in flight; let them finish or abort them"):
            call()
    engine.abort("a")
    engine.release_kv_cache()
    with pytest.raises(ValueError, match="at least one token slot, got num_tokens=0"):
        engine.reserve_kv_cache(0)


def test_cuda_graphs_static_forward_is_rebuilt_over_the_new_pool():
    model = tiny_model(seed=7)
    prompts = random_prompts([5, 11, 17], seed=8)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 7, 13)]
    ref = _engine(model).run_batch(prompts, params)
    engine = _engine(model)
    old = engine.runner.use_graphs(8, engine.max_model_len, capture=False)
    engine.release_kv_cache()
    assert engine.runner.graphs is None
    engine.reserve_kv_cache(batch_kv_tokens(3, 17 + 20, 8))
    graphs = engine.runner.graphs
    assert graphs is not old and graphs.kv_caches is engine.runner.kv_caches
    assert graphs.scratch_block == engine.block_manager.num_blocks == 15  # the scratch block past the pool
    assert engine.runner.kv_caches[0][0].size(0) == 16
    out = engine.run_batch(prompts, params)
    assert graphs.num_replays > 0
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_pool_sizes_in_whole_blocks_per_sequence():
    assert batch_kv_tokens(3, 17, 16) == 3 * 2 * 16  # 17 tokens take 2 blocks each
    assert batch_kv_tokens(4, 32, 16) == 4 * 32
    assert pool_blocks(100, 8) == 13 and pool_blocks(96, 8) == 12


def test_a_pool_remade_under_inference_mode_serves_a_live_policy():
    """A request under the caller's inference_mode re-makes the pool as plain tensors, so a later
    batch on a module in training mode (run under no_grad) can still write its KV."""
    model = tiny_model(seed=3)
    engine = _engine(model)
    prompts = random_prompts([6, 10], seed=4)
    engine.release_kv_cache()
    with torch.inference_mode():
        first = engine.run_batch(prompts, GREEDY)
    assert not engine.runner.kv_caches[0][0].is_inference()
    model.train()
    try:
        again = engine.run_batch(prompts, GREEDY)
    finally:
        model.eval()
    assert _flat(again) == _flat(first)
