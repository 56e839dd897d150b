"""Input hygiene and request pre-checks: lone surrogates, ignored field names in the log, the
Anthropic route's stop limits, `$defs`/`$ref` in forced tool schemas, a chat of many empty
messages refused before it is validated or tokenised (and rendered on the prep pool, never the
event loop), and a request too large to ever be admitted refused with a 400 rather than a 429.

Bodies with a lone surrogate are sent raw (the JSON escape `\\ud800`): a client library would
refuse to encode them. What ran where is recorded by a tokenizer wrapper, never timed."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import httpx
import pytest

from astrai.serve.app import ServeConfig, load_engine
from astrai.serve.protocol import MAX_FIELD_NAME_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.serve.conftest import API_KEY
from tests.serve.live import LiveApp
from tests.serve.scripted_tools import ASK

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
ENGINE = {"max_model_len": 64, "kv_cache_tokens": 2048}


def _post(base: str, path: str, body: Any) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, str | bytes) else {"json": body}
    return httpx.post(base + path, headers=AUTH, timeout=60, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ------------------------------------------------------------------------------ lone surrogates
TOOL = '{"type": "function", "function": {"name": "f", "description": "DESC", "parameters": {"type": "object"}}}'


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", '{"model": "tiny-model", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"model": "tiny-model", "prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt[1]"),
    ("/v1/chat/completions", '{"model": "tiny-\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("/v1/chat/completions", '{"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], '
                             '"tools": [' + TOOL.replace("DESC", "x\\ud83d") + "]}", "tools[0].function.description"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_where(server, path, raw, param):
    error = _error(_post(server.base_url, path, raw), 400)
    assert "surrogate" in error["message"] and error["param"] == param


def test_a_lone_surrogate_on_the_anthropic_route_gets_its_body(server):
    raw = '{"model": "tiny-model", "max_tokens": 1, "messages": [{"role": "user", "content": "\\ud800"}]}'
    r = _post(server.base_url, "/v1/messages", raw)
    assert r.status_code == 400 and r.json()["type"] == "error" and "surrogate" in r.json()["error"]["message"]


def test_paired_surrogates_and_escaped_backslashes_are_text(server):
    for content in ("\\ud83d\\ude00", "\\\\ud800"):  # an emoji; a backslash then 'ud800'
        raw = '{"model": "tiny-model", "max_tokens": 1, "messages": [{"role": "user", "content": "' + content + '"}]}'
        assert _post(server.base_url, "/v1/chat/completions", raw).status_code == 200


# ------------------------------------------------------------------------------ ignored field names
def test_ignored_field_names_are_escaped_and_capped_in_the_log(model_dir, caplog):
    huge, forged = "n" * 200_000, "x\nWARNING astrai.serve: forged line"
    with LiveApp(ServeConfig(str(model_dir), api_key=API_KEY, engine_kwargs=ENGINE)) as live:
        live.wait_status("ready")
        with caplog.at_level(logging.WARNING, logger="astrai.serve"):
            body = {"model": "tiny-model", "prompt": "hi", "max_tokens": 1, huge: 1, forged: 2}
            assert _post(live.base, "/v1/completions", body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "ignoring the unsupported request field" in r.getMessage()]
    assert len(lines) == 2
    assert all("\n" not in line and len(line) < MAX_FIELD_NAME_CHARS + 100 for line in lines)
    assert any("n" * 50 in line and "...'" in line for line in lines)
    assert any("x\\nWARNING astrai.serve: forged line" in line for line in lines)


# ------------------------------------------------------------------------------ Anthropic stop limits
@pytest.mark.parametrize(("stops", "needle"), [
    (["s"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} stop strings"),
    (["s" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"),
])
def test_messages_apply_the_openai_stop_limits(server, stops, needle):
    body = {"model": "tiny-model", "max_tokens": 1, "messages": ASK, "stop_sequences": stops}
    r = _post(server.base_url, "/v1/messages", body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert "stop_sequences" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------ $defs / $ref in tools
PLACE = {"type": "object", "properties": {"place": {"$ref": "#/$defs/City"}}, "required": ["place"],
         "additionalProperties": False,
         "$defs": {"City": {"type": "object", "properties": {"name": {"enum": ["paris", "rome"]}},
                            "required": ["name"], "additionalProperties": False}}}
GO = {"type": "function", "function": {"name": "go", "parameters": PLACE}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "go"}}])
def test_defs_and_refs_in_a_forced_tool_schema(client, choice):
    out = client.chat.completions.create(model="tiny-model", messages=ASK, tools=[GO], tool_choice=choice,
                                         parallel_tool_calls=False, max_tokens=100, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "go" and json.loads(call.function.arguments)["place"]["name"] in ("paris", "rome")


def test_defs_and_refs_on_the_anthropic_route(server):
    body = {"model": "tiny-model", "max_tokens": 100, "messages": ASK, "temperature": 0,
            "tools": [{"name": "go", "input_schema": PLACE}], "tool_choice": {"type": "tool", "name": "go"}}
    out = _post(server.base_url, "/v1/messages", body).json()
    calls = [b for b in out["content"] if b["type"] == "tool_use"]
    assert out["stop_reason"] == "tool_use" and calls[0]["input"]["place"]["name"] in ("paris", "rome")


# ------------------------------------------------------------------------------ pre-checks
class _RecordingTokenizer:
    """The real tokenizer, recording on which thread templates render and how often it encodes."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.render_threads: list[str] = []
        self.num_encodes = 0

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.render_threads.append(threading.current_thread().name)
        return self.inner.apply_chat_template(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.num_encodes += 1
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def recorded(model_dir):
    holder: dict[str, _RecordingTokenizer] = {}

    def loader(config):
        engine, tok = load_engine(config)
        holder["tok"] = _RecordingTokenizer(tok)
        return engine, holder["tok"]

    with LiveApp(ServeConfig(str(model_dir), api_key=API_KEY, engine_kwargs=ENGINE), loader) as live:
        live.wait_status("ready")
        yield live, holder["tok"]


def test_150000_empty_messages_are_refused_before_validation(recorded):
    live, tok = recorded
    body = json.dumps({"model": "tiny-model", "messages": [{"role": "user", "content": ""}] * 150_000})
    assert len(body) > 4_900_000
    renders, encodes = len(tok.render_threads), tok.num_encodes
    error = _error(_post(live.base, "/v1/chat/completions", body), 400)
    assert "150000 entries" in error["message"] and "max_model_len is 64" in error["message"]
    assert error["param"] == "messages"
    assert (len(tok.render_threads), tok.num_encodes) == (renders, encodes)  # never rendered nor encoded


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_empty_messages_too_long_once_rendered_are_refused_before_tokenising(recorded, path):
    live, tok = recorded
    state = live.app.state.serve
    messages = [{"role": r, "content": ""} for r in ("user", "assistant") * 31] + [{"role": "user", "content": ""}]
    rendered = tok.inner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert len(messages) < state.max_model_len and len(rendered) > state.max_prompt_chars  # what this test needs
    renders, encodes = len(tok.render_threads), tok.num_encodes
    r = _post(live.base, path, {"model": "tiny-model", "max_tokens": 1, "messages": messages})
    assert r.status_code == 400, r.text
    assert "characters" in r.json()["error"]["message"] and "max_model_len" in r.json()["error"]["message"]
    assert tok.num_encodes == encodes  # refused before tokenising
    assert tok.render_threads[renders:] and all(t.startswith("astrai-prep") for t in tok.render_threads[renders:])


def test_a_request_that_can_never_be_admitted_is_a_400_not_a_429(recorded):
    live, _ = recorded
    capacity = live.app.state.serve.engine.capacity
    body = {"model": "tiny-model", "prompt": ["hi"] * 200, "n": 128, "max_tokens": 1}
    error = _error(_post(live.base, "/v1/completions", body), 400)
    assert f"{200 * 128} sequences" in error["message"] and f"at most {capacity} sequences" in error["message"]
    assert "KV cache of 2048 tokens" in error["message"] and "lower n" in error["message"]
    assert error["param"] == "n"
    # at the limit it runs (a request that fits only later keeps its 429: test_hardening's admission test)
    ok = _post(live.base, "/v1/completions", {"model": "tiny-model", "prompt": ["hi"] * (capacity // 8), "n": 8,
                                              "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == capacity
