"""Request validation: OpenAI field names, unknown fields ignored, bad values name the parameter."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from astrai.serve.protocol import ChatCompletionRequest, CompletionRequest
from astrai.serve.requests import _loc_to_param
from astrai.serve.responses import chat_logprobs, completion_logprobs, logprob_value

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _param_of(model: type, body: dict) -> str | None:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return _loc_to_param(info.value.errors()[0]["loc"])


def test_unknown_fields_are_ignored_and_ints_are_floats():
    req = ChatCompletionRequest.model_validate({**CHAT, "temperature": 1, "parallel_tool_calls": True})
    assert req.temperature == 1.0 and isinstance(req.temperature, float)
    assert req.requested_max_tokens() is None


def test_max_completion_tokens_wins_over_max_tokens():
    req = ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 5, "max_completion_tokens": 7})
    assert req.requested_max_tokens() == 7


@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": "0.5"}, "temperature"),      # strict: no string -> float coercion
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"stream": 1}, "stream"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"top_logprobs": 3}, "top_logprobs"),        # needs logprobs=true
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream=true
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
])
def test_chat_bad_values_name_the_parameter(extra, param):
    assert _param_of(ChatCompletionRequest, {**CHAT, **extra}) == param


def test_content_parts_are_joined_and_developer_is_system():
    req = ChatCompletionRequest.model_validate({**CHAT, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].to_template() == {"role": "system", "content": "ab"}


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt_list() == expected


@pytest.mark.parametrize("prompt", ["", [], [[]], [1, "a"], 5])
def test_completion_bad_prompts(prompt):
    assert _param_of(CompletionRequest, {"model": "m", "prompt": prompt}) == "prompt"


def test_logprob_rendering_from_engine_entries():
    from astrai.infer.sampling import Logprob

    entry = {7: Logprob(-0.5, 2), 3: Logprob(-0.2, 1), 9: Logprob(float("-inf"), 3)}
    assert logprob_value(entry, 7) == -0.5
    assert logprob_value(float("-inf"), 1) == -9999.0  # -inf is not JSON
    text = {7: "b", 3: "a", 9: "c"}.__getitem__
    chat = chat_logprobs([7], [entry], 2, text)["content"][0]
    assert chat["token"] == "b" and chat["bytes"] == [98]
    assert [t["token"] for t in chat["top_logprobs"]] == ["a", "b"]  # by rank
    legacy = completion_logprobs([7, 3], [entry, -1.0], 1, text, text_offset=4)
    assert legacy["tokens"] == ["b", "a"] and legacy["token_logprobs"] == [-0.5, -1.0]
    assert legacy["top_logprobs"][0] == {"a": -0.2, "b": -0.5}  # top-1 plus the chosen token
    assert legacy["text_offset"] == [4, 5]
