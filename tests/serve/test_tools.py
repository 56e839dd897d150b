"""Tool calling and structured output through the official `openai` client.

A scripted sampler (the model "says" a fixed token sequence) checks that tool-call text becomes
`tool_calls` and goes back through a `tool` message, streamed and not; constrained decoding on
the random tiny model checks that required/named calls and json_object/json_schema outputs parse
and match their schema whatever the weights say.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from astrai.data.tokenizer import load_tokenizer
from astrai.data.tool_calls import ToolCallStream, parse_tool_calls
from tests.serve.conftest import API_KEY
from tests.serve.scripted_tools import ASK, CALL_TEXT, TIME, WEATHER, check_weather_args, scripted_app


# ------------------------------------------------------------------------------ parsing
def test_parse_splits_content_and_valid_calls():
    content, calls = parse_tool_calls(CALL_TEXT, {"get_weather"})
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("block", ['{"name": "get_weather", "arguments": {"city": ', '{"name": "rm_rf", "arguments": {}}',
                                   '["get_weather"]', '{"arguments": {}}'])
def test_invalid_or_unknown_calls_stay_content(block):
    text = f"ok <tool_call>{block}</tool_call>"
    assert parse_tool_calls(text, {"get_weather"}) == (text, [])


def test_parallel_off_keeps_only_the_first_call():
    one = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    content, calls = parse_tool_calls(one + "\n" + one, {"f"}, parallel=False)
    assert len(calls) == 1 and content == one
    assert len(parse_tool_calls(one + "\n" + one, {"f"})[1]) == 2


def test_stream_holds_back_a_split_tag_and_releases_whole_calls():
    stream = ToolCallStream({"get_weather"})
    pieces = []
    for i in range(0, len(CALL_TEXT), 3):  # every split point of tags and JSON
        pieces += stream.feed(CALL_TEXT[i:i + 3])
    pieces += stream.finish()
    texts = [p for p in pieces if isinstance(p, str)]
    assert "".join(texts) == "Let me check.\n" and not any("<" in t for t in texts)
    assert [p.name for p in pieces if not isinstance(p, str)] == ["get_weather"]
    unfinished = ToolCallStream({"get_weather"})
    assert unfinished.feed("a <tool_") == ["a "] and unfinished.finish() == ["<tool_"]


# ------------------------------------------------------------------------------ scripted model


@pytest.fixture(scope="module")
def scripted(model_dir):
    with scripted_app(model_dir) as live:
        yield openai.OpenAI(base_url=live.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _streamed(client, **kwargs):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny-model", stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_scripted_call_round_trips_through_a_tool_message(scripted, model_dir):
    out = scripted.chat.completions.create(model="tiny-model", messages=ASK, tools=[WEATHER, TIME], max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    # the call and its result go back into the conversation and through the template
    follow = ASK + [choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    again = scripted.chat.completions.create(model="tiny-model", messages=follow, tools=[WEATHER, TIME],
                                             max_tokens=200)
    tok = load_tokenizer(model_dir)
    rendered = tok.render_chat(follow, add_generation_prompt=True, tools=[WEATHER, TIME])
    assert '"temp": 21' in rendered and '<tool_call>{"name": "get_weather"' in rendered
    assert again.usage.prompt_tokens == len(tok.encode(rendered))


def test_scripted_call_streams_as_tool_call_deltas(scripted):
    content, calls, finish = _streamed(scripted, messages=ASK, tools=[WEATHER], max_tokens=200)
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert len(calls) == 1 and calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_unknown_function_and_tool_choice_none_stay_content(scripted):
    out = scripted.chat.completions.create(model="tiny-model", messages=ASK, tools=[TIME], max_tokens=200)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content == CALL_TEXT
    assert out.choices[0].finish_reason == "stop"
    content, calls, finish = _streamed(scripted, messages=ASK, tools=[TIME], max_tokens=200)
    assert (content, calls, finish) == (CALL_TEXT, [], "stop")
    off = scripted.chat.completions.create(model="tiny-model", messages=ASK, tools=[WEATHER], tool_choice="none",
                                           max_tokens=200)
    assert off.choices[0].message.tool_calls is None and off.choices[0].message.content == CALL_TEXT


def test_a_call_cut_by_max_tokens_comes_back_as_text_as_vllm_does(scripted, model_dir):
    """A call cut by max_tokens is no call: the text comes back as content with finish_reason
    "length", as vLLM's hermes parser answers when the JSON does not parse. Streamed, the
    unfinished call is held back and released as text at the end, so both modes give one content
    (vLLM streams the partial call's deltas instead: documented in docs/inference.md)."""
    tok = load_tokenizer(model_dir)
    cut = len(tok.encode(CALL_TEXT)) - 6  # inside the arguments' JSON
    want = tok.decode(tok.encode(CALL_TEXT)[:cut])
    assert "<tool_call>" in want and "</tool_call>" not in want
    out = scripted.chat.completions.create(model="tiny-model", messages=ASK, tools=[WEATHER], max_tokens=cut)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == want
    assert _streamed(scripted, messages=ASK, tools=[WEATHER], max_tokens=cut) == (want, [], "length")


# ------------------------------------------------------------------------------ constrained decoding


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_forces_a_valid_call(client, stream):
    kwargs = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=200, temperature=0)
    if stream:
        _, calls, finish = _streamed(client, **kwargs)
    else:
        out = client.chat.completions.create(model="tiny-model", **kwargs)
        finish = out.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in out.choices[0].message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    if calls[0]["name"] == "get_weather":
        check_weather_args(calls[0]["arguments"])
    else:
        assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"])["zone"] in ("utc", "cet")


def test_named_tool_choice_calls_that_function(client):
    out = client.chat.completions.create(model="tiny-model", messages=ASK, tools=[TIME, WEATHER], n=3, seed=7,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         max_tokens=200, temperature=1.0)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls][:1] == ["get_weather"]
        for call in choice.message.tool_calls:
            check_weather_args(call.function.arguments)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "pets", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_parses_and_matches(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = client.chat.completions.create(model="tiny-model", messages=ASK, response_format=fmt, seed=seed,
                                         temperature=1.0, max_tokens=200)
    assert out.choices[0].finish_reason == "stop"
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"name", "age", "pets", "ok"} and len(value["name"]) <= 10
    assert 0 <= value["age"] <= 120 and set(value["pets"]) <= {"cat", "dog"} and len(value["pets"]) <= 3
    assert isinstance(value["ok"], bool)


def test_json_object_output_parses(client):
    out = client.chat.completions.create(model="tiny-model", messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=300, temperature=0)
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert text.startswith("{")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-model", messages=ASK, response_format={"type": "json_object"}, max_tokens=300, temperature=0,
        stream=True) if c.choices)
    assert streamed == text


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if", "then"'),
    ({"type": "string", "format": "uri-reference"}, "uri-reference"),
])
def test_unsupported_schema_features_are_a_400_naming_them(server, schema, named):
    body = {"model": "tiny-model", "messages": ASK, "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"] and r.json()["error"]["param"] == "response_format"


def test_bad_tool_choice_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="get_time"):
        client.chat.completions.create(model="tiny-model", messages=ASK, tools=[WEATHER], max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    with pytest.raises(openai.BadRequestError, match="required"):
        client.chat.completions.create(model="tiny-model", messages=ASK, tool_choice="required", max_tokens=5)
