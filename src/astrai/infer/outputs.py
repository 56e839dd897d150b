"""What the engine reports: request and completion outputs, metrics, and log-prob entries.

`RequestOutput` and `CompletionOutput` carry vLLM's names (DESIGN.md 3.3). A generated token's
log-prob is a float, or, when top alternatives are asked for, a vLLM-style
`{token_id: Logprob}` dict built by `logprob_entry`: the token itself first, then the k most
likely alternatives with their ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from astrai.infer.sampling import Logprob, SamplerOutput


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | list[dict[int, Logprob]] | None
    raw_logprobs: list[float] | list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # None while running, then "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None
    # EngineConfig.record_routing: (prompt + output tokens - 1, MoE layers, k) int16, the experts of
    # every token the engine computed (the last sampled token never runs through the model)
    routing: Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    policy_version: int = 0
    metrics: RequestMetrics | None = None
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob}
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class TopLogprobs:
    """Builds vLLM-style {token_id: Logprob} dicts from the sampler's top-k tensors."""

    def __init__(self, sampled: SamplerOutput, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.ids, self.lps, self.ranks = sampled.top_ids.tolist(), sampled.top_logprobs.tolist(), sampled.ranks.tolist()
        self.raw = (sampled.raw_top_ids.tolist(), sampled.raw_top_logprobs.tolist(), sampled.raw_ranks.tolist())
        self.token_ids = sampled.token_ids

    def entry(self, row: int, k: int, chosen_lp: float, raw: bool) -> dict[int, Logprob]:
        ids, lps, ranks = self.raw if raw else (self.ids, self.lps, self.ranks)
        return logprob_entry(self.tokenizer, self.token_ids[row], chosen_lp, ranks[row], ids[row], lps[row], k)


def logprob_entry(tokenizer: Any | None, token: int, logprob: float, rank: int, top_ids: list[int],
                  top_logprobs: list[float], k: int) -> dict[int, Logprob]:
    """{token_id: Logprob}: the token itself, then the k most likely alternatives (ranks 1..k)."""
    out = {token: Logprob(logprob, rank, token_text(tokenizer, token))}
    for j in range(k):
        out.setdefault(top_ids[j], Logprob(top_logprobs[j], j + 1, token_text(tokenizer, top_ids[j])))
    return out


def token_text(tokenizer: Any | None, token: int) -> str | None:
    """One token's text for a Logprob entry (special tokens included); None without a tokenizer."""
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else None
