"""A request -> SamplingParams (issue 26 item 5): same-named fields derived from the dataclass, OpenAI's
own spellings listed once in `RENAMED`, the grammar built only for constrained chat requests, and
the app's routes all on one router."""

from __future__ import annotations

import dataclasses

import pytest

from astrai.infer.sampling import SamplingParams
from astrai.serve.anthropic import MessagesRequest
from astrai.serve.protocol import ChatCompletionRequest, CompletionRequest
from astrai.serve.requests import RENAMED, SAME_NAMED, APIError, grammar_guide, to_sampling_params

VOCAB = 300
# a request value other than the default for every same-named field
SAME = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "frequency_penalty": 0.5,
        "presence_penalty": 0.25, "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [3, 4],
        "ignore_eos": True, "seed": 3, "n": 2, "logit_bias": {"5": 1.5}}
MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, **fields)


def test_every_sampling_field_is_same_named_or_renamed_and_both_openai_routes_declare_the_same_named():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(SAME_NAMED) | set(RENAMED) == names and not set(SAME_NAMED) & set(RENAMED)
    assert set(SAME) == set(SAME_NAMED), "give the new SamplingParams field a test value in SAME"
    for model in (ChatCompletionRequest, CompletionRequest):
        missing = [n for n in SAME_NAMED if n not in model.model_fields]
        assert not missing, f"{model.__name__} does not declare the SamplingParams fields {missing}"


@pytest.mark.parametrize("make", [lambda **f: _chat(**f), lambda **f: CompletionRequest(model="m", prompt="x", **f)])
def test_same_named_fields_reach_sampling_params_over_the_models_defaults(make):
    params = to_sampling_params(make(**SAME), {"temperature": 0.0, "top_k": 40}, VOCAB)
    expected = {**SAME, "logit_bias": {5: 1.5}}
    assert {n: getattr(params, n) for n in SAME} == expected
    silent = to_sampling_params(make(), {"temperature": 0.3, "top_k": 20}, VOCAB)
    assert (silent.temperature, silent.top_k, silent.top_p) == (0.3, 20, 1.0)


def test_openai_spellings_of_the_renamed_fields():
    chat = to_sampling_params(_chat(max_tokens=9, max_completion_tokens=5, logprobs=True, top_logprobs=3,
                                    stop=["", "END"]), {}, VOCAB)
    assert (chat.max_tokens, chat.logprobs, chat.prompt_logprobs, chat.stop) == (5, 3, None, ["END"])
    assert to_sampling_params(_chat(logprobs=True), {}, VOCAB).logprobs == 0
    plain = to_sampling_params(_chat(), {}, VOCAB)
    assert (plain.max_tokens, plain.logprobs, plain.stop) == (None, None, [])  # chat: up to max_model_len
    echo = to_sampling_params(CompletionRequest(model="m", prompt="x", logprobs=2, echo=True, stop="."), {}, VOCAB)
    assert (echo.max_tokens, echo.logprobs, echo.prompt_logprobs, echo.stop) == (16, 2, 2, ["."])
    no_echo = to_sampling_params(CompletionRequest(model="m", prompt="x", logprobs=2), {}, VOCAB)
    assert no_echo.prompt_logprobs is None


def test_anthropic_fields_and_only_declared_ones():
    req = MessagesRequest.model_validate({"model": "m", "messages": MESSAGES, "max_tokens": 4, "top_k": 7,
                                          "stop_sequences": ["\n\n"], "seed": 11, "min_p": 0.5})
    params = to_sampling_params(req, {}, VOCAB)
    assert (params.max_tokens, params.top_k, params.stop, params.n) == (4, 7, ["\n\n"], 1)
    # seed and min_p are not Messages API fields: ignored (and counted as such), never applied
    assert (params.seed, params.min_p) == (None, 0.0)


def test_a_value_sampling_params_refuses_is_a_400_naming_the_field():
    with pytest.raises(APIError) as e:
        to_sampling_params(_chat(min_tokens=5, max_tokens=2), {}, VOCAB)
    assert (e.value.status, e.value.param) == (400, "min_tokens")
    with pytest.raises(APIError) as e:
        to_sampling_params(_chat(stop_token_ids=[VOCAB]), {}, VOCAB)
    assert e.value.param == "stop_token_ids" and f"{VOCAB} tokens" in e.value.message


def test_the_grammar_compiler_is_built_only_for_constrained_requests():
    calls: list[str] = []

    class Compiler:
        def json_object(self):
            return "json-object guide"

    def compiler():
        calls.append("built")
        return Compiler()

    assert grammar_guide(_chat(), compiler) is None
    assert grammar_guide(_chat(response_format={"type": "text"}), compiler) is None
    assert calls == []
    assert grammar_guide(_chat(response_format={"type": "json_object"}), compiler) == "json-object guide"
    assert calls == ["built"]


def test_every_route_is_on_the_router():
    from astrai.serve import admin, tokenizer_routes
    from astrai.serve.app import ROUTES, router

    assert {r.path for r in [*router.routes, *admin.router.routes, *tokenizer_routes.router.routes]} == set(ROUTES)
    methods = {(r.path, m) for r in router.routes for m in r.methods}
    assert {("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/messages", "POST"),
            ("/health", "HEAD")} <= methods
