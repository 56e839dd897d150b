"""Incremental detokenisation and stop strings: the text side of a running sequence.

Each new token's text is the difference between decoding a few tokens of left context with
and without it (a tokenizer may merge or prefix spaces across tokens, so one token alone does
not decode to its text in place). Text that ends in an incomplete UTF-8 character (U+FFFD) is
held back until a later token completes it, so no broken character is ever reported. Stop
strings are searched only where new text could complete one, and while a request runs, a tail
of its text that may be the start of a stop string is held back from what is shown.
"""

from __future__ import annotations

from typing import Any

from astrai.infer.scheduler import Sequence


def detokenize(tokenizer: Any, seq: Sequence) -> int:
    """Append the text of newly readable tokens to seq.text; the number of characters added."""
    ids = seq.token_ids
    prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
    new_text = tokenizer.decode(ids[seq.prefix_offset :])
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return 0
    delta = new_text[len(prefix_text) :]
    seq.text += delta
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    return len(delta)


def flush_text(tokenizer: Any, seq: Sequence) -> None:
    """At the end: append text still held back for an incomplete UTF-8 character."""
    if seq.read_offset < seq.num_tokens:
        ids = seq.token_ids
        prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
        seq.text += tokenizer.decode(ids[seq.prefix_offset :])[len(prefix_text) :]


class ScanCounter:
    """Characters the stop-string code has looked at. The server's defence against hostile stop
    lists is that this grows with the new text and the stops' lengths, never with the whole text;
    tests assert exactly that by reading `chars`."""

    chars = 0


STOP_SCAN = ScanCounter()


def find_stop_string(seq: Sequence, num_new_chars: int) -> bool:
    """Cut seq.text before the first stop string and finish seq with it, if one now appears."""
    stops = seq.params.stop
    # earlier text held no stop string, so only one overlapping the new characters can match:
    # the window is the new text plus the longest stop's length, however long the text is
    start = max(0, len(seq.text) - num_new_chars - max(len(s) for s in stops) + 1)
    window = seq.text[start:]
    STOP_SCAN.chars += len(window) * len(stops)
    hits = [(i, s) for s in stops if (i := window.find(s)) >= 0]
    if not hits:
        return False
    at, stop = min(hits)
    seq.text = seq.text[: start + at]
    seq.finish_reason = "stop"
    seq.stop_reason = stop
    return True


def visible_text(seq: Sequence) -> str:
    """Text safe to show while running: hold back a tail that may be the start of a stop
    string, so text reported so far is never taken back."""
    if seq.finish_reason is not None or not seq.params.stop:
        return seq.text
    text = seq.text
    tail = text[len(text) - min(len(text), max(len(s) for s in seq.params.stop) - 1):]
    held = 0
    for stop in seq.params.stop:
        # the longest suffix of tail that starts `stop`: only positions holding stop[0] can begin
        # one, and the leftmost such position that fits is the longest
        STOP_SCAN.chars += len(tail)
        i = tail.find(stop[0], max(0, len(tail) - len(stop)))
        while 0 <= i < len(tail) - held:
            if stop.startswith(tail[i:]):
                held = len(tail) - i
                break
            i = tail.find(stop[0], i + 1)
    return text[: len(text) - held] if held else text
