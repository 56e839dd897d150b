"""An engine's limits: how large they are (longest sequence, KV pool, step budgets), and whether
a request fits them.

The sizes are computed once by `LLMEngine.__init__` (engine.py), before the block manager, the
scheduler and the runner are built from what these return; `check_request` is what
`LLMEngine.add_request` checks a request against before it queues it. Each function takes the
`EngineConfig` fields it reads as arguments (this module sits below engine.py and imports none
of it) and the model's config for the rest. An unset size gets its default here:
`max_model_len` from the model's positions and sliding window, the KV pool from free CUDA
memory or a CPU cap, and the prefill chunk from the model's measured step cost (the timing
itself is probe.py's; the engine passes it in, run in its inference mode). A pool made again
for one batch (`LLMEngine.reserve_kv_cache`) is sized by `batch_kv_tokens`. A size or a request
that cannot work is an error naming the limit and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from astrai.infer.block_manager import BlockManager, kv_bytes_per_token
from astrai.infer.sampling import SamplingParams

DEFAULT_KV_CACHE_BYTES_CPU = 1 << 30  # without a size, a CPU engine caps its KV pool here
DEFAULT_GPU_MEMORY_FRACTION = 0.5  # ... and a CUDA engine takes this share of free memory
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # budget's chunk part when long_prefill_token_threshold is 0


def resolve_max_model_len(model_cfg: Any, max_model_len: int | None) -> int:
    """The longest sequence: the given one, else the model's max_position_embeddings; at most the
    sliding window, since full attention equals the window only up to its length."""
    longest = max_model_len or model_cfg.max_position_embeddings
    window = getattr(model_cfg, "sliding_window", None)
    if window is not None:
        if max_model_len is not None and max_model_len > window:
            raise ValueError(f"max_model_len is {max_model_len} but the model's sliding_window is "
                             f"{window}; set max_model_len to at most {window}")
        longest = min(longest, window)
    return longest


def num_kv_blocks(model_cfg: Any, dtype: torch.dtype, device: torch.device, *, block_size: int,
                  max_num_seqs: int, max_model_len: int, kv_cache_tokens: int | None,
                  kv_cache_memory_gb: float | None) -> int:
    """Blocks of the KV pool: kv_cache_tokens, else a byte budget (kv_cache_memory_gb, a share of
    free CUDA memory, or the CPU cap) at the model's bytes per token, never more than every
    sequence at full length could use."""
    per_token = kv_bytes_per_token(model_cfg.num_hidden_layers, model_cfg.num_key_value_heads,
                                   model_cfg.head_dim, dtype)
    if kv_cache_tokens is not None:
        tokens = kv_cache_tokens
    else:
        if kv_cache_memory_gb is not None:
            budget = int(kv_cache_memory_gb * (1 << 30))
        elif device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(device)[0] * DEFAULT_GPU_MEMORY_FRACTION)
        else:
            budget = DEFAULT_KV_CACHE_BYTES_CPU
        # more than every sequence at full length could ever use is wasted memory
        tokens = min(budget // per_token, max_num_seqs * max_model_len + block_size)
    num_blocks = tokens // block_size
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache holds {tokens} tokens, less than one block of {block_size}; "
            f"raise kv_cache_tokens or kv_cache_memory_gb"
        )
    return num_blocks


def pool_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks of a pool made for `num_tokens` token slots (LLMEngine.reserve_kv_cache): rounded up."""
    if num_tokens < 1:
        raise ValueError(f"a KV pool needs at least one token slot, got num_tokens={num_tokens}; "
                         f"give the tokens the next batch needs (batch_kv_tokens)")
    return -(-num_tokens // block_size)


def batch_kv_tokens(num_seqs: int, longest: int, block_size: int) -> int:
    """Token slots that hold `num_seqs` sequences of up to `longest` tokens at once, in whole
    blocks per sequence (a sequence's last block is its own however little of it is filled):
    what a batch needs so that none of it is ever preempted."""
    return num_seqs * -(-longest // block_size) * block_size


def token_budgets(long_prefill_token_threshold: int | None, max_num_batched_tokens: int | None, *,
                  max_num_seqs: int, max_model_len: int, enable_chunked_prefill: bool,
                  measure_chunk: Callable[[], int]) -> tuple[int, int]:
    """(long_prefill_token_threshold, max_num_batched_tokens), the unset ones from the model's
    measured step cost (`measure_chunk()`, called only when the threshold is unset and prefill
    is chunked): one prefill chunk per decoding step, and a budget of that chunk plus a decode
    for every seat. Without chunked prefill, whole prompts (and recomputes) must fit one step."""
    threshold = long_prefill_token_threshold
    if threshold is not None and threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no cap), got {threshold}")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    if threshold is None and enable_chunked_prefill:
        threshold = measure_chunk()
    threshold = threshold or 0
    batched = max_num_batched_tokens
    if batched is None:
        batched = (threshold or DEFAULT_MAX_NUM_BATCHED_TOKENS) + max_num_seqs
    if threshold > batched:
        threshold = batched
    if not enable_chunked_prefill:
        batched = max(batched, max_model_len)
    return threshold, batched


def decode_view_bytes(decode_view_memory_gb: float) -> int:
    """Bytes of the dense decode copy of the KV (runner.py's DecodeKVView); 0 turns it off."""
    if not decode_view_memory_gb >= 0:
        raise ValueError(f"decode_view_memory_gb must be >= 0 (0 disables the decode copy), "
                         f"got {decode_view_memory_gb!r}")
    return int(decode_view_memory_gb * (1 << 30))


def check_request(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                  max_num_seqs: int, block_manager: BlockManager) -> None:
    """A request's prompt and sampling params against the engine's limits: token ids in the
    vocabulary, room for one output token, its n samples within max_num_seqs, and its longest
    possible sequence within the KV pool. An error names the limit and the fix."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens but max_model_len is {max_model_len}; shorten it to at most "
            f"{max_model_len - 1} tokens or raise max_model_len"
        )
    params.check_vocab(vocab_size)
    if params.n > max_num_seqs:
        raise ValueError(
            f"SamplingParams.n is {params.n} but max_num_seqs is {max_num_seqs}; "
            f"lower n or raise max_num_seqs"
        )
    longest = min(n + (params.max_tokens or max_model_len), max_model_len)
    need = block_manager.num_blocks_for(longest)
    if need > block_manager.num_blocks:
        raise ValueError(
            f"request needs {need} KV blocks ({longest} tokens) but the pool has "
            f"{block_manager.num_blocks}; lower max_tokens or raise kv_cache_tokens"
        )
