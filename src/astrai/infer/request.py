"""A request inside the engine: its sequences, the rules that stop them, and what it reports.

engine.py makes one `Request` per `add_request` (its n sequences join as the prompt's prefill
finishes) and, in the postprocess part of each step, calls `check_stop` for every sampled token:
a stop token or eos (after `min_tokens`), a stop string in the incrementally detokenised text
(detokenize.py), `max_tokens`, or the engine's `max_model_len` end a sequence. `output` turns the
request's state into the `RequestOutput` (outputs.py) the engine hands back. The engine owns the
scheduling of the sequences; this module only reads and finishes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from astrai.infer.detokenize import detokenize, find_stop_string, flush_text, visible_text
from astrai.infer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from astrai.infer.sampling import SamplingParams
from astrai.infer.scheduler import Sequence


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    eos_ids: frozenset[int] = frozenset()
    stop_ids: frozenset[int] = frozenset()
    with_logprobs: bool = True

    @property
    def finished(self) -> bool:
        if len(self.seqs) != self.params.n:
            return False
        for seq in self.seqs:  # a loop, not all(generator): this runs for every request every step
            if not seq.is_finished:
                return False
        return True

    def check_stop(self, seq: Sequence, token: int, tokenizer: Any | None, max_model_len: int,
                   lazy_text: bool) -> None:
        """Set seq.finish_reason (and stop_reason) if `token`, just appended, ends it. With
        `lazy_text` (run_batch) text is decoded once at the end unless stop strings need it."""
        params = seq.params
        num_out = len(seq.output_token_ids)
        if num_out >= params.min_tokens and token in self.stop_ids:
            seq.finish_reason = "stop"  # the stop token's own text is left out of the output
            seq.stop_reason = None if token in self.eos_ids and token not in params.stop_token_ids else token
        else:
            if tokenizer is not None and (not lazy_text or params.stop):
                delta = detokenize(tokenizer, seq)
                if params.stop and delta and num_out >= params.min_tokens and find_stop_string(seq, delta):
                    return
            if (params.max_tokens is not None and num_out >= params.max_tokens) or seq.num_tokens >= max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None and tokenizer is not None:
            _finalize_text(seq, tokenizer, lazy_text)

    def output(self, policy_version: int) -> RequestOutput:
        """The request as reported: its completions in sample order, with the prompt's cache hits."""
        outputs = []
        for seq in sorted(self.seqs, key=lambda s: s.index):
            outputs.append(CompletionOutput(
                index=seq.index, text=visible_text(seq), token_ids=list(seq.output_token_ids),
                logprobs=list(seq.logprobs) if self.with_logprobs else None,
                raw_logprobs=list(seq.raw_logprobs) if self.with_logprobs else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                cumulative_logprob=seq.cumulative_logprob, routing=seq.routing,
            ))
        first = next(s for s in self.seqs if s.index == 0)
        cached = first.num_cached_tokens or 0
        prompt_lps = list(first.prompt_logprobs) if first.prompt_logprobs is not None else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             cached, policy_version, self.metrics, prompt_lps)


def _finalize_text(seq: Sequence, tokenizer: Any, lazy_text: bool) -> None:
    by_token = seq.finish_reason == "stop"  # a stop string returned before this point
    if lazy_text and not seq.params.stop:
        ids = seq.output_token_ids[:-1] if by_token else seq.output_token_ids
        seq.text = tokenizer.decode(ids)
    elif not by_token:
        flush_text(tokenizer, seq)
