"""The official `anthropic` client against `POST /v1/messages` of a live `astrai serve`."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from astrai.data.tokenizer import load_tokenizer
from tests.serve.conftest import API_KEY

MESSAGES = [{"role": "user", "content": "hello world"}]
# this client version has no sampling arguments (newer models fix them); the API still takes them
GREEDY = {"temperature": 0}


@pytest.fixture()
def claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def test_messages_answer_with_usage_and_stop_reason(claude, model_dir):
    out = claude.messages.create(model="tiny-model", max_tokens=12, messages=MESSAGES, system="be brief",
                                 extra_body=GREEDY)
    assert out.type == "message" and out.role == "assistant" and out.model == "tiny-model"
    assert out.content[0].type == "text" and out.id.startswith("msg")
    assert out.stop_reason in ("end_turn", "max_tokens")
    chat = [{"role": "system", "content": "be brief"}] + MESSAGES
    assert out.usage.input_tokens == len(load_tokenizer(model_dir).apply_chat_template(chat, add_generation_prompt=True))
    if out.stop_reason == "max_tokens":
        assert out.usage.output_tokens == 12


def test_stream_events_equal_the_answer(claude):
    full = claude.messages.create(model="tiny-model", max_tokens=16, messages=MESSAGES, extra_body=GREEDY)
    names = []
    with claude.messages.stream(model="tiny-model", max_tokens=16, messages=MESSAGES, extra_body=GREEDY) as stream:
        for event in stream:
            names.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    raw = [n for n in names if n not in ("text",)]  # the helper adds derived "text" events
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) <= {"content_block_delta"}


def test_stop_sequence_is_reported(claude):
    full = claude.messages.create(model="tiny-model", max_tokens=30, messages=MESSAGES, extra_body=GREEDY)
    text = full.content[0].text
    assert len(text) > 4
    stop = text[2:4]
    out = claude.messages.create(model="tiny-model", max_tokens=30, messages=MESSAGES, extra_body=GREEDY,
                                 stop_sequences=[stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[:text.index(stop)]


def test_errors_have_anthropic_shape(claude, server):
    with pytest.raises(anthropic.NotFoundError) as exc:
        claude.messages.create(model="other", max_tokens=5, messages=MESSAGES)
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model="tiny-model", max_tokens=5, messages=MESSAGES, extra_body={"temperature": 1.5})
    assert "temperature" in exc.value.body["error"]["message"]
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model="tiny-model", max_tokens=5, messages=MESSAGES)
    # max_tokens is required
    r = httpx.post(server.base_url + "/v1/messages", json={"model": "tiny-model", "messages": MESSAGES},
                   headers={"x-api-key": API_KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_bearer_auth_works_too(server):
    r = httpx.post(server.base_url + "/v1/messages", json={"model": "tiny-model", "messages": MESSAGES, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["type"] == "message"
