"""A constrained request cannot stall the engine thread: its grammar is compiled once, on the
prep pool, before the request reaches the engine; each of its n samples starts from a copy of
that compiled matcher; and grammar size x n is bounded (`max_guide_bytes`, a 400 naming it).

Compiles are counted by wrapping llguidance's matcher constructor (calls, not time), and the
thread each ran on is recorded. The stall test is driven by events: a compile held open by the
test while an unrelated request completes."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import llguidance
import pytest

from astrai.data.tokenizer import load_tokenizer
from astrai.infer.guided import GuideCompiler
from tests.serve.live import AUTH, GUARD_S, LiveServer, serve_config

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def chat(n: int, schema: dict[str, Any] | None = SCHEMA, max_tokens: int = 24) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": max_tokens, "n": n, "temperature": 1.0, "seed": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return body


class CountingMatcher:
    """Stands in for `llguidance.LLMatcher`: counts constructions (compiles) and their threads;
    `hold` makes a compile wait until the test releases it."""

    def __init__(self) -> None:
        self.real = llguidance.LLMatcher
        self.threads: list[str] = []
        self.hold: threading.Event | None = None
        self.started = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        if self.hold is not None:
            assert self.hold.wait(GUARD_S), "the test never released the compile (guard)"
        return self.real(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the static grammar_from_* / validate_* helpers
        return getattr(self.real, name)


@pytest.fixture()
def matcher(monkeypatch: pytest.MonkeyPatch) -> CountingMatcher:
    counting = CountingMatcher()
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    return counting


def post(live: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.base + "/v1/chat/completions", json=body, headers=AUTH, timeout=GUARD_S)


def guide_size(model_dir: Path, schema: dict[str, Any]) -> int:
    tok = load_tokenizer(model_dir)
    return GuideCompiler(tok, 384).json_schema(schema).size


def test_the_grammar_is_compiled_once_off_the_engine_thread_for_n_samples(model_dir: Path, matcher):
    with LiveServer(serve_config(model_dir)) as live:
        response = post(live, chat(n=6))
        assert response.status_code == 200, response.text
        assert len(matcher.threads) == 1, matcher.threads  # one compile for 6 samples
        assert matcher.threads[0].startswith("astrai-prep"), matcher.threads
        choices = response.json()["choices"]
        assert len(choices) == 6
        for choice in choices:  # every sample followed the grammar with its own matcher
            if choice["finish_reason"] == "stop":
                assert isinstance(json.loads(choice["message"]["content"])["ok"], bool)
        assert any(c["finish_reason"] == "stop" for c in choices)


def test_an_unrelated_request_finishes_while_a_grammar_compiles(model_dir: Path, matcher):
    matcher.hold = threading.Event()
    with LiveServer(serve_config(model_dir)) as live:
        guided: dict[str, httpx.Response] = {}
        worker = threading.Thread(target=lambda: guided.update(r=post(live, chat(n=4))), daemon=True)
        worker.start()
        try:
            assert matcher.started.wait(GUARD_S), "the grammar compile never started (guard)"
            plain = post(live, chat(n=1, schema=None, max_tokens=20))  # while the compile is held
            assert plain.status_code == 200, plain.text
            assert "r" not in guided  # the guided request is still compiling
        finally:
            matcher.hold.set()
            worker.join(GUARD_S)
        assert guided["r"].status_code == 200, guided["r"].text
        assert len(matcher.threads) == 1


def test_grammar_size_times_n_is_bounded_with_a_clear_400(model_dir: Path, matcher):
    size = guide_size(model_dir, SCHEMA)
    matcher.threads.clear()
    with LiveServer(serve_config(model_dir, max_guide_bytes=3 * size)) as live:
        assert post(live, chat(n=3)).status_code == 200
        error = post(live, chat(n=4)).json()["error"]
        assert error["param"] == "n"
        assert "max_guide_bytes" in error["message"] and "lower n to at most 3" in error["message"]
        assert "--max_guide_bytes" in error["message"]
        # a grammar over the limit even for n = 1 is refused before it is compiled
        matcher.threads.clear()
        big = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
                         for i in range(200)]}
        response = post(live, chat(n=1, schema=big))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format" and "max_guide_bytes" in error["message"]
        assert matcher.threads == []
