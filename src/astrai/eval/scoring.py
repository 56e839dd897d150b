"""Log-likelihood of given tokens through the inference engine: what the lm-eval adapter and
`astrai eval --perplexity` both score with.

A scoring request is (prompt, tokens forced after it, how many of the prompt's last tokens are
scored too). Forced tokens are "generated" under a one-path grammar (`ForcedTokens`, the
sampler's guide hook), so each gets the raw model's log-prob and rank like any sampled token;
scored prompt tokens get theirs from `SamplingParams.prompt_logprobs` in the prefill. The first
choice of a question (and any short context) is scored in one prefill of context +
continuation; its siblings send the bare context, which the prefix cache serves from the
blocks the first one filled, and decode their continuation forced. Rolling windows
(perplexity) score all but their last token as prompt log-probs. The window rule is lm-eval's
(`get_rolling_token_windows` with context 1, then `make_disjoint_window`), and a context longer
than the model is cut from the left as lm-eval's `hf` backend cuts it, so numbers agree with
`HFLM` on the same model directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams


class ForcedTokens:
    """A guide (infer/guided.py's protocol) that allows exactly one token at each step: the
    continuation being scored. Its state is a position in that list."""

    description = "a forced continuation (log-likelihood scoring)"

    def __init__(self, token_ids: list[int]):
        self.token_ids = tuple(token_ids)
        self.size = len(self.token_ids)  # a Guide's cost measure (the server bounds size x n)

    def new_state(self) -> _ForcedState:
        return _ForcedState(self.token_ids)


class _ForcedState:
    __slots__ = ("token_ids", "pos")

    def __init__(self, token_ids: tuple[int, ...]):
        self.token_ids, self.pos = token_ids, 0

    @property
    def matcher(self) -> _ForcedState:  # apply_guides asks the matcher whether it went wrong
        return self

    def is_error(self) -> bool:
        return False

    @property
    def is_accepting(self) -> bool:
        return self.pos >= len(self.token_ids)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        token = self.token_ids[min(self.pos, len(self.token_ids) - 1)]
        bit = 1 << (token % 32)
        bitmask[row, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words

    def accept(self, token_id: int) -> None:
        self.pos += 1


@dataclass
class ScoreRequest:
    """Score `forced` after `prompt`, plus the last `num_scored_prompt` prompt tokens."""

    prompt: list[int]
    forced: list[int]
    num_scored_prompt: int = 0


def window_length(model_config: Any) -> int:
    """lm-eval's `max_length` for a model: its max_position_embeddings (one below a sliding
    window, so a window plus the scored token that is never fed still fits the engine)."""
    length = model_config.max_position_embeddings
    window = getattr(model_config, "sliding_window", None)
    return min(length, window - 1) if window else length


def scoring_engine(model_dir: str, **config_fields: Any) -> LLMEngine:
    """An engine for a model directory whose sequences hold window_length + 1 tokens: an input
    of the model's length plus the last scored token (lm-eval feeds context + continuation
    minus its last token, at most max_length tokens)."""
    import json
    from pathlib import Path

    from astrai.model.hf_config import config_from_hf

    config = config_from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    config_fields.setdefault("max_model_len", window_length(config) + 1)
    config_fields.setdefault("long_prefill_token_threshold", 0)  # offline batches: throughput first
    return LLMEngine.from_pretrained(model_dir, **config_fields)


class Scorer:
    """Scores token sequences with an engine's model (raw log-probs, float32)."""

    def __init__(self, engine: LLMEngine, batch_size: int = 64):
        self.engine = engine
        self.batch_size = max(1, batch_size)
        # lm-eval's max_length; a live engine sized at the model's length scores one token less
        self.max_length = min(window_length(engine.model.config), engine.max_model_len - 1)

    # -- lm-eval's request kinds on token ids -----------------------------------------------------
    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives it) per
        (context ids, continuation ids) pair. Pairs with one context run as a group: its first
        request prefills the context, the others reuse its cached KV blocks."""
        groups: dict[tuple[int, ...], list[int]] = {}
        requests = []
        block_size = self.engine.block_manager.block_size
        for i, (context, continuation) in enumerate(pairs):
            request = self._truncated(context, continuation)
            members = groups.setdefault(tuple(request.prompt), [])
            # a sibling whose context fills a KV block reads it from the cache and decodes its
            # continuation under the forced guide; the rest (first of a group, short contexts)
            # score the continuation as prompt log-probs in one prefill (no decode steps)
            if not members or len(request.prompt) - 1 < block_size:
                request = ScoreRequest(request.prompt + request.forced[:-1], request.forced[-1:],
                                       len(request.forced) - 1)
            members.append(i)
            requests.append(request)
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        members = list(groups.values())
        start = 0
        while start < len(members):  # batches of whole groups, about batch_size requests each
            end, size = start, 0
            while end < len(members) and (size == 0 or size + len(members[end]) <= self.batch_size):
                size += len(members[end])
                end += 1
            firsts = [g[0] for g in members[start:end]]
            rest = [i for g in members[start:end] for i in g[1:]]
            for chunk in (firsts, rest):  # the context's blocks are cached when its siblings arrive
                for i, scored in zip(chunk, self.score([requests[i] for i in chunk])):
                    results[i] = scored
            start = end
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, token_lists: list[list[int]], prefix_token: int) -> list[float]:
        """Log-likelihood of each whole token list given `prefix_token`, in lm-eval's rolling
        windows of max_length tokens (every token predicted once, with as much context as fits)."""
        windows = [(n, w) for n, tokens in enumerate(token_lists)
                   for w in rolling_windows(tokens, prefix_token, self.max_length)]
        totals = [0.0] * len(token_lists)
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start : start + self.batch_size]
            requests = [ScoreRequest(ctx + cont[:-1], cont[-1:], len(cont) - 1) for _, (ctx, cont) in batch]
            for (n, _), (logprob, _) in zip(batch, self.score(requests)):
                totals[n] += logprob
        return totals

    def _truncated(self, context: list[int], continuation: list[int]) -> ScoreRequest:
        if not continuation:
            raise ValueError("a loglikelihood request needs a non-empty continuation; got none after "
                             "tokenising (the task's target text is empty)")
        if len(continuation) > self.max_length:
            raise ValueError(f"continuation has {len(continuation)} tokens but the model takes "
                             f"{self.max_length}; shorten the task's targets")
        whole = (context + continuation)[-(self.max_length + 1):]  # as HFLM: cut the context from the left
        return ScoreRequest(whole[: len(whole) - len(continuation)], continuation)

    # -- the engine call --------------------------------------------------------------------------
    def score(self, requests: list[ScoreRequest]) -> list[tuple[float, bool]]:
        """(log-prob sum, all greedy) of each request's scored tokens, in one engine batch."""
        if not requests:
            return []
        params = [SamplingParams(temperature=0.0, max_tokens=len(r.forced), ignore_eos=True, logprobs=0,
                                 prompt_logprobs=0 if r.num_scored_prompt else None,
                                 guide=ForcedTokens(r.forced))  # type: ignore[arg-type]
                  for r in requests]
        outputs = self.engine.generate_all([r.prompt for r in requests], params)
        return [_read_scores(r, out) for r, out in zip(requests, outputs)]


def _read_scores(request: ScoreRequest, out: Any) -> tuple[float, bool]:
    completion = out.outputs[0]
    if completion.token_ids != request.forced:
        raise RuntimeError(f"forced scoring produced {completion.token_ids}, not {request.forced}")
    entries = [d[t] for d, t in zip(completion.raw_logprobs, request.forced)]
    if request.num_scored_prompt:
        tail = request.prompt[-request.num_scored_prompt:]
        prompt_entries = out.prompt_logprobs[-request.num_scored_prompt:]
        entries = [d[t] for d, t in zip(prompt_entries, tail)] + entries
    return sum(e.logprob for e in entries), all(e.rank == 1 for e in entries)


def prefix_token_id(tokenizer: Any) -> int:
    """What an empty context and the first rolling window condition on: BOS, else EOS (lm-eval's rule)."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None else tokenizer.eos_token_id


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids as lm-eval's hf backend encodes a text: with the tokenizer's own special tokens
    (its post-processor), unless the text already starts with the prefix token."""
    prefix = tokenizer.decode([prefix_token_id(tokenizer)], skip_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=not (prefix and text.startswith(prefix)))


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int) -> Iterator[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows with context 1: (context, continuation) pairs whose
    continuations cover `tokens` once; the first is conditioned on `prefix_token`, each later
    one on up to max_length preceding tokens (`utils.get_rolling_token_windows` followed by
    `utils.make_disjoint_window`)."""
    if not tokens:
        return
    first = min(max_length, len(tokens))
    yield [prefix_token], tokens[:first]
    predicted = first
    while predicted < len(tokens):
        num_pred = min(len(tokens) - predicted, max_length)
        end = predicted + num_pred
        window = tokens[max(0, end - max_length - 1) : end - 1]  # the model's input
        yield window[: len(window) - (num_pred - 1)], tokens[end - num_pred : end]
        predicted = end
