"""The stop-string check does bounded work per step: it scans the new text plus the longest
stop's length, counted by `STOP_SCAN`, however long the text already is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from astrai.infer.detokenize import STOP_SCAN, find_stop_string, visible_text


def _seq(stops: list[str]) -> SimpleNamespace:
    return SimpleNamespace(text="", params=SimpleNamespace(stop=stops), finish_reason=None, stop_reason=None)


def _step(seq: SimpleNamespace, delta: str) -> tuple[bool, str, int]:
    before = STOP_SCAN.chars
    seq.text += delta
    hit = find_stop_string(seq, len(delta))
    shown = visible_text(seq)
    return hit, shown, STOP_SCAN.chars - before


def test_work_per_step_is_bounded_by_new_text_and_stop_length_not_by_text_length():
    stops = ["b" * 255 + "c", "x" * 256, *(f"never{i}" for i in range(14))]  # 16 stops, the server's cap
    longest = max(len(s) for s in stops)
    seq = _seq(stops)
    per_step = []
    for _ in range(2000):  # 8000 characters of text that keep starting a stop, never finishing one
        hit, _, scanned = _step(seq, "bbbb")
        assert not hit
        per_step.append(scanned)
    bound = len(stops) * (4 + 2 * longest)
    assert max(per_step) <= bound
    assert max(per_step[-100:]) == max(per_step[300:400])  # flat: the 8000-char text costs nothing more
    assert len(seq.text) * len(stops) > 10 * bound  # a whole-text scan would have blown the bound


def test_stop_found_across_steps_and_text_cut_before_it():
    seq = _seq(["END", "zz"])
    assert _step(seq, "hello E")[:2] == (False, "hello ")  # "E" may start "END": held back
    assert _step(seq, "N")[:2] == (False, "hello ")
    hit, shown, _ = _step(seq, "D and more")
    assert hit and shown == "hello " and seq.stop_reason == "END" and seq.finish_reason == "stop"


@pytest.mark.parametrize(("text", "stops", "shown"), [
    ("abcab", ["abd"], "abc"),          # longest suffix that starts a stop
    ("aaaa", ["aaab"], "a"),
    ("xyz", ["q"], "xyz"),
    ("ab", ["bc", "abc"], ""),          # the longer of two candidates wins
])
def test_visible_text_holds_back_exactly_a_possible_stop_start(text, stops, shown):
    seq = _seq(stops)
    seq.text = text
    assert visible_text(seq) == shown
