"""The server's startup summary and its access log: one line per request, with useful fields (issue 21)."""

from __future__ import annotations

import logging
import re
import time

import pytest
from fastapi.testclient import TestClient

from astrai.serve.app import ServeConfig, create_app
from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ACCESS = re.compile(r'^(\S+) "(\w+) (\S+)" (\d{3}|-) (\d+\.\d) ms$')


@pytest.fixture
def client(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="astrai.serve")
    config = ServeConfig(str(model_dir), served_model_name="tiny-model", api_key=API_KEY,
                         engine_kwargs={"max_model_len": 64, "kv_cache_tokens": 2048, "enable_prefix_caching": False})
    app = create_app(config)
    with TestClient(app) as c:
        deadline = time.monotonic() + 60  # a guard against a hung load, not the property under test
        while app.state.serve.status == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert app.state.serve.status == "ready", app.state.serve.error
        yield c


def access_lines(caplog) -> list[tuple[str, ...]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "astrai.serve.access"]
    assert all(ACCESS.match(line) for line in lines), lines
    return [ACCESS.match(line).groups() for line in lines]


def test_startup_summary_names_model_dtype_device_kv_cache_and_limits(client, caplog, model_dir):
    records = caplog.get_records("setup") + caplog.records  # the model loads while the fixture waits
    lines = [r.getMessage() for r in records if r.getMessage().startswith("serving ")]
    assert len(lines) == 1
    fixed = (f"serving 'tiny-model' from {model_dir}: dtype float32, device cpu; KV cache 2048 tokens in "
             "128 blocks of 16; max_model_len 64; max_num_seqs 256; prefix caching off, chunked prefill on; ")
    assert lines[0].startswith(fixed), lines[0]
    # what the load-time probes chose depends on the machine (threads are probed only while torch has
    # more than one); that they are reported does not
    assert re.fullmatch(r"step budget \d+ tokens, prefill while decoding at most \d+ tokens; torch threads \d+; "
                        r"probed: chunk \d+ from the measured step cost(, \d+ thread\(s\))?, linear weights (out_in|in_out)",
                        lines[0][len(fixed):]), lines[0]


def test_one_access_line_per_request_with_method_path_status_and_latency(client, caplog):
    caplog.clear()
    chat = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", json=chat, headers=AUTH).status_code == 200
    assert client.post("/v1/chat/completions", json=chat).status_code == 401  # no key
    assert client.post("/v1/completions", json={"model": "tiny-model"}, headers=AUTH).status_code in (400, 422)
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    got = [(method, path, status) for _, method, path, status, _ in access_lines(caplog)]
    assert got[:3] == [("GET", "/health", "200"), ("POST", "/v1/chat/completions", "200"),
                       ("POST", "/v1/chat/completions", "401")]
    assert got[3][:2] == ("POST", "/v1/completions") and got[3][2] in ("400", "422")
    assert got[4] == ("POST", "/v1/chat/completions", "200")  # the stream: logged once, when it ended
    assert len(got) == 5
    assert all(client_addr != "-" for client_addr, *_ in access_lines(caplog))
