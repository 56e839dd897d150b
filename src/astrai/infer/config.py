"""`EngineConfig`: every knob of the inference engine, one dataclass field each.

The engine's settings apart from the engine (vLLM keeps its config the same way): `LLMEngine`,
`LLM` and the `generate`, `chat` and `serve` CLIs take these fields as keyword arguments or flags,
and `make_engine_config` is the one place that merges such keywords into a config and refuses a
name that is not a field. sizing.py, precision.py and runner.py receive the values they need as
arguments and import nothing from here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_tokens: int | None = None  # size of the KV pool in tokens ...
    kv_cache_memory_gb: float | None = None  # ... or in GiB; neither: a default budget
    max_model_len: int | None = None  # None = the model's max_position_embeddings (at most its sliding_window)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # token budget of one step; None: one chunk + a decode per seat
    long_prefill_token_threshold: int | None = None  # prefill tokens in a step that decodes; None: probed, 0: no cap
    max_request_kv_share: float = 0.5  # of the KV pool, what one request may hold while others wait; 1.0: no cap
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    decode_view_memory_gb: float = 1.0  # dense copy of decoding sequences' KV kept across steps; 0 = off
    engine_seed: int = 0  # generator of unseeded sampling (SamplingParams.seed is per request)
    device: str | None = None  # from_pretrained: where to load (None: cuda if available); else the model's
    dtype: str | None = None  # from_pretrained only: weights dtype (None = float32, "auto" = the checkpoint's)
    lora: str | None = None  # from_pretrained only: a PEFT adapter directory, merged into the weights at load
    num_threads: int | None = None  # from_pretrained on CPU: torch threads; None: probed (default vs 1)
    linear_layout: str | None = None  # from_pretrained: "out_in" | "in_out" weight storage; None: probed
    compile: bool = False  # decode steps' MLPs under torch.compile, per batch-size bucket (warm-up at start)
    cpu_matmul: str = "auto"  # auto | onednn | blas: float32 CPU matrix products (model/matmul.py; process-wide)
    autocast_dtype: str | None = None  # "bfloat16": forward passes under torch.autocast (a bf16 trainer's precision)
    kv_cache_dtype: str | None = None  # KV pool dtype; None: the autocast dtype if set, else the weights'
    cuda_graphs: bool = False  # CUDA only: decode steps replay graphs per batch bucket (runner.py); an error on CPU
    paged_kernel: str = "gather"  # "varlen", CUDA only: decode reads KV blocks in place (torch whose varlen_attn takes a block table)
    record_routing: bool = False  # MoE: each completion reports the experts every token was routed to (RL routing replay)


def make_engine_config(config: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    """`config` (None: the defaults) with `overrides` (field name -> value) applied; a name that
    is not an EngineConfig field is an error listing the fields."""
    names = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown engine config field {unknown[0]!r}; expected one of {sorted(names)}")
    config = config or EngineConfig()
    return EngineConfig(**{**config.__dict__, **overrides}) if overrides else config
