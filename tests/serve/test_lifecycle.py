"""Load, concurrency, disconnects and shutdown: /health while loading, 32 streams, KV freed, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest

from astrai.serve.app import ServeConfig, create_app, load_engine
from tests.serve.conftest import API_KEY, ServerProcess, free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_32_concurrent_streams_all_complete(server):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model="tiny-model", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=16,
            temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        finishes, usage = [], None
        async for chunk in stream:
            finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        return finishes, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert [f for f, _ in results] == [["length"]] * 32
    assert all(u.completion_tokens == 16 for _, u in results)
    assert _metric(server.base_url, "astrai_num_requests_running") == 0


def test_disconnect_aborts_and_frees_kv(server):
    before = _metric(server.base_url, "astrai_requests_aborted_by_disconnect_total")
    tokens_before = _metric(server.base_url, "astrai_generation_tokens_total")
    body = {"model": "tiny-model", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 900,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=30) as response:
        lines = response.iter_lines()
        chunks = [next(lines) for _ in range(6)]
        assert all(c.startswith("data: {") or c == "" for c in chunks)
        # mid-stream: the request holds KV blocks (metrics refresh every few ms while busy)
        deadline = time.monotonic() + 60  # a guard: the property is the metric, not the time
        while _metric(server.base_url, "astrai_kv_cache_usage_perc") == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _metric(server.base_url, "astrai_kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 60  # a guard: the property is the metric, not the time
    while time.monotonic() < deadline:
        if (_metric(server.base_url, "astrai_num_requests_running") == 0
                and _metric(server.base_url, "astrai_kv_cache_usage_perc") == 0):
            break
        time.sleep(0.05)
    assert _metric(server.base_url, "astrai_num_requests_running") == 0
    assert _metric(server.base_url, "astrai_kv_cache_free_blocks") == _metric(server.base_url,
                                                                             "astrai_kv_cache_total_blocks")
    assert _metric(server.base_url, "astrai_requests_aborted_by_disconnect_total") == before + 1
    # it was cut short, not run to its 900 tokens
    assert 6 <= _metric(server.base_url, "astrai_generation_tokens_total") - tokens_before < 900


def test_health_is_503_while_loading(model_dir):
    import uvicorn

    release = threading.Event()

    def slow_loader(config):
        release.wait(30)
        return load_engine(config)

    config = ServeConfig(str(model_dir), engine_kwargs={"max_model_len": 64, "kv_cache_tokens": 1024})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config, slow_loader), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60  # a guard only
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
        chat = httpx.post(base + "/v1/chat/completions", json={"model": "tiny-model", "messages": []})
        assert chat.status_code == 503
        release.set()
        deadline = time.monotonic() + 60  # a guard only
        while httpx.get(base + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(base + "/health").status_code == 200
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


@pytest.mark.slow
def test_sigterm_aborts_in_flight_and_exits_0(model_dir):
    proc = ServerProcess(model_dir, "--shutdown_timeout", "1.5").start()
    body = {"model": "tiny-model", "messages": [{"role": "user", "content": "long"}], "max_tokens": 1000,
            "stream": True, "ignore_eos": True}
    events: list[str] = []
    with httpx.stream("POST", proc.base_url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=30) as response:
        lines = response.iter_lines()
        events += [next(lines) for _ in range(4)]
        proc.proc.send_signal(15)
        events += [line for line in lines if line]
    assert proc.proc.wait(timeout=20) == 0  # (the timeout only guards a hang; no speed is asserted)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] in ("abort", "length")
    with pytest.raises(httpx.TransportError):
        httpx.get(proc.base_url + "/health", timeout=2)


def test_non_streaming_client_that_gives_up_aborts_its_request(server):
    before = _metric(server.base_url, "astrai_requests_aborted_by_disconnect_total")
    body = {"model": "tiny-model", "messages": [{"role": "user", "content": "wait"}], "max_tokens": 900,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=0.3)
    deadline = time.monotonic() + 60  # a guard: the property is the metric, not the time
    while time.monotonic() < deadline and not (
            _metric(server.base_url, "astrai_requests_aborted_by_disconnect_total") == before + 1
            and _metric(server.base_url, "astrai_kv_cache_usage_perc") == 0):
        time.sleep(0.05)
    assert _metric(server.base_url, "astrai_requests_aborted_by_disconnect_total") == before + 1
    assert _metric(server.base_url, "astrai_num_requests_running") == 0
    assert _metric(server.base_url, "astrai_kv_cache_usage_perc") == 0
