"""vLLM's token-in/token-out fields through the official `openai` client (`extra_body`):
`return_token_ids`, completions' `prompt_logprobs` and per-prompt `seeds`, `logprobs_mode`, and
the `policy_version` every body and the final stream chunk carry (serve/render.py)."""

from __future__ import annotations

from astrai.data.tokenizer import load_tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
IDS = {"return_token_ids": True, "ignore_eos": True}


def test_chat_token_ids_decode_to_the_text_and_prompt_ids_are_the_templates(client, model_dir):
    tok = load_tokenizer(model_dir)
    out = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body=IDS)
    assert out.prompt_token_ids == tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    choice = out.choices[0]
    assert len(choice.token_ids) == 12 and tok.decode(choice.token_ids) == choice.message.content
    assert out.policy_version == 0
    # the stream: the prompt's ids first, each chunk's new ids, the version on the final chunk
    chunks = list(client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=12,
                                                 temperature=0, stream=True, extra_body=IDS))
    assert chunks[0].prompt_token_ids == out.prompt_token_ids
    assert [t for c in chunks[1:] for ch in c.choices for t in ch.token_ids] == choice.token_ids
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].policy_version == 0
    plain = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra.get("token_ids") is None and plain.prompt_token_ids is None


def test_completions_ids_prompt_logprobs_and_stream(client, model_dir):
    tok = load_tokenizer(model_dir)
    prompt = tok.encode("the quick brown fox", add_special_tokens=False)
    out = client.completions.create(model="tiny-model", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={**IDS, "prompt_logprobs": 2})
    choice = out.choices[0]
    assert choice.prompt_token_ids == prompt and len(choice.token_ids) == 8
    assert tok.decode(choice.token_ids) == choice.text and out.policy_version == 0
    entries = choice.prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    for token, entry in zip(prompt[1:], entries[1:]):
        assert str(token) in entry and len(entry) <= 3  # the prompt's token and the top 2
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    chunks = list(client.completions.create(model="tiny-model", prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True, extra_body=IDS))
    assert chunks[0].choices[0].prompt_token_ids == prompt
    assert [t for c in chunks for ch in c.choices for t in ch.token_ids] == choice.token_ids
    assert chunks[-1].policy_version == 0


def test_seeds_per_prompt_and_behaviour_logprobs(client, model_dir):
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("hello world", "a language model")]
    sampling = {"model": "tiny-model", "max_tokens": 6, "n": 2, "temperature": 0.7, "logprobs": 0}

    def ids(out):
        return [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]

    both = client.completions.create(prompt=prompts, **sampling, extra_body={**IDS, "seeds": [11, 22]})
    alone = [client.completions.create(prompt=p, seed=s, **sampling, extra_body=IDS)
             for p, s in zip(prompts, (11, 22))]
    assert ids(both) == ids(alone[0]) + ids(alone[1])
    # processed_logprobs: the distribution each token was drawn from (temperature 0.7), not the raw model's
    behaviour = client.completions.create(prompt=prompts[0], seed=11, **sampling,
                                          extra_body={**IDS, "logprobs_mode": "processed_logprobs"})
    assert ids(behaviour) == ids(alone[0])
    raw, processed = alone[0].choices[0].logprobs.token_logprobs, behaviour.choices[0].logprobs.token_logprobs
    assert all(abs(a - b) > 1e-6 for a, b in zip(raw, processed))
