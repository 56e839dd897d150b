"""Constrained (guided) decoding: a grammar decides which tokens may come next.

A request that must produce JSON (OpenAI `response_format` json_object / json_schema) or a tool
call (`tool_choice` required or a named function) carries a compiled `Guide` in its
`SamplingParams`; each of its sequences gets its own `GuideState` (a matcher at some position
in the grammar). Every step the sampler asks the states of the guided rows for a token bitmask
and sets the logits of forbidden tokens to -inf before penalties, temperature and truncation
see them; the chosen token then advances the state. Rows without a guide cost one attribute
check. Once the grammar is complete, only the sequence's stop tokens are allowed, so the engine
finishes it with finish_reason "stop".

The grammar work is llguidance's (Earley parser over the token trie, JSON Schema and Lark
front ends; see docs/inference.md for why it was chosen over xgrammar and outlines-core).
This module only adapts it: a `GuideCompiler` per tokenizer builds llguidance's tokenizer view
once and turns schemas into guides, refusing a schema that uses features llguidance does not
implement with an error that names them. Compiling a grammar is the expensive part (about 0.5 s
for a 5,000-branch `anyOf`), so it happens once per guide, where the guide is made (the server's
prep pool, never the engine thread); each sequence then starts from a copy of that compiled
matcher (`Guide.new_state`, milliseconds). The serialised grammar's length is the guide's `size`:
the compiler refuses one above `max_grammar_bytes`, and `check_guide_budget` bounds size x n,
since every one of a request's n sequences copies and advances its own matcher.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# The layout of a JSON value the grammar allows: one space after ',' and ':' like json.dumps and
# the tool-call examples in chat templates; no free whitespace a random model could loop in.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class GuideError(ValueError):
    """A schema or grammar that cannot be enforced; the message names what is unsupported."""


@dataclass(frozen=True)
class Guide:
    """A compiled grammar for one tokenizer; `new_state()` starts a matcher for one sequence."""

    grammar: str  # llguidance's serialised grammar
    tokenizer: Any  # llguidance.LLTokenizer
    description: str = ""
    matcher: Any = field(default=None, compare=False, repr=False)  # compiled, at the grammar's start

    @property
    def size(self) -> int:
        """The serialised grammar's length in characters: what compiling and copying it cost."""
        return len(self.grammar)

    def new_state(self) -> GuideState:
        # a copy of the compiled matcher (ms), not a second compile (0.5 s for a large schema):
        # this runs on the engine thread, for every sequence
        matcher = self.matcher if self.matcher is not None else compile_matcher(self.tokenizer, self.grammar)
        return GuideState(matcher.deep_copy())


class GuideState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Allowed next tokens as bits of bitmask[row] (int32, CPU, 32 tokens a word)."""
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def accept(self, token_id: int) -> None:
        # a stop token the grammar does not know (end of turn) fails here, harmlessly: it ends the sequence
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token_id)


class GuideCompiler:
    """Builds guides for one tokenizer (the tokenizer view takes tens of ms: built once).
    A grammar longer than `max_grammar_bytes` is refused before it is compiled (None: no limit)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_grammar_bytes: int | None = None):
        import llguidance

        self.max_grammar_bytes = max_grammar_bytes

        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise GuideError("constrained decoding needs a Hugging Face `tokenizers` tokenizer (tokenizer.json)")
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                eos_token=tokenizer.eos_token_id)

    def json_object(self) -> Guide:
        return self._checked(_grammar_from_schema({"type": "object"}), "a JSON object")

    def json_schema(self, schema: dict[str, Any]) -> Guide:
        return self._checked(_grammar_from_schema(schema), "JSON matching the schema")

    def tool_calls(self, functions: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> Guide:
        """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` for one of `functions`
        ((name, parameters schema) pairs), repeated (one per line) when `parallel`."""
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": params or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, params in functions]
        body = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = {**body, "x-guidance": JSON_LAYOUT}
        repeat = ' ("\\n" call)*' if parallel else ""
        lark = (f"start: call{repeat}\n"
                f"call: {json.dumps(TOOL_CALL_OPEN)} body {json.dumps(TOOL_CALL_CLOSE)}\n"
                f"body: %json {json.dumps(body)}\n")
        import llguidance

        return self._checked(llguidance.LLMatcher.grammar_from_lark(lark), "a tool call")

    def _checked(self, grammar: str, description: str) -> Guide:
        """Compile the grammar once (its errors and warnings are the compile's) into a Guide."""
        limit = self.max_grammar_bytes
        if limit is not None and len(grammar) > limit:
            raise GuideError(f"cannot constrain the output to {description}: its grammar is {len(grammar):,} "
                             f"bytes, more than max_guide_bytes {limit:,}; simplify the schema (fewer "
                             f"anyOf/enum branches) or raise --max_guide_bytes")
        matcher = compile_matcher(self.tokenizer, grammar)
        messages = [matcher.get_error()] if matcher.is_error() else matcher.get_grammar_warnings()
        if messages:  # a warning means part of the schema would be silently ignored
            raise GuideError(f"cannot constrain the output to {description}: {'; '.join(messages)}")
        return Guide(grammar, self.tokenizer, description, matcher)


def compile_matcher(tokenizer: Any, grammar: str) -> Any:
    """Compile a serialised grammar into an llguidance matcher at its start (the costly step)."""
    import llguidance

    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


def check_guide_budget(guide: Guide, n: int, max_bytes: int) -> None:
    """Refuse a guided request whose n sequences would together carry more than `max_bytes` of
    grammar (each copies, masks and advances its own matcher on the engine thread)."""
    total = guide.size * n
    if total > max_bytes:
        raise GuideError(f"the grammar of {guide.description or 'this request'} is {guide.size:,} bytes and n is "
                         f"{n}: {total:,} bytes in all, more than max_guide_bytes {max_bytes:,}; lower n to at "
                         f"most {max(1, max_bytes // guide.size)}, simplify the schema, or raise --max_guide_bytes")


def _grammar_from_schema(schema: dict[str, Any]) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise GuideError(f"the JSON schema is invalid: {exc}") from None


def apply_guides(logits: Tensor, rows: list[Any]) -> Tensor:
    """Set the logits (B, V) of tokens the grammar forbids to -inf, in place, for the rows whose
    params carry a guide; a complete grammar leaves only the row's stop tokens."""
    B, V = logits.shape
    guided = [i for i, r in enumerate(rows) if r.params.guide is not None]
    if not guided:
        return logits
    bitmask = torch.zeros(len(guided), (V + 31) // 32, dtype=torch.int32)  # (G, W), CPU for llguidance
    for j, i in enumerate(guided):
        rows[i].guide_state.fill_bitmask(bitmask, j)
    allowed = _unpack(bitmask.to(logits.device), V)  # (G, V) bool
    for j, i in enumerate(guided):
        # any stop token may end a complete value; a matcher gone wrong (nothing allowed) ends too
        state = rows[i].guide_state
        if rows[i].min_tokens_stop_ids and (state.is_accepting or state.matcher.is_error()):
            allowed[j, rows[i].min_tokens_stop_ids] = True
    index = torch.tensor(guided, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def _unpack(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 words (G, W) -> bool (G, vocab_size), bit b of word w is token 32 w + b."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    unpacked = (bitmask[:, :, None] >> bits) & 1  # (G, W, 32)
    return unpacked.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def advance_guides(rows: list[Any], token_ids: list[int]) -> None:
    """Move each guided row's grammar state past the token it just got."""
    for r, token in zip(rows, token_ids):
        if r.params.guide is not None:
            r.guide_state.accept(token)
