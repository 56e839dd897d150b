"""CUDA graphs for decode (`EngineConfig.cuda_graphs`): on CPU the graphs' static forward runs
eagerly (`capture=False`), which checks the bucketing, the padding rows and their scratch block,
and the one-buffer input layout against the ordinary eager engine; the capture itself is
`cuda`-marked."""

from __future__ import annotations

import pytest
import torch

from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from tests.infer.conftest import random_prompts, tiny_model

PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 7, 13)]


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, None, kv_cache_tokens=512, block_size=8, max_num_seqs=4, **kw)


def test_static_decode_forward_gives_eager_tokens_and_logprobs():
    model = tiny_model(seed=7)
    prompts = random_prompts([5, 11, 17], seed=8)  # 3 rows (bucket 4), then 2, then 1 as they finish
    ref = _engine(model).run_batch(prompts, PARAMS)
    engine = _engine(model)
    graphs = engine.runner.use_graphs(4, engine.max_model_len, capture=False)
    scratch = engine.runner.kv_caches[0][0][graphs.scratch_block]
    out = engine.run_batch(prompts, PARAMS)
    assert graphs.num_replays > 0 and {b for b, _ in graphs.graphs} == {1, 2, 4}
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    for a, b in zip(out, ref):
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-5)
    assert scratch[0].abs().sum() > 0  # padding rows wrote there, and only there
    assert engine.block_manager.num_blocks == graphs.scratch_block  # the manager never hands it out


def test_steps_outside_the_buckets_run_eagerly():
    model = tiny_model(seed=9)
    prompts = random_prompts([6, 9], seed=10)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _engine(model).run_batch(prompts, params)
    engine = _engine(model)
    graphs = engine.runner.use_graphs(4, engine.max_model_len, capture=False)
    graphs.width_buckets = [1, 2]  # contexts past 16 tokens fall outside: eager
    out = engine.run_batch(prompts, params)
    assert graphs.num_replays > 0 and graphs.num_eager > 0
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_bf16_weights_and_kv_through_the_static_forward():
    model = tiny_model(seed=11).to(torch.bfloat16)
    prompts = random_prompts([7, 12], seed=12)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = _engine(model).run_batch(prompts, params)
    engine = _engine(model)
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    graphs = engine.runner.use_graphs(4, engine.max_model_len, capture=False)
    out = engine.run_batch(prompts, params)
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16 and graphs.num_replays > 0
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


def test_cuda_graphs_flag_is_an_error_on_cpu():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device but the model is on cpu"):
        _engine(tiny_model(), cuda_graphs=True)


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_captured_graphs_give_eager_tokens_on_cuda(autocast):
    model = tiny_model(seed=13).cuda()
    prompts = random_prompts([5, 11, 17], seed=14)
    ref = _engine(model, autocast_dtype=autocast).run_batch(prompts, PARAMS)
    engine = _engine(model, cuda_graphs=True, autocast_dtype=autocast)
    out = engine.run_batch(prompts, PARAMS)
    assert engine.runner.graphs.num_replays > 0 and engine.runner.graphs.graphs
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    again = engine.run_batch(prompts, PARAMS)  # replays of graphs captured in the first batch
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
