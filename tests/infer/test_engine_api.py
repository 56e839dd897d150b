"""LLMEngine and LLM behaviour: errors, abort, stats, stops, streaming text, live modules."""

from __future__ import annotations

import pytest
import torch

from astrai.infer.detokenize import detokenize
from astrai.infer.engine import LLMEngine
from astrai.infer.llm import LLM
from astrai.infer.sampling import SamplingParams
from astrai.infer.scheduler import Sequence
from tests.infer.conftest import random_prompts, tiny_model

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def text_model():
    return tiny_model(seed=5, vocab_size=320)


def drain(engine: LLMEngine) -> dict[str, list]:
    """Step to the end; every RequestOutput seen, per request."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_impossible_requests_raise_clear_errors(model):
    engine = LLMEngine(model, None, kv_cache_tokens=64, block_size=16, max_model_len=100)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt has 100 tokens but max_model_len is 100"):
        engine.add_request("a", [5] * 100, SamplingParams())
    with pytest.raises(ValueError, match="needs 5 KV blocks .* the pool has 4"):
        engine.add_request("a", [5] * 50, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("a", [5, 128], SamplingParams())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request("a", "hello", SamplingParams())
    with pytest.raises(ValueError, match="logit_bias has token id 500"):
        engine.add_request("a", [5], SamplingParams(logit_bias={500: 1.0}))
    with pytest.raises(ValueError, match="n is 300 but max_num_seqs is 256"):
        engine.add_request("a", [5], SamplingParams(n=300, max_tokens=1))
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [5, 6], SamplingParams())
    with pytest.raises(ValueError, match="unknown engine config field 'block_sise'"):
        LLMEngine(model, None, block_sise=8)
    engine.set_policy_version(2)
    with pytest.raises(ValueError, match="engine is at 2, got 1"):
        engine.set_policy_version(1)


def test_abort_frees_blocks_at_once_and_stats_track_the_pool(model):
    engine = LLMEngine(model, None, kv_cache_tokens=512, block_size=8)
    prompts = random_prompts([30, 20], seed=4)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=5, **GREEDY))
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks - 4 - 3
    assert stats.kv_usage == pytest.approx(7 / stats.num_total_blocks)
    engine.abort("a")
    engine.abort("unknown")  # ignored
    assert engine.stats().num_free_blocks == stats.num_total_blocks - 3
    outs = drain(engine)
    assert set(outs) == {"b"} and outs["b"][-1].finished
    m = outs["b"][-1].metrics  # timestamps in order, each set once
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    final = engine.stats()
    assert final.num_free_blocks == final.num_total_blocks and final.num_running == 0


def test_stop_tokens_stop_strings_min_tokens_and_length(text_model, tok):
    llm = LLM(text_model, tok, kv_cache_tokens=1024)
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    assert full.text == tok.decode(full.token_ids)

    stop_token = full.token_ids[4]
    first = full.token_ids.index(stop_token)
    out = llm.generate(prompt, SamplingParams(max_tokens=30, stop_token_ids=[stop_token], **GREEDY))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert out.text == tok.decode(full.token_ids[:first])

    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    out = llm.generate(prompt, SamplingParams(max_tokens=30, stop=[stop], **GREEDY))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == full.text[: full.text.find(stop)]

    banned = full.token_ids[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=[banned],
                                              **GREEDY))[0].outputs[0]
    assert len(out.token_ids) >= 3 and banned not in out.token_ids[:3]


def test_streamed_text_only_grows_and_matches_the_final_text(text_model, tok):
    engine = LLMEngine(text_model, tok, kv_cache_tokens=1024)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, stop=["e t", "zz"])
    engine.add_request("s", "Héllo wörld", params)
    outs = drain(engine)["s"]
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time
    again = LLM(text_model, tok, kv_cache_tokens=1024).generate("Héllo wörld", params)[0].outputs[0]
    assert again.text == texts[-1] and again.token_ids == outs[-1].outputs[0].token_ids


def test_incremental_detokenisation_never_emits_broken_utf8(tok):
    text = "x ☃ 日本語 ünï"
    ids = tok.encode(text)
    seq = Sequence(0, "r", 0, tok.encode("a"), SamplingParams())
    emitted = []
    for t in ids:
        seq.append_token(t)
        detokenize(tok, seq)
        emitted.append(seq.text)
    assert all("\ufffd" not in t for t in emitted)
    assert emitted[-1] == text
    assert len(set(emitted)) < len(emitted)  # some multi-byte characters really were held back


def test_top_logprob_dicts(text_model, tok):
    llm = LLM(text_model, tok, kv_cache_tokens=256)
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0.8, seed=0, max_tokens=3, logprobs=2))[0].outputs[0]
    for token, entry, raw in zip(out.token_ids, out.logprobs, out.raw_logprobs):
        assert token in entry and 2 <= len(entry) <= 3
        ranked = sorted((lp.rank, lp.logprob) for t, lp in entry.items() if t != token or lp.rank <= 2)
        assert [r for r, _ in ranked][:2] == [1, 2] and ranked[0][1] >= ranked[1][1]
        assert isinstance(entry[token].decoded_token, str) and token in raw


def test_live_training_module_is_used_in_place_and_keeps_train_mode():
    model = tiny_model(seed=6).train()
    engine = LLMEngine(model, None, kv_cache_tokens=256)
    params = SamplingParams(max_tokens=8, **GREEDY)
    before = engine.run_batch([[3, 4, 5]], params)[0].outputs[0].token_ids
    assert model.training and all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        model.lm_head.weight.neg_()  # an optimizer step, seen by the engine without a copy
    engine.set_policy_version(1)
    after = engine.run_batch([[3, 4, 5]], params)[0].outputs[0].token_ids
    assert before != after and model.training


def test_llm_chat_and_prompt_order(text_model, tok):
    llm = LLM(text_model, tok, kv_cache_tokens=1024)
    convs = [[{"role": "user", "content": "Hello world!"}], [{"role": "user", "content": "1 + 2 = 3"}]]
    outs = llm.chat(convs, SamplingParams(max_tokens=5, **GREEDY))
    for conv, out in zip(convs, outs):
        assert out.prompt_token_ids == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        assert len(out.outputs[0].token_ids) == 5
    prompts = ["The quick", "Hello", "1 + 2"]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=k, **GREEDY) for k in (3, 1, 2)])
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 2]


def test_streaming_holds_back_a_partial_stop_string(text_model, tok):
    params = dict(max_tokens=30, **GREEDY)
    full = LLM(text_model, tok, kv_cache_tokens=512).generate("Hello", SamplingParams(**params))[0].outputs[0].text
    stop = full[12:16]
    engine = LLMEngine(text_model, tok, kv_cache_tokens=512)
    engine.add_request("s", "Hello", SamplingParams(stop=[stop], **params))
    texts = [o.outputs[0].text for o in drain(engine)["s"]]
    assert texts[-1] == full[: full.find(stop)]
    assert all(texts[-1].startswith(t) for t in texts)  # nothing shown was later taken back


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_model_still_trains_after_the_engine_ran_it(mode):
    # eval-mode models run under inference_mode, training-mode ones under no_grad: neither may
    # leave anything behind that breaks a later backward pass
    model = tiny_model(seed=7).train(mode == "train")
    engine = LLMEngine(model, None, kv_cache_tokens=256)
    engine.run_batch([[3, 4, 5, 6]], SamplingParams(max_tokens=4, **GREEDY))
    model.train()
    loss = model(torch.tensor([[3, 4, 5, 6]])).logits.square().mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
