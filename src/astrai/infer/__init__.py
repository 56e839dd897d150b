"""The inference engine: paged KV cache, continuous batching, prefix caching and sampling.

Data flow of one step: scheduler.py picks the tokens to run -> runner.py runs the model over
the paged KV cache (block_manager.py) -> sampling.py picks tokens and log-probs -> engine.py
detokenises, applies stops and reports outputs; llm.py's `LLM` is the offline API over it.
"""

from astrai.infer.engine import (
    CompletionOutput,
    EngineConfig,
    EngineStats,
    LLMEngine,
    RequestMetrics,
    RequestOutput,
)
from astrai.infer.llm import LLM
from astrai.infer.sampling import Logprob, SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "Logprob", "RequestMetrics",
    "RequestOutput", "SamplingParams",
]
