"""The inference engine: paged KV cache, continuous batching, prefix caching and sampling.

Data flow of one step: scheduler.py picks the tokens to run -> runner.py runs the model over
the paged KV cache (block_manager.py) -> sampling.py picks tokens and log-probs -> engine.py
detokenises, applies stops and reports outputs.
"""

from astrai.infer.engine import (
    LLM,
    CompletionOutput,
    EngineConfig,
    EngineStats,
    LLMEngine,
    RequestMetrics,
    RequestOutput,
)
from astrai.infer.sampling import Logprob, SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "Logprob", "RequestMetrics",
    "RequestOutput", "SamplingParams",
]
