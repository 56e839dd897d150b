"""Every error status of the server, each with OpenAI's error body, and the server healthy after."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY, MAX_MODEL_LEN, MAX_REQUEST_BYTES

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _post(server, path: str, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, headers=headers, timeout=30, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(autouse=True)
def _server_stays_healthy(server):
    yield
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = _post(server, "/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"n": "3"}, "n"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),     # out of the vocabulary: checked by SamplingParams
    ({"max_tokens": 10**6}, "max_tokens"),
])
def test_400_names_the_parameter(server, body, param):
    error = _error(_post(server, "/v1/chat/completions", json={**CHAT, **body}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_400_prompt_longer_than_max_model_len_names_both_numbers(server):
    long = " ".join(["fox"] * (3 * MAX_MODEL_LEN))
    error = _error(_post(server, "/v1/completions", json={"model": "tiny-model", "prompt": long}), 400)
    num_tokens = int(error["message"].split("prompt has ")[1].split()[0])
    assert num_tokens > MAX_MODEL_LEN and f"max_model_len is {MAX_MODEL_LEN}" in error["message"]
    error = _error(_post(server, "/v1/completions", json={"model": "tiny-model", "prompt": [5, 10**6]}), 400)
    assert error["param"] == "prompt" and "1000000" in error["message"]


def test_400_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-model", messages=[{"role": "user", "content": "x"}], top_p=7)
    assert info.value.status_code == 400 and "top_p" in str(info.value)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_401_missing_or_wrong_key(server, headers):
    assert _error(_post(server, "/v1/chat/completions", headers=headers, json=CHAT), 401)["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/v1/models", headers=headers).status_code == 401
    _error(httpx.get(server.base_url + "/openapi.json", headers=headers), 401)  # the schema too
    assert httpx.get(server.base_url + "/openapi.json", headers=AUTH).json()["info"]["title"] == "astrai"


def test_404_unknown_model_and_route(server):
    error = _error(_post(server, "/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    _error(_post(server, "/v1/embeddings", json={}), 404)
    _error(httpx.get(server.base_url + "/nope"), 404)


def test_413_body_too_large(server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 10)}]}
    assert _error(_post(server, "/v1/chat/completions", json=big), 413)["code"] == "request_too_large"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe"])
def test_422_malformed_json(server, raw):
    response = _post(server, "/v1/chat/completions", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert _error(response, 422)["code"] == "invalid_json"


def test_bad_requests_do_not_disturb_a_running_stream(server, client):
    import threading

    kwargs = dict(model="tiny-model", messages=[{"role": "user", "content": "steady"}], max_tokens=200,
                  temperature=0, extra_body={"ignore_eos": True})
    reference = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed: list[str] = []
    thread = threading.Thread(target=lambda: streamed.extend(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices))
    thread.start()
    statuses = set()
    while thread.is_alive():
        statuses.add(_post(server, "/v1/chat/completions", json={**CHAT, "n": -1}).status_code)
        statuses.add(_post(server, "/v1/completions", content=b"{oops").status_code)
        statuses.add(_post(server, "/v1/completions", json={"model": "tiny-model", "prompt": [10**7]}).status_code)
    thread.join()
    assert statuses == {400, 422}
    assert "".join(streamed) == reference
