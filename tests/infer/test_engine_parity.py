"""Greedy tokens and log-probs of the engine against transformers and a full-recompute reference."""

from __future__ import annotations

import pytest
import torch

from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from tests.infer.conftest import full_forward_logprobs, greedy_full_recompute, random_prompts, tiny_model

BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "llama": dict(),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def hf_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **BASE, **FAMILIES[model_type])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger random weights than the default init, so tokens vary
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise if name.endswith("bias") else 0.08 * noise)
    return model


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_greedy_matches_transformers_generate(model_type, tmp_path):
    from astrai.model.hf import load_model

    ref = hf_model(model_type)
    ref.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    prompts = random_prompts([3, 17, 9, 30], vocab_size=128, seed=1)
    engine = LLMEngine(model, None, kv_cache_tokens=512, block_size=8, max_num_batched_tokens=24)
    outs = engine.run_batch(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.parametrize("chunked", [True, False])
def test_kv_cached_decoding_equals_full_recompute_with_exact_logprobs(chunked):
    model = tiny_model(seed=3)
    prompts = random_prompts([1, 5, 16, 33, 47], seed=2)
    engine = LLMEngine(model, None, kv_cache_tokens=1024, block_size=16, max_num_batched_tokens=40,
                       enable_chunked_prefill=chunked)
    outs = engine.run_batch(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == greedy_full_recompute(model, prompt, 20)
        want = full_forward_logprobs(model, prompt, tokens)
        assert torch.allclose(torch.tensor(out.outputs[0].logprobs), want, atol=1e-5, rtol=0)
        assert torch.allclose(torch.tensor(out.outputs[0].raw_logprobs), want, atol=1e-5, rtol=0)
        assert out.outputs[0].cumulative_logprob == pytest.approx(float(want.sum()), abs=1e-4)


def test_sampled_logprobs_match_a_full_forward_with_the_same_processing():
    model = tiny_model(seed=4)
    prompts = random_prompts([7, 12], seed=3)
    engine = LLMEngine(model, None, kv_cache_tokens=512)
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=10, seed=5, ignore_eos=True)
    for prompt, out in zip(prompts, engine.run_batch(prompts, params)):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
        scaled = logits / 0.7
        kth = scaled.topk(20, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        idx = torch.tensor(tokens)[:, None]
        want = torch.log_softmax(scaled, -1).gather(1, idx)[:, 0]
        raw = torch.log_softmax(logits, -1).gather(1, idx)[:, 0]
        assert torch.allclose(torch.tensor(out.outputs[0].logprobs), want, atol=1e-5, rtol=0)
        assert torch.allclose(torch.tensor(out.outputs[0].raw_logprobs), raw, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_equal_a_full_forward(chunk):
    # every prompt token t >= 1 gets log_softmax(logits at t - 1)[token], with top-k alternatives and
    # ranks, also when the prompt is prefilled in chunks and when its prefix is already cached
    model = tiny_model()
    prompts = random_prompts([9, 23, 16], seed=3)
    cfg = dict(max_num_batched_tokens=chunk) if chunk else {}
    engine = LLMEngine(model, None, kv_cache_tokens=1024, **cfg)
    engine.run_batch([prompts[1]], SamplingParams(temperature=0, max_tokens=2))  # puts prompt 1 in the prefix cache
    k = 3
    outs = engine.run_batch(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k, n=2))
    for prompt, out in zip(prompts, outs):
        assert out.num_cached_tokens == 0  # the cached prefix was not used: its logits were needed
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # (T, V)
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for t in range(1, len(prompt)):
            entry, row = entries[t], logp[t - 1]
            token = prompt[t]
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-5)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(k)
            for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                if tid != token:
                    assert entry[tid].rank == rank and entry[tid].logprob == pytest.approx(lp, abs=1e-5)
            assert len(entry) in (k, k + 1)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
