"""Anthropic `tools` on `/v1/messages` through the official `anthropic` client, as the OpenAI route
does them: definitions rendered into the chat template, `tool_use` blocks out (whole and streamed
as `input_json_delta`), `tool_use` / `tool_result` history in, and `tool_choice` any / tool on the
tool-call grammar.

A scripted sampler (the model "says" CALL_TEXT) checks parsing and history; constrained decoding
on the random tiny model checks that forced calls parse and match their schema whatever the
weights say. Sampling arguments go through `extra_body` (this client version has none)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from astrai.data.tokenizer import load_tokenizer
from tests.serve.conftest import API_KEY
from tests.serve.scripted_tools import ASK, CALL_TEXT, TIME, WEATHER, check_weather_args, scripted_app


def _anthropic(tool: dict) -> dict:
    """An OpenAI tool definition in Anthropic's shape."""
    f = tool["function"]
    return {"name": f["name"], **({"description": f["description"]} if "description" in f else {}),
            "input_schema": f["parameters"]}


A_WEATHER, A_TIME = _anthropic(WEATHER), _anthropic(TIME)
ARGS = {"city": "Paris", "unit": "celsius"}


@pytest.fixture(scope="module")
def scripted(model_dir):
    """A live app whose model answers with CALL_TEXT (then end of turn)."""
    with scripted_app(model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def claude(scripted):
    with anthropic.Anthropic(base_url=scripted.base, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def test_a_call_becomes_a_tool_use_block_with_stop_reason_tool_use(claude):
    out = claude.messages.create(model="tiny-model", max_tokens=200, messages=ASK, tools=[A_WEATHER, A_TIME])
    assert out.stop_reason == "tool_use"
    text, call = out.content
    assert text.type == "text" and text.text == "Let me check."
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == ARGS
    assert call.id.startswith("toolu_")


def test_the_stream_sends_the_call_as_input_json_deltas(claude):
    full = claude.messages.create(model="tiny-model", max_tokens=200, messages=ASK, tools=[A_WEATHER])
    events = []
    with claude.messages.stream(model="tiny-model", max_tokens=200, messages=ASK, tools=[A_WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["text", "tool_use"] and [s.index for s in starts] == [0, 1]
    assert starts[1].content_block.name == "get_weather" and starts[1].content_block.input == {}
    deltas = [e.delta for e in events if e.type == "content_block_delta" and e.index == 1]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert final.stop_reason == "tool_use" and final.content[1].input == ARGS == full.content[1].input
    assert final.content[0].text.strip() == full.content[0].text
    assert [e.type for e in events if e.type == "content_block_stop"] == ["content_block_stop"] * 2


def test_tool_choice_none_leaves_the_text_and_the_template_sees_the_tools(claude, scripted, model_dir):
    out = claude.messages.create(model="tiny-model", max_tokens=200, messages=ASK, tools=[A_WEATHER],
                                 tool_choice={"type": "none"})
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == CALL_TEXT
    assert out.stop_reason == "end_turn"
    tok = load_tokenizer(model_dir)
    assert out.usage.input_tokens == len(tok.apply_chat_template(ASK, add_generation_prompt=True, tools=[WEATHER]))


def test_tool_use_and_tool_result_history_render_as_the_openai_route_does(claude, scripted):
    first = claude.messages.create(model="tiny-model", max_tokens=200, messages=ASK, tools=[A_WEATHER])
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": first.content[1].id, "content": '{"temp": 21}'},
                         {"type": "text", "text": "and tomorrow?"}]}]
    again = claude.messages.create(model="tiny-model", max_tokens=200, messages=history, tools=[A_WEATHER])
    call_id = first.content[1].id
    same = ASK + [{"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", '
                                                                                            '"unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp": 21}'},
        {"role": "user", "content": "and tomorrow?"}]
    gpt = openai.OpenAI(base_url=scripted.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    chat = gpt.chat.completions.create(model="tiny-model", messages=same, tools=[WEATHER], max_tokens=200)
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    assert again.usage.input_tokens > first.usage.input_tokens + 20


@pytest.mark.parametrize(("message", "needle"), [
    ({"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}, "tool_use"),
    ({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}, "tool_result"),
])
def test_blocks_in_the_wrong_role_are_a_400(claude, message, needle):
    with pytest.raises(anthropic.BadRequestError, match=needle):
        claude.messages.create(model="tiny-model", max_tokens=5, messages=ASK + [message], tools=[A_WEATHER])


def test_tool_choice_must_name_an_offered_tool(claude):
    with pytest.raises(anthropic.BadRequestError, match="get_time"):
        claude.messages.create(model="tiny-model", max_tokens=5, messages=ASK, tools=[A_WEATHER],
                               tool_choice={"type": "tool", "name": "get_time"})
    with pytest.raises(anthropic.BadRequestError, match="needs at least one tool"):
        claude.messages.create(model="tiny-model", max_tokens=5, messages=ASK, tool_choice={"type": "any"})


# ------------------------------------------------------------------------------ constrained decoding
@pytest.fixture()
def random_claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_forces_a_valid_call(random_claude, stream):
    kwargs = dict(model="tiny-model", max_tokens=200, messages=ASK, tools=[A_WEATHER, A_TIME],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    if stream:
        with random_claude.messages.stream(**kwargs) as s:
            out = s.get_final_message()
    else:
        out = random_claude.messages.create(**kwargs)
    calls = [b for b in out.content if b.type == "tool_use"]
    assert out.stop_reason == "tool_use" and len(calls) == 1
    if calls[0].name == "get_weather":
        assert set(calls[0].input) == {"city", "unit"} and calls[0].input["unit"] in ("celsius", "fahrenheit")
    else:
        assert calls[0].name == "get_time" and calls[0].input["zone"] in ("utc", "cet")


def test_a_named_tool_is_called(random_claude):
    out = random_claude.messages.create(model="tiny-model", max_tokens=200, messages=ASK, tools=[A_TIME, A_WEATHER],
                                        # one call: a random model at temperature 1 may chain calls past max_tokens
                                        tool_choice={"type": "tool", "name": "get_weather",
                                                     "disable_parallel_tool_use": True},
                                        extra_body={"temperature": 1.0, "seed": 3})
    calls = [b for b in out.content if b.type == "tool_use"]
    assert out.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    for call in calls:
        check_weather_args(json.dumps(call.input))


def test_bad_tool_definitions_get_anthropics_error_body(server):
    body = {"model": "tiny-model", "max_tokens": 5, "messages": ASK, "tools": [{"name": "bad name!", "input_schema": {}}]}
    r = httpx.post(server.base_url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "tools[0].name" in r.json()["error"]["message"]


def test_two_tools_of_one_name_are_a_400_naming_it(server):
    body = {"model": "tiny-model", "max_tokens": 5, "messages": ASK, "tools": [A_WEATHER, A_TIME, A_WEATHER]}
    r = httpx.post(server.base_url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    message = r.json()["error"]["message"]
    assert "tool names must be unique" in message and "'get_weather'" in message and "'get_time'" not in message
