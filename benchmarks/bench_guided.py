"""What the grammar mask hook of the sampler costs decode throughput.

Rows (medians over interleaved repeats, tokens per second of `LLMEngine.run_batch` decoding on a
tiny random model with a trained byte-level BPE tokenizer):
1. no request guided, hook present (the code as shipped) vs the hook cut out (`apply_guides` and
   `advance_guides` replaced by no-ops): the price every unconstrained request pays;
2. every request guided by a JSON schema (llguidance computes a token mask per row per step)
   vs unguided: the price a constrained request pays.
Run: `python benchmarks/bench_guided.py [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import astrai.infer.sampling as sampling  # noqa: E402
from astrai.data.tokenizer_training import train_tokenizer  # noqa: E402
from astrai.infer.engine import LLMEngine  # noqa: E402
from astrai.infer.guided import GuideCompiler  # noqa: E402
from astrai.infer.sampling import SamplingParams  # noqa: E402
from astrai.model.config import ModelConfig  # noqa: E402
from astrai.model.transformer import CausalLM  # noqa: E402

TEXTS = ['{"name": "fox", "age": 12, "tags": ["quick", "brown"]}', "the quick brown fox jumps over the lazy dog",
         "a language model predicts the next token", "numbers 12345 and 67890"] * 30
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def build(vocab_size: int) -> tuple[LLMEngine, object]:
    tok = train_tokenizer(TEXTS, vocab_size=vocab_size, out_dir=None)
    config = ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id)
    engine = LLMEngine(CausalLM(config, seed=0), tok, max_model_len=512, kv_cache_tokens=32768, max_num_seqs=64)
    return engine, tok


def tokens_per_s(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = engine.run_batch(prompts, params, return_logprobs=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def median_ratio(a, b, repeats: int) -> tuple[float, float, float]:
    """Median tokens/s of a and b over interleaved runs, and their ratio."""
    ra, rb = [], []
    for _ in range(repeats):
        ra.append(a())
        rb.append(b())
    ma, mb = statistics.median(ra), statistics.median(rb)
    return ma, mb, ma / mb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batch, new_tokens, repeats = (8, 16, 3) if args.quick else (16, 64, 7)
    engine, tok = build(512)
    prompts = [tok.encode(f"prompt {i} the quick brown fox") for i in range(batch)]
    plain = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    guide = GuideCompiler(tok, engine.vocab_size).json_schema(SCHEMA)
    guided = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, guide=guide)
    hooks = (sampling.apply_guides, sampling.advance_guides)

    def without_hook() -> float:
        sampling.apply_guides, sampling.advance_guides = (lambda logits, rows: logits), (lambda rows, t: None)
        try:
            return tokens_per_s(engine, prompts, plain)
        finally:
            sampling.apply_guides, sampling.advance_guides = hooks

    tokens_per_s(engine, prompts, plain)  # warm up
    with_hook, cut, unused_ratio = median_ratio(lambda: tokens_per_s(engine, prompts, plain), without_hook, repeats)
    mask, free, guided_ratio = median_ratio(lambda: tokens_per_s(engine, prompts, guided),
                                            lambda: tokens_per_s(engine, prompts, plain), repeats)
    print(f"Decode throughput, {batch} greedy requests x {new_tokens} new tokens, vocab {engine.vocab_size}, "
          f"1 thread, median of {repeats}\n")
    print("| row | astrai tok/s | baseline tok/s | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| no request guided: hook present vs cut out | {with_hook:.0f} | {cut:.0f} | {unused_ratio:.3f} |")
    print(f"| all requests guided (JSON schema) vs none | {mask:.0f} | {free:.0f} | {guided_ratio:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
