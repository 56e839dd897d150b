"""The tool-call parser (``data/tool_calls.py``) that the server and online RL's rollouts share:
a call whose JSON nests objects and arrays deeper than ``MAX_JSON_DEPTH`` is a parse error (the
block stays content, as for any JSON that does not parse), never a ``RecursionError``, whole or
streamed. (The parser's other cases are tested with the server, tests/serve/test_tools.py.)"""

from __future__ import annotations

import json

from astrai.data.tool_calls import MAX_JSON_DEPTH, ToolCallStream, parse_tool_calls


def nested_call(depth: int) -> str:
    """A call of f whose JSON nests `depth` levels: the block's object, the arguments, then lists."""
    lists = depth - 2
    return '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * lists + "]" * lists + "}}</tool_call>"


def test_a_call_nested_past_max_json_depth_is_a_parse_error():
    assert [c.name for c in parse_tool_calls(nested_call(MAX_JSON_DEPTH), {"f"})[1]] == ["f"]
    for depth in (MAX_JSON_DEPTH + 1, 100_000):  # 100,000: json's own parser would raise RecursionError
        text = "ok " + nested_call(depth)
        assert parse_tool_calls(text, {"f"}) == (text, [])
        stream = ToolCallStream({"f"})  # the server's streaming path
        assert "".join(stream.feed(text) + stream.finish()) == text


def test_arguments_sent_as_json_text_are_held_to_the_same_depth():
    deep = json.dumps('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>', {"f"})[1] == []


def test_brackets_inside_strings_do_not_count():
    text = '<tool_call>{"name": "f", "arguments": {"x": "' + "[{" * 1000 + '\\" ]]"}}</tool_call>'
    [call] = parse_tool_calls(text, {"f"})[1]
    assert json.loads(call.arguments)["x"] == "[{" * 1000 + '" ]]'
