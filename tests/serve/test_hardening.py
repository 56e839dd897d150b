"""No single request may stall the others: limits, the prep pool, admission, body timeout, and
the small protocol edges (HEAD, 405 Allow, deep JSON, SSE line breaks, keys, failed loads).

Moments are driven by events (a tokenizer that blocks until released, a stream's first chunk),
never by how long something took; deadlines appear only as guards against a hang."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from astrai.serve import cli as serve_app
from astrai.serve.app import ServeConfig, load_engine
from astrai.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from astrai.serve.render import sse
from tests.serve.conftest import API_KEY
from tests.serve.live import AUTH, LiveApp

CHAT = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENGINE = {"max_model_len": 64, "kv_cache_tokens": 2048}


def _post(base: str, path: str, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(base + path, headers=headers, timeout=30, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _metric(base: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", httpx.get(base + "/metrics").text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


# ---------------------------------------------------------------------- request limits (shared server)
@pytest.mark.parametrize(("body", "needle"), [
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, f"at most {MAX_STOP_STRINGS} stop strings"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, f"at most {MAX_STOP_CHARS} characters"),
])
def test_stop_lists_are_bounded(server, body, needle):
    error = _error(_post(server.base_url, "/v1/chat/completions", json={**CHAT, **body}), 400)
    assert error["param"] == "stop" and needle in error["message"]
    ok = {**CHAT, "stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}
    assert _post(server.base_url, "/v1/chat/completions", json=ok).status_code == 200


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_out_of_range_is_a_400_naming_seed(server, seed):
    assert _error(_post(server.base_url, "/v1/completions", json={"model": "tiny-model", "prompt": "a",
                                                                   "seed": seed}), 400)["param"] == "seed"


@pytest.mark.parametrize("raw", [b"[" * 30_000 + b"]" * 30_000,
                                 json.dumps({**CHAT, "extra": json.loads("[" * 100 + "]" * 100)}).encode()])
def test_deeply_nested_json_is_a_422(server, raw):
    response = _post(server.base_url, "/v1/chat/completions", content=raw,
                     headers={**AUTH, "Content-Type": "application/json"})
    assert _error(response, 422)["code"] == "invalid_json"
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_head_health_and_405_with_allow(server):
    head = httpx.head(server.base_url + "/health")
    assert head.status_code == 200 and head.content == b""
    wrong = httpx.get(server.base_url + "/v1/chat/completions", headers=AUTH)
    error = _error(wrong, 405)
    assert wrong.headers["allow"] == "POST" and "allowed: POST" in error["message"]
    assert httpx.delete(server.base_url + "/health").headers["allow"] in ("GET, HEAD", "HEAD, GET")


def test_sse_escapes_unicode_line_separators():
    line = sse({"text": "a\u2028b\u2029c\u0085d\ne"})
    body = line[len("data: "):-2]
    assert body.splitlines() == [body]  # str.splitlines breaks on all three; the event stays one line
    assert json.loads(body)["text"] == "a\u2028b\u2029c\u0085d\ne"
    assert line.endswith("\n\n") and line.count("\n") == 2


# ---------------------------------------------------------------------- off the event loop
class _BlockingTokenizer:
    """Wraps the real tokenizer; encoding a text that starts with BIG blocks until released."""

    def __init__(self, inner: Any, events: list[str]):
        self.inner, self.events = inner, events
        self.started, self.release = threading.Event(), threading.Event()
        self.num_encodes = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.num_encodes += 1
        if text.startswith("BIG"):
            self.events.append("encode started")
            self.started.set()
            assert self.release.wait(60)
            self.events.append("encode finished")
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_health_answers_while_a_large_request_is_being_tokenised(model_dir):
    events: list[str] = []
    holder: dict[str, _BlockingTokenizer] = {}

    def loader(config):
        engine, tok = load_engine(config)
        holder["tok"] = _BlockingTokenizer(tok, events)
        return engine, holder["tok"]

    with LiveApp(ServeConfig(str(model_dir), engine_kwargs=ENGINE), loader) as live:
        live.wait_status("ready")
        tok = holder["tok"]
        result: dict[str, httpx.Response] = {}
        big = {"model": "tiny-model", "prompt": "BIG " + "fox " * 100, "max_tokens": 1}
        worker = threading.Thread(target=lambda: result.update(r=_post(live.base, "/v1/completions", json=big)))
        worker.start()
        assert tok.started.wait(30)
        health = httpx.get(live.base + "/health", timeout=10)  # would hang if encoding held the loop
        events.append(f"health {health.status_code}")
        small = _post(live.base, "/v1/completions", json={"model": "tiny-model", "prompt": "hi", "max_tokens": 1})
        events.append(f"small {small.status_code}")
        tok.release.set()
        worker.join(60)
        assert events == ["encode started", "health 200", "small 200", "encode finished"]
        assert result["r"].status_code == 400 and "max_model_len" in result["r"].json()["error"]["message"]

        # far too many characters to fit: refused before the tokenizer sees it
        before = tok.num_encodes
        state = live.app.state.serve
        huge = {"model": "tiny-model", "prompt": "y" * (state.max_prompt_chars + 1)}
        error = _error(_post(live.base, "/v1/completions", json=huge), 400)
        assert "characters" in error["message"] and error["param"] == "prompt"
        assert tok.num_encodes == before


# ---------------------------------------------------------------------- admission bound
class _GatedEngine:
    """The real engine, except that it claims to have nothing to run until the gate opens: requests
    are accepted, but none steps (or finishes) until the test says."""

    def __init__(self, inner: Any):
        self.inner, self.gate = inner, threading.Event()

    def has_unfinished_requests(self) -> bool:
        return self.gate.is_set() and self.inner.has_unfinished_requests()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_full_waiting_queue_is_a_429_with_retry_after_counted_in_metrics(model_dir):
    holder: dict[str, _GatedEngine] = {}

    def loader(config):
        engine, tok = load_engine(config)
        holder["engine"] = _GatedEngine(engine)
        return holder["engine"], tok

    config = ServeConfig(str(model_dir), engine_kwargs={**ENGINE, "max_num_seqs": 1}, max_waiting=1)
    chat = {**CHAT, "max_tokens": 8, "stream": True}
    with LiveApp(config, loader) as live:
        live.wait_status("ready")
        gated = holder["engine"]
        with httpx.Client(base_url=live.base, headers=AUTH, timeout=30) as client, \
                client.stream("POST", "/v1/chat/completions", json=chat) as first, \
                client.stream("POST", "/v1/chat/completions", json=chat) as second:
            # a chat stream's first chunk (the role) follows the engine accepting the request:
            # now 1 sequence may run and 1 waits, and no step has run yet
            lines = [first.iter_lines(), second.iter_lines()]
            assert all(next(it).startswith("data: ") for it in lines)
            refused = client.post("/v1/completions", json={"model": "tiny-model", "prompt": "x", "max_tokens": 1})
            error = _error(refused, 429)
            assert refused.headers["retry-after"] == "1" and error["code"] == "queue_full"
            assert "max_waiting" in error["message"]
            assert _metric(live.base, "astrai_requests_rejected_queue_full_total") == 1
            gated.gate.set()
            live.app.state.serve.engine.abort([])  # wakes the engine thread, which now finds work
            for it in lines:
                assert [line for line in it if line][-1] == "data: [DONE]"
        assert live.app.state.serve.engine.num_admitted == 0
        ok = _post(live.base, "/v1/completions", json={"model": "tiny-model", "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


# ---------------------------------------------------------------------- slow and vanishing bodies
def _raw_request(port: int, headers: str, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(headers.encode() + b"\r\n" + body)
    return sock


def _read_response(sock: socket.socket) -> str:
    """Headers and the whole Content-Length body (they may come in separate packets)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode()


def _content_length(data: bytes) -> int:
    match = re.search(rb"(?i)content-length:\s*(\d+)", data.split(b"\r\n\r\n", 1)[0])
    return int(match.group(1)) if match else 0


def test_body_that_never_arrives_is_a_408(model_dir):
    config = ServeConfig(str(model_dir), engine_kwargs=ENGINE, body_timeout=0.5)
    with LiveApp(config) as live:
        live.wait_status("ready")
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n")
        with _raw_request(live.port, head, b'{"model": ') as sock:
            reply = _read_response(sock)
        assert reply.startswith("HTTP/1.1 408"), reply
        assert '"code":"request_timeout"' in reply.replace(" ", "")
        assert httpx.get(live.base + "/health").status_code == 200


def test_client_leaving_mid_body_logs_one_line(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="astrai.serve")
    with LiveApp(ServeConfig(str(model_dir), engine_kwargs=ENGINE)) as live:
        live.wait_status("ready")
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n"
        sock = _raw_request(live.port, head, b'{"model": "tiny')
        sock.close()
        deadline = time.monotonic() + 30  # guard only
        while not any("disconnected" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(live.base + "/health").status_code == 200
    ours = [r for r in caplog.records if r.name.startswith("astrai")]
    gone = [r for r in ours if "disconnected" in r.getMessage()]
    assert len(gone) == 1 and "15 of 5000" in gone[0].getMessage() and gone[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ---------------------------------------------------------------------- failed load, keys, binding
def test_models_and_health_report_not_ready_when_the_model_failed_to_load(tmp_path):
    def broken(config):
        raise ValueError("model.safetensors is damaged and cannot be read")

    with LiveApp(ServeConfig(str(tmp_path)), broken) as live:
        live.wait_status("failed")
        health = httpx.get(live.base + "/health")
        assert _error(health, 503)["type"] == "service_unavailable" and "damaged" in health.json()["error"]["message"]
        assert httpx.head(live.base + "/health").status_code == 503
        assert _error(httpx.get(live.base + "/v1/models"), 503)["message"].startswith("the model is failed")


def test_empty_api_key_is_an_error(model_dir, monkeypatch, capsys):
    monkeypatch.setenv("ASTRAI_API_KEY", "")
    assert serve_app.main(["--model", str(model_dir)]) == 2
    assert "API key is empty" in capsys.readouterr().err
    monkeypatch.delenv("ASTRAI_API_KEY")
    assert serve_app.main(["--model", str(model_dir), "--api_key", " "]) == 2


class _NoRun:
    def __init__(self, config):
        self.started = False

    def run(self):
        pass


@pytest.mark.parametrize(("host", "key", "warned"), [("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                                                      ("127.0.0.1", None, False), ("::1", None, False)])
def test_non_loopback_bind_without_key_warns(model_dir, monkeypatch, capsys, host, key, warned):
    monkeypatch.delenv("ASTRAI_API_KEY", raising=False)
    monkeypatch.setattr(serve_app, "_graceful_server_class", lambda state: _NoRun)
    monkeypatch.setattr("signal.signal", lambda *a: None)
    serve_app.main(["--model", str(model_dir), "--host", host] + (["--api_key", key] if key else []))
    err = capsys.readouterr().err
    assert ("without an API key" in err) == warned


def test_unknown_or_unavailable_device_is_one_line(model_dir, capsys):
    import torch

    bad = ["bogus"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        assert serve_app.main(["--model", str(model_dir), "--device", device]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"device '{device}'" in err


def test_damaged_checkpoint_manifest_is_one_line(model_dir, tmp_path, capsys):
    import shutil

    from astrai.model.manifest import MANIFEST

    ckpt = Path(shutil.copytree(model_dir, tmp_path / "ckpt"))
    entries = {p.name: {"size": p.stat().st_size + (1 if p.name == "model.safetensors" else 0), "sha256": "0"}
               for p in ckpt.iterdir()}
    (ckpt / MANIFEST).write_text(json.dumps({"format": "astrai-checkpoint", "version": 1, "step": 1,
                                             "files": entries}))
    assert serve_app.main(["--model", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors has" in err and "truncated" in err
