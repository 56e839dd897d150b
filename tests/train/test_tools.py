"""The tools of multi-turn rollouts (``rl/tools.py``, run through ``rl/guard.py``'s ``UserHooks``):
sync tools of different episodes run at once on worker threads; a call past ``tool_timeout``, and
whatever a tool raises (``SystemExit`` and ``KeyboardInterrupt`` included) or returns that JSON
cannot write, reach the model as an ``error: ...`` message, counted; a stop request abandons a turn
whose tool hangs; a result is cut to what the row can hold before it is tokenized, and a call nested
past the parser's depth is no call. The slow tools here wait on events (a barrier, an event the test sets at its
end), never on the clock."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from astrai.data.tokenizer import load_tokenizer
from astrai.train.rl.episode import episode_stats
from astrai.train.rl.guard import UserCodeInterrupted, UserHooks
from astrai.train.rl.tools import ToolBox
from tests.train.rl_user_code import HANGING, RELEASE, USER_CODE
from tests.train.samplers import fake_turn, scripted_episodes

HERE = "tests.train.test_tools"
NUM_EPISODES = 8
MEET = threading.Barrier(NUM_EPISODES, timeout=60)  # passed only when all 8 calls run at once


def meet(x: int) -> int:
    """Wait until the tool runs in every episode at once."""
    MEET.wait()
    return x


async def waits_forever(x: int) -> int:
    """An async tool that never returns."""
    await asyncio.Event().wait()
    return x


class NoStr:
    def __str__(self):
        raise RuntimeError("no text")

    __repr__ = __str__


def tuple_keys(x: int) -> dict:
    """A dict JSON cannot write."""
    return {(1, 2): x}


def circular(x: int) -> list:
    """A list that holds itself."""
    items: list = [x]
    items.append(items)
    return items


def no_str(x: int) -> object:
    """An object whose __str__ raises."""
    return NoStr()


def exits(x: int) -> int:
    """Calls sys.exit(0)."""
    sys.exit(0)


def interrupts(x: int) -> int:
    """Raises KeyboardInterrupt."""
    raise KeyboardInterrupt


def call(name: str, x: int = 1) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"x": {x}}}}}</tool_call>'


@pytest.fixture
def hangs():
    """Hooks of rl_user_code that hang do so until the test ends."""
    RELEASE.clear()
    HANGING.clear()
    yield
    RELEASE.set()


def episodes_calling(tok_dir, first_turn: str, tools: list[str], group_size: int = 1, max_model_len: int = 4096,
                     **kwargs):
    tok = load_tokenizer(tok_dir)
    script = [first_turn, "1"]
    return scripted_episodes(tok, lambda turn: fake_turn(tok, script[turn]),
                             [{"messages": [{"role": "user", "content": "1*1"}], "answer": "1"}], max_model_len, 64,
                             tools=tools, group_size=group_size, **kwargs)[0]


def test_sync_tools_of_different_episodes_run_at_once(tok_dir):
    """8 episodes call a tool that returns only when all 8 calls are inside it: one at a time (as
    before), the first would wait for the barrier's 60 s and every call would fail."""
    episodes = episodes_calling(tok_dir, call("meet"), [f"{HERE}:meet"], group_size=NUM_EPISODES)
    assert [m["content"] for e in episodes for m in e.messages if m["role"] == "tool"] == ["1"] * NUM_EPISODES
    assert sum(e.num_tool_errors for e in episodes) == 0 and all(e.done for e in episodes)


def test_a_tool_past_tool_timeout_is_an_error_message_counted(tok_dir, hangs):
    """A sync tool that hangs and an async one that never returns, in one turn: each is abandoned
    at tool_timeout, the model reads why, and the episode goes on to its answer."""
    [e] = episodes_calling(tok_dir, call("hanging_tool") + call("waits_forever"),
                           [f"{USER_CODE}:hanging_tool", f"{HERE}:waits_forever"], tool_timeout=0.2)
    assert [m["content"] for m in e.messages if m["role"] == "tool"] == [
        f"error: {name} took longer than tool_timeout=0.2s and was abandoned (its result, if any, is dropped)"
        for name in ("hanging_tool", "waits_forever")]
    assert (e.num_tool_calls, e.num_tool_errors, e.num_tool_timeouts) == (2, 2, 2)
    assert e.done and e.final_text == "1"
    stats = episode_stats([e], 0.0, 0.0)
    assert stats["tool_timeouts"] == 2.0 and stats["tool_errors"] == 2.0


@pytest.mark.parametrize("name, message", [
    ("tuple_keys", "error: tuple_keys returned a dict that cannot be written as JSON (TypeError: keys must be str, "
                   "int, float, bool or None, not tuple); return a str or JSON data"),
    ("circular", "error: circular returned a list that cannot be written as JSON (ValueError: Circular reference "
                 "detected); return a str or JSON data"),
    ("no_str", "error: no_str returned a NoStr that cannot be written as JSON (RuntimeError: no text); return a str "
               "or JSON data"),
    ("exits", "error: exits called sys.exit(0)"),
    ("interrupts", "error: interrupts raised KeyboardInterrupt"),
])
def test_what_a_tool_raises_or_returns_is_always_a_message(name, message):
    box = ToolBox([tuple_keys, circular, no_str, exits, interrupts])
    [c] = box.parse(call(name))
    assert asyncio.run(box.call(c, UserHooks())) == (message, "error")


def test_a_tool_that_exits_does_not_end_the_episode(tok_dir):
    [e] = episodes_calling(tok_dir, call("exits"), [f"{HERE}:exits"])
    assert e.done and e.final_text == "1" and e.num_tool_errors == 1


def test_a_stop_request_abandons_a_turn_whose_tool_hangs(tok_dir, hangs):
    with pytest.raises(UserCodeInterrupted, match=r"a stop request interrupted tool hanging_tool"):
        episodes_calling(tok_dir, call("hanging_tool"), [f"{USER_CODE}:hanging_tool"], should_stop=HANGING.is_set)


# ------------------------------------------------------------------------------ what a tool costs


def huge(x: int) -> str:
    """About 9 MB of text."""
    return "ab " * 3_000_000


def long_text(x: int) -> str:
    """Text a little longer than the row has room for (tokenized whole in reasonable time)."""
    return "ab " * 2_000


def surrogate(x: int) -> str:
    """Text UTF-8 cannot write."""
    return "a\ud800b"


def test_a_huge_tool_result_is_cut_to_what_the_row_can_hold(tok_dir):
    """The row has max_model_len - len(ids) - max_tokens tokens left; no token holds more
    characters than the vocabulary's longest, so past that many characters (+1) nothing fits."""
    [e] = episodes_calling(tok_dir, call("huge"), [f"{HERE}:huge"], max_model_len=512)
    tok = load_tokenizer(tok_dir)
    longest = max(map(len, tok.backend.get_vocab(with_added_tokens=True)))
    [message] = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert len(message) == (512 - len(e.ids) - 64) * longest + 1
    assert e.truncated and e.num_turns == 1 and len(e.ids) <= 512


def test_cutting_a_tool_result_changes_no_episode(tok_dir, monkeypatch):
    """The same episode with the result uncut: the same row, truncated the same way."""
    from astrai.train.rl.episode import Conversation

    [cut] = episodes_calling(tok_dir, call("long_text"), [f"{HERE}:long_text"], max_model_len=512)
    monkeypatch.setattr(Conversation, "_bounded", lambda self, e, text: text)
    [whole] = episodes_calling(tok_dir, call("long_text"), [f"{HERE}:long_text"], max_model_len=512)
    assert cut.ids == whole.ids and cut.logps == whole.logps and cut.truncated and whole.truncated
    assert len(cut.messages[-1]["content"]) < len(whole.messages[-1]["content"]) == 6_000


def test_text_utf8_cannot_write_is_replaced_not_a_crash(tok_dir):
    [e] = episodes_calling(tok_dir, call("surrogate"), [f"{HERE}:surrogate"])
    assert [m["content"] for m in e.messages if m["role"] == "tool"] == ["a?b"] and e.done


def test_a_call_nested_past_the_parsers_depth_is_no_call(tok_dir):
    """The server's parser: the block is text, not a RecursionError; the episode (no environment) ends."""
    deep = '<tool_call>{"name": "meet", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}</tool_call>"
    [e] = episodes_calling(tok_dir, deep, [f"{HERE}:meet"])
    assert e.done and e.num_tool_calls == 0 and e.num_turns == 1
