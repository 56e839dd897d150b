"""The official `openai` client against a live `astrai serve`: text, streaming, usage, sampling."""

from __future__ import annotations

import pytest

from astrai.data.tokenizer import load_tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _stream_chat(client, **kwargs):
    chunks = list(client.chat.completions.create(model="tiny-model", messages=MESSAGES, stream=True, **kwargs))
    texts: dict[int, str] = {}
    finishes: dict[int, list[tuple[int, str]]] = {}
    for i, chunk in enumerate(chunks):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append((i, choice.finish_reason))
    return chunks, texts, finishes


def test_greedy_stream_equals_non_stream_and_usage_is_exact(client, model_dir):
    full = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=20, **GREEDY)
    chunks, texts, finishes = _stream_chat(client, max_tokens=20, stream_options={"include_usage": True},
                                           **GREEDY)
    assert texts[0] == full.choices[0].message.content and len(texts[0]) > 0
    assert full.choices[0].finish_reason == "length"
    prompt_ids = load_tokenizer(model_dir).apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 20
    assert full.usage.total_tokens == len(prompt_ids) + 20
    # role first, one finish_reason in the last choice chunk, then a usage chunk with no choices
    assert chunks[0].choices[0].delta.role == "assistant"
    last_choice_chunk = max(i for i, c in enumerate(chunks) if c.choices)
    assert finishes == {0: [(last_choice_chunk, "length")]}
    assert chunks[-1].choices == []
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens may differ: prefix cache
    assert [getattr(chunks[-1].usage, k) for k in tokens] == [getattr(full.usage, k) for k in tokens]
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks, _, finishes = _stream_chat(client, max_tokens=5, **GREEDY)
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert finishes[0][0][1] == "length" and len(finishes[0]) == 1


def test_n3_with_seed_is_distinct_and_reproducible(client):
    def sample():
        out = client.chat.completions.create(model="tiny-model", messages=MESSAGES, n=3, seed=1234,
                                             temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True})
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)], out.usage

    first, usage = sample()
    second, _ = sample()
    assert len(set(first)) == 3
    assert first == second
    assert usage.completion_tokens == 36
    _, texts, finishes = _stream_chat(client, n=3, seed=1234, temperature=1.0, max_tokens=12,
                                      extra_body={"ignore_eos": True})
    assert [texts[i] for i in range(3)] == first
    assert all(len(finishes[i]) == 1 for i in range(3))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_honoured(client, stream):
    text = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=30,
                                          **GREEDY).choices[0].message.content
    start = next(i for i in range(len(text) // 2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    expected = text[:text.find(stop)]
    if stream:
        _, texts, finishes = _stream_chat(client, max_tokens=30, stop=[stop, "never-seen-stop"], **GREEDY)
        assert texts[0] == expected and finishes[0][0][1] == "stop"
    else:
        out = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=30, stop=stop,
                                             **GREEDY)
        assert out.choices[0].message.content == expected
        assert out.choices[0].finish_reason == "stop"


def test_chat_logprobs_shapes(client):
    out = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=6, logprobs=True,
                                         top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert entry.logprob == pytest.approx(tops[0])  # greedy picks the most likely token
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content).startswith(out.choices[0].message.content[:1])


def test_completions_prompt_forms_logprobs_and_echo(client, model_dir):
    tok = load_tokenizer(model_dir)
    ids = tok.encode("the quick brown fox", add_special_tokens=True)
    common = dict(model="tiny-model", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt="the quick brown fox", logprobs=2, **common)
    by_ids = client.completions.create(prompt=ids, **common)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 5
    lp = by_text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    many = client.completions.create(prompt=["hello world", "the lazy dog"], n=2, echo=True,
                                     **{**common, "temperature": 0.8, "seed": 3})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text[:11] for c in many.choices[:2]] == ["hello world"] * 2
    assert all(c.text.startswith("the lazy dog") for c in many.choices[2:])
    assert many.usage.completion_tokens == 20


def test_completions_stream_matches_non_stream(client):
    common = dict(model="tiny-model", prompt="hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**common).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **common))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 8


def test_models_lists_the_directory_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-model"]


def test_sampling_fields_reach_the_engine(client, model_dir):
    tok = load_tokenizer(model_dir)
    forced = tok.encode(" fox")[0]
    messages = [*MESSAGES, {"role": "assistant", "content": "ok"},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    out = client.chat.completions.create(model="tiny-model", messages=messages, max_completion_tokens=4,
                                         logit_bias={str(forced): 100}, temperature=0.9, top_p=0.9,
                                         frequency_penalty=0.5, presence_penalty=0.5, user="u1",
                                         extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01,
                                                     "repetition_penalty": 1.1})
    assert out.choices[0].message.content == " fox" * 4
    assert out.usage.completion_tokens == 4
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(prompt_ids)


def test_echo_with_logprobs_scores_the_prompt(client, model_dir):
    # the log-likelihood use of completions (as evaluation harnesses call it): echo the prompt with
    # logprobs; the prompt's tokens come first, the first one with null, then the generated ones
    tok = load_tokenizer(model_dir)
    ids = tok.encode("the quick brown fox", add_special_tokens=True)
    common = dict(model="tiny-model", prompt="the quick brown fox", temperature=0, logprobs=2, echo=True,
                  extra_body={"ignore_eos": True})
    scored = client.completions.create(max_tokens=1, **common)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # top 2, plus the token when not in them
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert scored.choices[0].text.startswith("the quick brown fox")
    # the prompt's log-probs do not depend on what is generated after it, nor on streaming
    longer = client.completions.create(max_tokens=4, **common).choices[0].logprobs
    assert longer.token_logprobs[: len(ids)] == lp.token_logprobs[: len(ids)]
    chunks = list(client.completions.create(max_tokens=4, stream=True, **common))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == longer.token_logprobs
    assert "".join(ch.text for c in chunks for ch in c.choices) == client.completions.create(
        max_tokens=4, **common).choices[0].text
