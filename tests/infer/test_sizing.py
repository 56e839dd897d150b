"""infer/sizing.py: the engine's sizes against hand-computed numbers, and the errors that name the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from astrai.infer.block_manager import BlockManager
from astrai.infer.sampling import SamplingParams
from astrai.infer.sizing import (
    DEFAULT_KV_CACHE_BYTES_CPU,
    check_request,
    decode_view_bytes,
    num_kv_blocks,
    resolve_max_model_len,
    token_budgets,
)

# 2 layers x 2 kv heads x head_dim 8, keys and values: 2 * 2 * 2 * 8 = 64 values a token
CFG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
CPU = torch.device("cpu")


def blocks(**kw) -> int:
    args = dict(block_size=16, max_num_seqs=4, max_model_len=256, kv_cache_tokens=None, kv_cache_memory_gb=None)
    return num_kv_blocks(CFG, torch.float32, CPU, **{**args, **kw})


def test_kv_blocks_from_tokens_bytes_and_the_full_length_cap():
    assert blocks(kv_cache_tokens=100) == 6  # 100 // 16
    # 1 MiB at 64 float32 values (256 bytes) a token: 4096 tokens, 256 blocks
    assert blocks(kv_cache_memory_gb=1 / 1024, max_num_seqs=64) == 256
    # 4 seqs x 256 tokens + one block is all the pool could ever hold: (1024 + 16) // 16
    assert blocks() == 65
    assert DEFAULT_KV_CACHE_BYTES_CPU // 256 > 4 * 256  # the CPU default is not what capped it
    with pytest.raises(ValueError, match="holds 15 tokens, less than one block of 16; raise kv_cache_tokens"):
        blocks(kv_cache_tokens=15)


def test_token_budgets_by_hand():
    def budgets(threshold, batched, chunked=True, measure=lambda: 64, max_model_len=1000):
        return token_budgets(threshold, batched, max_num_seqs=8, max_model_len=max_model_len,
                             enable_chunked_prefill=chunked, measure_chunk=measure)

    def no_probe() -> int:
        raise AssertionError("the step cost was measured, but nothing needed it")

    assert budgets(None, None) == (64, 72)  # the measured chunk, plus a decode for each of 8 seats
    assert budgets(0, None, measure=no_probe) == (0, 2048 + 8)  # no cap: the default chunk part
    assert budgets(500, 100, measure=no_probe) == (100, 100)  # the chunk never exceeds the budget
    # without chunked prefill a whole prompt fits one step: the budget grows to max_model_len
    assert budgets(None, None, chunked=False, measure=no_probe, max_model_len=4000) == (0, 4000)
    assert budgets(None, None, chunked=False, measure=no_probe) == (0, 2048 + 8)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        budgets(-1, None)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        budgets(None, 0, measure=no_probe)  # refused before the (slow) probe runs


def test_max_model_len_and_decode_view():
    assert resolve_max_model_len(CFG, None) == 256
    windowed = SimpleNamespace(max_position_embeddings=256, sliding_window=64)
    assert resolve_max_model_len(windowed, None) == 64
    with pytest.raises(ValueError, match="set max_model_len to at most 64"):
        resolve_max_model_len(windowed, 100)
    assert decode_view_bytes(0.5) == 1 << 29
    with pytest.raises(ValueError, match="decode_view_memory_gb must be >= 0"):
        decode_view_bytes(float("nan"))


def test_check_request_names_the_limit():
    bm = BlockManager(4, block_size=16)  # 64 tokens of KV

    def check(prompt, **params):
        check_request(prompt, SamplingParams(**params), vocab_size=100, max_model_len=128, max_num_seqs=2,
                      block_manager=bm)

    check([1] * 10, max_tokens=54)  # 64 tokens: exactly the pool
    with pytest.raises(ValueError, match="request needs 5 KV blocks"):
        check([1] * 10, max_tokens=55)
    with pytest.raises(ValueError, match="prompt token id 100 is outside the vocabulary"):
        check([100])
    with pytest.raises(ValueError, match="prompt has 128 tokens but max_model_len is 128"):
        check([1] * 128)
    with pytest.raises(ValueError, match="SamplingParams.n is 3 but max_num_seqs is 2"):
        check([1], n=3, max_tokens=1)
