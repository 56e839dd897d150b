"""Scheduling budgets chosen from the measured step cost, load-time probes, and describe()."""

from __future__ import annotations

import pytest
import torch

from astrai.infer.engine import LLMEngine
from astrai.infer.probe import CHUNK_MAX, CHUNK_MIN, measure_step_cost, set_linear_layout
from astrai.infer.sampling import SamplingParams
from astrai.model.hf import save_model
from tests.infer.conftest import random_prompts, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_unset_budgets_come_from_the_measured_step_cost(model):
    engine = LLMEngine(model, None, kv_cache_tokens=1024, max_num_seqs=8)
    info = engine.describe()
    cost = info["probes"]["step_cost"]
    chunk = info["long_prefill_token_threshold"]
    assert chunk == cost["chunk"] and CHUNK_MIN <= chunk <= CHUNK_MAX and chunk & (chunk - 1) == 0
    assert info["max_num_batched_tokens"] == chunk + 8  # one chunk plus a decode per seat
    assert cost["forward_ms"][1] > 0 and chunk in cost["forward_ms"]
    assert measure_step_cost(model) is measure_step_cost(model)  # measured once per model


def test_given_budgets_are_kept_and_checked(model):
    engine = LLMEngine(model, None, kv_cache_tokens=1024, max_num_batched_tokens=100, long_prefill_token_threshold=0)
    assert (engine.scheduler.max_num_batched_tokens, engine.scheduler.long_prefill_token_threshold) == (100, 0)
    assert "step_cost" not in engine.probes
    engine = LLMEngine(model, None, kv_cache_tokens=1024, max_num_batched_tokens=32, long_prefill_token_threshold=64)
    assert engine.scheduler.long_prefill_token_threshold == 32  # never above the step budget
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        LLMEngine(model, None, kv_cache_tokens=1024, long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        LLMEngine(model, None, kv_cache_tokens=1024, max_num_batched_tokens=0)


def test_a_small_prefill_chunk_gives_the_same_tokens(model):
    prompts = random_prompts([40, 3, 25, 60, 7], seed=3)
    base = LLMEngine(model, None, kv_cache_tokens=2048, long_prefill_token_threshold=0).run_batch(prompts, GREEDY)
    small = LLMEngine(model, None, kv_cache_tokens=2048, max_num_batched_tokens=12, long_prefill_token_threshold=5)
    outs = small.run_batch(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    for a, b in zip(outs, base):
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-4)


def test_transposed_linear_storage_keeps_outputs_and_parameters():
    model = tiny_model(seed=2, tie_word_embeddings=True)
    ids = torch.tensor([random_prompts([9], seed=1)[0]])
    with torch.inference_mode():
        ref = model(ids).logits
        params = list(model.parameters())
        set_linear_layout([m for m in model.modules() if isinstance(m, torch.nn.Linear)], transposed=True)
        assert not model.lm_head.weight.is_contiguous() and model.lm_head.weight is model.model.embed_tokens.weight
        assert list(model.parameters()) == params  # the same parameters, only stored differently
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_from_pretrained_probes_threads_and_layout_and_reports_them(tmp_path):
    save_model(tiny_model(seed=1), tmp_path)
    threads = torch.get_num_threads()
    try:
        engine = LLMEngine.from_pretrained(tmp_path, kv_cache_tokens=1024, device="cpu")
        probes = engine.describe()["probes"]
        assert probes["threads"]["threads"] in (1, threads)
        assert probes["threads"]["threads"] == torch.get_num_threads()
        assert probes["linear_layout"]["linear_layout"] in ("out_in", "in_out")
        fixed = LLMEngine.from_pretrained(tmp_path, kv_cache_tokens=1024, device="cpu", num_threads=1,
                                          linear_layout="in_out", long_prefill_token_threshold=16)
        assert torch.get_num_threads() == 1 and "threads" not in fixed.probes and "step_cost" not in fixed.probes
        assert not fixed.model.model.layers[0].mlp.up_proj.weight.is_contiguous()
        prompts = random_prompts([30, 5], seed=4)
        a, b = engine.run_batch(prompts, GREEDY), fixed.run_batch(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        with pytest.raises(ValueError, match="linear_layout must be"):
            LLMEngine.from_pretrained(tmp_path, kv_cache_tokens=1024, device="cpu", linear_layout="rows")
    finally:
        torch.set_num_threads(threads)


def test_probes_stay_within_a_sliding_window(tmp_path):
    """A model that refuses rows longer than its window is probed on rows that fit (not 16-2048)."""
    windowed = tiny_model(seed=2, sliding_window=8)
    cost = measure_step_cost(windowed, max_tokens=64)
    assert max(cost.forward_ms) <= 8 and cost.chunk == CHUNK_MIN  # no row past the window was run
    save_model(windowed, tmp_path)
    threads = torch.get_num_threads()
    try:
        engine = LLMEngine.from_pretrained(tmp_path, kv_cache_tokens=256, device="cpu")
        assert engine.max_model_len == 8 and "linear_layout" in engine.probes
        out = engine.run_batch(random_prompts([5]), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        torch.set_num_threads(threads)
