"""vLLM's token-in/token-out route `POST /inference/v1/generate` (serve/generate.py) on a live
server: the same tokens and behaviour log-probs as `/v1/completions` for the same ids and seed,
vLLM's shapes (`token_id:<id>` logprob entries, `prompt_logprobs`, usage), the stream, the way
verifiers' renderer client calls it (the openai client's `post` on the root URL), and refusals; and
prime-rl's `/v1/chat/completions/tokens`, a chat completion whose prompt comes as ids, as verifiers
0.3's training client posts a stitched later turn."""

from __future__ import annotations

import json

import httpx
import pytest

from astrai.data.tokenizer import load_tokenizer
from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROUTE = "/inference/v1/generate"


def _generate(server, body: dict, status: int = 200) -> dict:
    r = httpx.post(server.base_url + ROUTE, json=body, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def test_generate_matches_completions_and_has_vllm_shapes(server, client, model_dir):
    prompt = load_tokenizer(model_dir).encode("the quick brown fox", add_special_tokens=False)
    sampling = {"max_tokens": 6, "n": 2, "temperature": 0.7, "top_k": 20, "seed": 5, "logprobs": 1,
                "ignore_eos": True}
    out = _generate(server, {"model": "tiny-model", "token_ids": prompt, "request_id": "r-1",
                             "logprobs_mode": "processed_logprobs",
                             "sampling_params": {**sampling, "prompt_logprobs": 1, "detokenize": False}})
    ref = client.completions.create(model="tiny-model", prompt=prompt, max_tokens=6, n=2, temperature=0.7, seed=5,
                                    logprobs=0, extra_body={"top_k": 20, "ignore_eos": True, "return_token_ids": True,
                                                            "logprobs_mode": "processed_logprobs"})
    assert out["request_id"] == "r-1" and out["policy_version"] == 0 and out["prompt_token_ids"] == prompt
    assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == 12
    for choice, want in zip(out["choices"], sorted(ref.choices, key=lambda c: c.index)):
        assert choice["token_ids"] == want.token_ids and choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in want.token_ids]
        assert [e["logprob"] for e in content] == pytest.approx(want.logprobs.token_logprobs, abs=1e-6)
        assert all(len(e["top_logprobs"]) == 1 and e["top_logprobs"][0]["token"].startswith("token_id:")
                   for e in content)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(prompt)
    assert all(str(t) in entry for t, entry in zip(prompt[1:], out["prompt_logprobs"][1:]))


def test_generate_stream_and_the_renderer_clients_call(server, client, model_dir):
    prompt = load_tokenizer(model_dir).encode("hello world", add_special_tokens=False)
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 0,
                                                     "ignore_eos": True}}
    whole = _generate(server, body)
    # verifiers' renderer client: the openai client posting to the root route with the raw body
    raw = client.post(server.base_url + ROUTE, cast_to=httpx.Response, body=body)
    assert json.loads(raw.content)["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    with httpx.stream("POST", server.base_url + ROUTE, headers=AUTH, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert ids == whole["choices"][0]["token_ids"]
    assert [e["logprob"] for c in chunks for ch in c["choices"] for e in ch["logprobs"]["content"]] == \
        [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and all(c["policy_version"] == 0 for c in chunks)


def test_generate_refusals_name_the_field(server):
    cases = [({"token_ids": [100000]}, 400, "token_ids holds 100000"),
             ({"token_ids": []}, 400, "'token_ids'"),
             ({"token_ids": [-1]}, 400, "'token_ids[0]'"),
             ({"token_ids": [1], "sampling_params": {"max_tokens": 5000}}, 400, "max_model_len"),
             ({"token_ids": [1], "sampling_params": {"temperature": "hot"}}, 400, "sampling_params.temperature"),
             ({"token_ids": [1], "model": "other"}, 404, "serves 'tiny-model'")]
    for body, status, words in cases:
        assert words in _generate(server, body, status)["error"]["message"], body
    r = httpx.post(server.base_url + ROUTE, json={"token_ids": [1]}, timeout=60)
    assert r.status_code == 401


def test_chat_completions_tokens_is_a_chat_completion_of_the_given_ids(server, client, model_dir):
    messages = [{"role": "user", "content": "hello world"}]
    prompt = load_tokenizer(model_dir).apply_chat_template(messages, add_generation_prompt=True)
    sampling = {"max_completion_tokens": 6, "temperature": 0.7, "seed": 3, "logprobs": True}
    ref = client.chat.completions.create(model="tiny-model", messages=messages, **sampling,
                                         extra_body={"return_token_ids": True})
    # as verifiers 0.3 posts it: the openai client's `post` under /v1 with the chat body plus `tokens`
    raw = client.post("/chat/completions/tokens", cast_to=httpx.Response,
                      body={"model": "tiny-model", "messages": messages, "tokens": prompt, "return_token_ids": True,
                            **sampling})
    out = json.loads(raw.content)
    assert out["object"] == "chat.completion" and out["prompt_token_ids"] == prompt
    assert out["choices"][0]["token_ids"] == ref.choices[0].token_ids
    assert out["choices"][0]["message"]["content"] == ref.choices[0].message.content
    assert [e["logprob"] for e in out["choices"][0]["logprobs"]["content"]] == \
        pytest.approx([e.logprob for e in ref.choices[0].logprobs.content], abs=1e-6)
    bad = httpx.post(server.base_url + "/v1/chat/completions/tokens", headers=AUTH, timeout=60,
                     json={"model": "tiny-model", "messages": messages, "tokens": [100000]})
    assert bad.status_code == 400 and "tokens holds 100000" in bad.json()["error"]["message"]
