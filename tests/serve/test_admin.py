"""`POST /v1/load_weights` (serve/admin.py): off without --admin_key, only under --weights_dir, the
manifest verified, refusals are 4xx naming why while the server keeps serving, and a load lands
between engine steps: a request in flight finishes on its weights and reports their version; the
broadcast transport's `/v1/weight_group` describes the served weights and refuses a group it cannot
join (backend, dtype, tensors, an adapter's base) with a 400 naming why."""

from __future__ import annotations

import json
import threading

import httpx

from astrai.data.tokenizer import load_tokenizer
from astrai.model.hf import load_model, save_model
from astrai.model.transformer import CausalLM
from astrai.train.publish import publish_model_dir
from tests.serve.live import AUTH, GUARD_S, LiveServer, serve_config

ADMIN = {"Authorization": "Bearer admin-key"}


def _complete(base: str, prompt: list[int], max_tokens: int = 8) -> dict:
    body = {"model": "tiny-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=GUARD_S)
    assert r.status_code == 200, r.text
    return r.json()


def _load(base: str, path, version: int, headers=ADMIN) -> httpx.Response:
    return httpx.post(base + "/v1/load_weights", json={"path": str(path), "policy_version": version},
                      headers=headers, timeout=GUARD_S)


def test_admin_routes_are_off_without_a_key(model_dir, tmp_path):
    with LiveServer(serve_config(model_dir, weights_dir=str(tmp_path))) as live:
        r = _load(live.base, tmp_path, 1)
        assert r.status_code == 403 and "--admin_key" in r.json()["error"]["message"]


def test_load_weights_refusals_and_a_load_between_steps(model_dir, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    tok = load_tokenizer(model_dir)
    other = CausalLM(load_model(model_dir).config, seed=7)
    new_dir = publish_model_dir(weights / "v1", 1, lambda d: save_model(other, d, tokenizer=tok))
    unpublished = weights / "plain"
    save_model(other, unpublished, tokenizer=tok)
    prompt = tok.encode("the quick brown fox", add_special_tokens=False)
    config = serve_config(model_dir, admin_key="admin-key", weights_dir=str(weights))
    config.engine_kwargs.update(max_model_len=512, kv_cache_tokens=4096)
    with LiveServer(config) as live:
        before = _complete(live.base, prompt)
        assert before["policy_version"] == 0
        refusals = [(_load(live.base, new_dir, 1, headers=AUTH), 401, "admin key"),
                    (_load(live.base, model_dir, 1), 403, "outside"),
                    (_load(live.base, unpublished, 1), 400, "manifest.json")]
        for r, status, words in refusals:
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert _complete(live.base, prompt)["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]

        # a long request in flight when the load comes: it ends on the old weights, all its tokens
        body = {"model": "tiny-model", "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        loaded: list[httpx.Response] = []
        chunks = []
        with httpx.stream("POST", live.base + "/v1/completions", json=body, headers=AUTH, timeout=GUARD_S) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(line)
                    if len(chunks) == 1:
                        thread = threading.Thread(target=lambda: loaded.append(_load(live.base, new_dir, 1)))
                        thread.start()
        thread.join(GUARD_S)
        parsed = [json.loads(c[6:]) for c in chunks]
        assert sum(len(c["choices"][0]["token_ids"]) for c in parsed if c["choices"]) == 400
        assert parsed[-1]["policy_version"] == 0
        assert loaded[0].status_code == 200 and loaded[0].json()["policy_version"] == 1
        after = _complete(live.base, prompt)
        assert after["policy_version"] == 1
        assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
        assert httpx.get(live.base + "/v1/models", headers=AUTH).json()["data"][0]["policy_version"] == 1
        # back to the first weights at an older version (a resumed trainer): the first outputs again
        first = publish_model_dir(weights / "v0", 0, lambda d: save_model(load_model(model_dir), d, tokenizer=tok))
        assert _load(live.base, first, 0).status_code == 200
        again = _complete(live.base, prompt)
        assert again["policy_version"] == 0 and again["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_broadcast_refusals_name_why(model_dir, tmp_path):
    with LiveServer(serve_config(model_dir, admin_key="admin-key", weights_dir=str(tmp_path))) as live:
        r = httpx.post(live.base + "/v1/load_weights", json={"policy_version": 1, "transport": "broadcast"},
                       headers=ADMIN, timeout=GUARD_S)
        assert r.status_code == 409 and "/v1/weight_group" in r.json()["error"]["message"]
        shapes = {name: list(t.shape) for name, t in load_model(model_dir).state_dict().items()}
        shapes["lm_head.weight"] = [1, 1]
        group = {"master_addr": "127.0.0.1", "master_port": 1, "rank": 1, "world_size": 2, "tensors": shapes}
        r = httpx.post(live.base + "/v1/weight_group", json=group, headers=ADMIN, timeout=GUARD_S)
        assert r.status_code == 400 and "lm_head.weight" in r.json()["error"]["message"]
        info = httpx.get(live.base + "/v1/weight_group", headers=ADMIN, timeout=GUARD_S).json()
        assert info["device"] == "cpu" and info["backends"] == ["gloo"] and info["backend"] is None
        del shapes["lm_head.weight"]
        adapter = {"base_model": str(model_dir), "scaling": 2.0}
        layer = "model.layers.0.self_attn.q_proj."
        refusals = [({"backend": "nccl"}, "cannot join an nccl weight group: its weights are on cpu"),
                    ({"dtype": "int8"}, "dtype 'int8' is not a weight dtype"),
                    ({"tensors": {"model.nope.lora_A": [2, 32], "model.nope.lora_B": [32, 2]}, "adapter": adapter},
                     "first differing tensor: model.nope.lora_A"),
                    ({"tensors": {layer + "lora_A": [2, 32], layer + "lora_B": [32, 2]},
                      "adapter": {**adapter, "base_model": str(model_dir.parent)}}, "neither the served model")]
        for change, words in refusals:
            r = httpx.post(live.base + "/v1/weight_group", json={**group, "tensors": shapes, **change}, headers=ADMIN,
                           timeout=GUARD_S)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert _complete(live.base, [1, 2, 3])["policy_version"] == 0  # still serving
