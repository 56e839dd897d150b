"""The model's generation_config.json sampling defaults, applied like vLLM's: to every field a
request leaves unset, in `astrai generate` and `astrai serve`; `--generation_config none` ignores them."""

from __future__ import annotations

import json

import pytest

from astrai.infer import generate
from astrai.infer.defaults import generation_defaults, with_defaults
from astrai.infer.sampling import SamplingParams
from tests.infer.conftest import tiny_model

RECOMMENDED = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    from astrai.model.hf import save_model

    out = tmp_path_factory.mktemp("defaults_model")
    save_model(tiny_model(seed=3, vocab_size=320), out, tokenizer=tok)
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**generation, **RECOMMENDED, "do_sample": True,
                                                            "max_new_tokens": 99}))
    return out


def test_defaults_read_auto_none_and_a_directory(model_dir, tmp_path):
    assert generation_defaults(model_dir) == RECOMMENDED  # max_new_tokens and do_sample are not sampling fields
    assert generation_defaults(model_dir, "none") == {}
    assert generation_defaults(tmp_path, str(model_dir)) == RECOMMENDED
    assert generation_defaults(tmp_path) == {}  # no file: nothing
    with pytest.raises(ValueError, match="'auto', 'none' or a directory"):
        generation_defaults(model_dir, "vllm")


def test_a_field_the_request_sets_wins():
    merged = with_defaults({"temperature": 0.0, "top_p": None, "seed": None}, RECOMMENDED)
    assert merged == {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert with_defaults({"temperature": None}, {}) == {}


def _params_of_generate(monkeypatch, argv: list[str]) -> SamplingParams:
    seen = []
    monkeypatch.setattr(generate, "_generate", lambda llm, records, params, chat, use_tqdm: seen.append(params) or [])
    monkeypatch.setattr(generate, "LLM", lambda *a, **k: None)
    with pytest.raises(IndexError):  # the stub returns no outputs; the params are what we want
        generate.main(argv)
    return seen[0]


def test_generate_applies_the_model_defaults_unless_a_flag_is_given(model_dir, monkeypatch, capsys):
    base = ["--model", str(model_dir), "--prompt", "hi"]
    params = _params_of_generate(monkeypatch, base)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.3, 0.8, 20, 1.05)
    assert "temperature=0.3" in capsys.readouterr().err  # the user is told where the values came from
    params = _params_of_generate(monkeypatch, [*base, "--temperature", "0", "--top_k", "0"])
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.8, 0)
    params = _params_of_generate(monkeypatch, [*base, "--generation_config", "none"])
    defaults = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k) == (defaults.temperature, defaults.top_p, defaults.top_k)


def test_generate_end_to_end_with_defaults(model_dir, capsys):
    assert generate.main(["--model", str(model_dir), "--prompt", "Hello", "--max_tokens", "3", "--seed", "0",
                          "--ignore_eos", "--kv_cache_tokens", "256"]) == 0
    assert capsys.readouterr().out.strip()

