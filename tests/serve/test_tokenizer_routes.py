"""lm-eval's remote tokenizer routes (vLLM's shapes): `GET /tokenizer_info`, `POST /tokenize`,
`POST /detokenize`, directly and through lm-eval's own `local-completions` model with
`tokenizer_backend=remote` (and `auto`), which is given no tokenizer directory: every token it
counts comes from the server."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from astrai.data.tokenizer import load_tokenizer
from astrai.serve.app import ServeConfig
from tests.serve.conftest import API_KEY
from tests.serve.live import LiveApp

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def live(model_dir):
    config = ServeConfig(str(model_dir), served_model_name="tiny-model", api_key=API_KEY,
                         engine_kwargs={"max_model_len": MAX_MODEL_LEN, "kv_cache_tokens": 4096})
    with LiveApp(config) as app:
        app.wait_status("ready")
        yield app


def _post(live, path: str, body, headers=AUTH) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, str | bytes) else {"json": body}
    return httpx.post(live.base + path, headers=headers, timeout=30, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ------------------------------------------------------------------------------ the routes
def test_tokenizer_info_names_the_special_tokens_template_and_limits(live, model_dir):
    tok = load_tokenizer(model_dir)
    info = httpx.get(live.base + "/tokenizer_info", headers=AUTH, timeout=30).json()
    assert info["eos_token"] == tok.eos_token and info["eos_token_id"] == tok.eos_token_id
    assert info["bos_token"] == tok.bos_token and info["bos_token_id"] == tok.bos_token_id
    assert "pad_token" in info and "pad_token_id" in info
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["tokenizer_class"] == json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"]


def test_tokenize_a_prompt_and_a_chat_as_the_model_sees_them(live, model_dir):
    tok = load_tokenizer(model_dir)
    text = "the quick brown fox"
    out = _post(live, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"]) > 0
    assert out["max_model_len"] == MAX_MODEL_LEN and out["token_strs"] is None
    strs = _post(live, "/tokenize", {"prompt": text, "return_token_strs": True, "model": "tiny-model"}).json()
    assert "".join(strs["token_strs"]) == tok.decode(strs["tokens"], skip_special_tokens=False)
    chat = _post(live, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == tok.apply_chat_template(CHAT, add_generation_prompt=True)
    bare = _post(live, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok.apply_chat_template(CHAT, add_generation_prompt=False)
    assert bare["count"] < chat["count"]
    # the same ids the chat route counts as its prompt
    answer = _post(live, "/v1/chat/completions", {"model": "tiny-model", "messages": CHAT, "max_tokens": 1}).json()
    assert answer["usage"]["prompt_tokens"] == chat["count"]


class _GilHoldingEncode:
    """The served tokenizer, whose single-text `encode` (which holds the GIL for the whole call: a
    second for a megabyte, with the event loop's thread waiting) refuses a /tokenize text; the
    route must take `encode_batch`, which releases the GIL while it works."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert not text.startswith("LONG"), "a long /tokenize text went through encode, which holds the GIL"
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_long_tokenize_encodes_with_the_gil_released(model_dir):
    from astrai.serve.app import load_engine

    def loader(config):
        engine, tok = load_engine(config)
        return engine, _GilHoldingEncode(tok)

    config = ServeConfig(str(model_dir), api_key=API_KEY, engine_kwargs={"max_model_len": 64, "kv_cache_tokens": 512})
    text = "LONG " + "the quick brown fox " * 5000  # 100 KB
    with LiveApp(config, loader) as app:
        app.wait_status("ready")
        out = _post(app, "/tokenize", {"prompt": text, "return_token_strs": True})
        assert out.status_code == 200, out.text
    ids = load_tokenizer(model_dir).encode(text, add_special_tokens=True)
    body = out.json()
    assert body["tokens"] == ids and body["count"] == len(ids) and len(body["token_strs"]) == len(ids)


def test_detokenize_round_trips_and_names_an_id_outside_the_vocabulary(live, model_dir):
    tok = load_tokenizer(model_dir)
    ids = _post(live, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert _post(live, "/detokenize", {"tokens": ids}).json() == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    vocab = len(tok)
    for bad in (vocab, -1, 10**12):
        error = _error(_post(live, "/detokenize", {"tokens": [ids[0], bad]}), 400)
        assert f"tokens[1] is {bad}" in error["message"] and str(vocab - 1) in error["message"]
        assert error["param"] == "tokens"


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/tokenize", {}, 400, "exactly one of 'prompt'"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "exactly one of 'prompt'"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", '{"prompt": ', 422, "not valid JSON"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "other"),
    ("/detokenize", {"tokens": "1 2 3"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens[1]"),
    ("/detokenize", '[1, 2', 422, "not valid JSON"),
])
def test_bad_bodies_get_the_openai_error_body(live, path, body, status, needle):
    assert needle in _error(_post(live, path, body), status)["message"]


def test_the_api_key_guards_the_tokenizer_routes(live):
    assert _error(httpx.get(live.base + "/tokenizer_info", timeout=30), 401)["code"] == "invalid_api_key"
    assert _error(_post(live, "/tokenize", {"prompt": "hi"}, headers={}), 401)["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert _error(_post(live, "/detokenize", {"tokens": [1]}, headers=wrong), 401)["code"] == "invalid_api_key"


# ------------------------------------------------------------------------------ through lm-eval
DOCS = [{"question": "the quick brown", "choices": ["fox", "dog", "model"], "answer": 0},
        {"question": "hello world, this is a", "choices": ["tiny", "lazy"], "answer": 0},
        {"question": "numbers like", "choices": ["12345", "symbols", "the next token"], "answer": 2},
        {"question": "a language model predicts", "choices": ["the next token", "hello"], "answer": 1}]


def _task_dir(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        f"  cache_dir: {json.dumps(str(tmp_path / 'hf_cache'))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    return tmp_path


def _reference_loglikelihoods(model_dir) -> list[list[float]]:
    """Each choice's log-likelihood from the model itself (torch forward), with lm-eval's split of
    context and continuation: the whole text encoded once, the context's tokens cut off its front."""
    from astrai.model.hf import load_model

    tok, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    out = []
    for doc in DOCS:
        context = f"Q: {doc['question']}\nA:"
        scores = []
        for choice in doc["choices"]:
            whole, ctx = tok.encode(context + " " + choice), tok.encode(context)
            with torch.no_grad():
                logps = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)  # (T, V)
            scores.append(sum(logps[i - 1, whole[i]].item() for i in range(len(ctx), len(whole))))
        out.append(scores)
    return out


def _http_count(live, route: str) -> float:
    text = httpx.get(live.base + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("astrai_http_requests_total{") and f'route="{route}"' in line)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["remote", "auto"])
def test_lm_eval_scores_a_task_through_the_remote_tokenizer(live, model_dir, tmp_path, monkeypatch, backend):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # what local-completions sends to /v1/completions
    before = _http_count(live, "/tokenize")
    tasks = TaskManager(include_path=str(_task_dir(tmp_path)), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_mc"], task_manager=tasks, log_samples=True,
        model_args=f"model=tiny-model,base_url={live.base}/v1/completions,tokenizer_backend={backend},"
                   f"auth_token={API_KEY},max_length={MAX_MODEL_LEN},num_concurrent=1,max_retries=1")
    assert _http_count(live, "/tokenize") > before  # lm-eval counted its tokens with the server's
    expected = _reference_loglikelihoods(model_dir)
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    for sample, scores in zip(samples, expected):
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(scores, abs=1e-3)
    accuracy = sum(max(range(len(s)), key=s.__getitem__) == d["answer"] for s, d in zip(expected, DOCS)) / len(DOCS)
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(accuracy)
