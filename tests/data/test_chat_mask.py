"""Loss masks from chat templates: exactly the assistant spans, loud failures otherwise."""

from __future__ import annotations

import pytest

from astrai.data.tokenizer import CHATML_TEMPLATE, Tokenizer


def _masked_text(tok, ids, mask):
    # Decode each run of masked tokens separately, so span boundaries are visible.
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current, skip_special_tokens=False))
            current = []
    if current:
        runs.append(tok.decode(current, skip_special_tokens=False))
    return runs


@pytest.mark.parametrize("chat,expected", [
    ([{"role": "user", "content": "12+7"}, {"role": "assistant", "content": "19"}],
     ["19<|im_end|>"]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
      {"role": "assistant", "content": "see you"}],
     ["hello<|im_end|>", "see you<|im_end|>"]),
    ([{"role": "user", "content": "weather?"},
      {"role": "assistant", "content": "",
       "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": "{}"}}]},
      {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."},
      {"role": "user", "content": "thanks"}],
     ['<tool_call>{"name": "get", "arguments": {}}</tool_call><|im_end|>', "It is sunny.<|im_end|>"]),
])
def test_mask_covers_exactly_assistant_spans(tok, chat, expected):
    ids, mask = tok.encode_chat(chat)
    assert len(ids) == len(mask)
    assert ids == tok.apply_chat_template(chat)
    assert _masked_text(tok, ids, mask) == expected
    # the unmasked prefix of each turn is exactly what inference feeds the model
    first = mask.index(1)
    prompt = tok.apply_chat_template(chat[:[m["role"] for m in chat].index("assistant")],
                                     add_generation_prompt=True)
    assert ids[:first] == prompt


def test_mask_with_tools_list(tok):
    chat = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    tools = [{"type": "function", "function": {"name": "calc"}}]
    ids, mask = tok.encode_chat(chat, tools=tools)
    assert ids == tok.apply_chat_template(chat, tools=tools)
    assert _masked_text(tok, ids, mask) == ["4<|im_end|>"]


def test_empty_mask_is_rejected(tok):
    with pytest.raises(ValueError, match="no assistant tokens"):
        tok.encode_chat([{"role": "user", "content": "only a question"}])
    # an empty reply still teaches the end-of-turn token, so it is not an empty mask
    ids, mask = tok.encode_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}])
    assert _masked_text(tok, ids, mask) == ["<|im_end|>"]


def test_all_ones_mask_is_rejected(tok):
    bare = Tokenizer(tok.backend, tok.config,
                     chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="assistant tokens only"):
        bare.encode_chat([{"role": "assistant", "content": "hello"}])


def test_non_prefix_preserving_template_is_rejected(tok):
    # Marks the last message differently, so earlier renderings are not prefixes of later ones.
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} [end]{% endif %}\n"
                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    bad = Tokenizer(tok.backend, tok.config, chat_template=template)
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match="not prefix-preserving at message 1"):
        bad.encode_chat(chat)


def test_template_dropping_history_is_rejected(tok):
    # Like templates that strip reasoning from earlier turns: history changes after later turns.
    template = CHATML_TEMPLATE.replace("content_text(message.content) -}}",
                                       "(content_text(message.content) if loop.last else '') -}}", 1)
    assert template != CHATML_TEMPLATE
    bad = Tokenizer(tok.backend, tok.config, chat_template=template)
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(ValueError, match="not prefix-preserving"):
        bad.encode_chat(chat)


def test_no_template_error(tok):
    plain = Tokenizer(tok.backend, {}, chat_template=None)
    with pytest.raises(ValueError, match="no chat_template"):
        plain.encode_chat([{"role": "user", "content": "a"}])
