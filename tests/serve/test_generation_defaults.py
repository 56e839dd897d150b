"""`astrai serve` applies the model's generation_config.json sampling defaults to the fields a
request leaves unset (`--generation_config auto`, vLLM's behaviour) and none with `none`."""

from __future__ import annotations

import json

import pytest

from astrai.infer.sampling import SamplingParams
from tests.infer.conftest import tiny_model

RECOMMENDED = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from astrai.data.tokenizer_training import train_tokenizer
    from astrai.model.hf import save_model

    out = tmp_path_factory.mktemp("defaults_model")
    tok = train_tokenizer(["hello world, the quick brown fox"] * 20, vocab_size=300, out_dir=None)
    save_model(tiny_model(vocab_size=300), out, tokenizer=tok)
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**generation, **RECOMMENDED}))
    return out


def test_serve_applies_the_model_defaults_unless_the_request_sets_them(model_dir):
    from astrai.serve.app import ServeConfig, ServerState
    from astrai.serve.protocol import ChatCompletionRequest

    def params(generation_config: str, **fields):
        state = ServerState(ServeConfig(str(model_dir), generation_config=generation_config))
        state.vocab_size = 300
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
        return state.sampling_params(req, max_tokens=4, logprobs=None)

    got = params("auto")
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (0.3, 0.8, 20, 1.05)
    got = params("auto", temperature=0.0, top_p=1.0)
    assert (got.temperature, got.top_p, got.top_k) == (0.0, 1.0, 20)
    got, defaults = params("none"), SamplingParams()
    assert (got.temperature, got.top_p, got.top_k) == (defaults.temperature, defaults.top_p, defaults.top_k)


def test_serve_rejects_a_bad_generation_config_before_starting(model_dir, capsys):
    from astrai.serve.cli import main

    assert main(["--model", str(model_dir), "--generation_config", "nowhere"]) == 2
    assert "--generation_config 'nowhere'" in capsys.readouterr().err
