"""The inference engine: paged KV cache, continuous batching, prefix caching and sampling.

Data flow of one step: scheduler.py picks the tokens to run -> runner.py runs the model over
the paged KV cache (block_manager.py) -> sampling.py picks tokens and log-probs -> engine.py
appends them, request.py detokenises and applies stops, and the engine reports outputs
(outputs.py); llm.py's `LLM` is the offline API over it.
"""

from astrai.infer.config import EngineConfig
from astrai.infer.engine import LLMEngine
from astrai.infer.llm import LLM
from astrai.infer.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from astrai.infer.sampling import Logprob, SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "Logprob", "RequestMetrics",
    "RequestOutput", "SamplingParams",
]
