"""Generation throughput of astrai's engine against peers, measured in one process.

Rows (ratios are astrai / peer, medians over interleaved repeats):
1. offline throughput on a tiny random Llama: prompts of 32-256 tokens, greedy, fixed number of
   new tokens; astrai `run_batch` vs transformers `generate` on padded static batches (of 16,
   and all prompts in one batch), and vs transformers' continuous batching (`generate_batch`)
   when this version has it; and sampled (temperature 1, top_p 0.9) vs `generate` on one batch;
2. `run_batch` vs naive generation that re-runs the whole sequence for every new token, on the
   tiny model (where both are bound by per-step overhead) and on a small one (hidden 256, 4
   layers), where recomputation costs compute as it does for real models;
3. KV bytes per cached token vs the theoretical 2 * layers * kv_heads * head_dim * dtype size;
4. the same throughput rows on a converted SmolLM2 directory when `.cache/smollm2` exists (32 prompts x
   64 new tokens; `--smollm_only` runs just these), loaded with `LLMEngine.from_pretrained` as users
   load it: its probes pick the CPU thread count (process-wide, so the peer runs with the same) and
   the linear weight layout.
Both sides use the same weights (a transformers model saved and loaded with `load_model`) and
the same thread count. Run: `python benchmarks/bench_generate.py [--quick]`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from astrai.infer.block_manager import kv_bytes_per_token  # noqa: E402
from astrai.infer.engine import LLMEngine  # noqa: E402
from astrai.infer.sampling import SamplingParams  # noqa: E402
from astrai.model.hf import load_model  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
# for the naive-recompute row: big enough that re-running the sequence costs compute, as it does
# for any real model (on TINY both sides are bound by per-step Python overhead instead)
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


SAMPLED_TOP_P = 0.9


def make_prompts(num: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function after one warm-up call, run in turns so machine noise
    hits all alike."""
    for fn in fns.values():  # warm-up: first-call allocations and kernel choices are not timed
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def hf_static(model, prompts: list[list[int]], new_tokens: int, batch_size: int, pad_id: int,
              sample: bool = False) -> None:
    """transformers generate on left-padded static batches, exactly new_tokens each; greedy, or
    with `sample` drawn at temperature 1 with top_p 0.9 (and no top_k)."""
    how = dict(do_sample=True, temperature=1.0, top_p=SAMPLED_TOP_P, top_k=0) if sample else dict(do_sample=False)
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=pad_id, **how)


def hf_continuous(model, prompts: list[list[int]], new_tokens: int) -> Callable[[], object] | None:
    """transformers' own continuous batching, or None when this version lacks it or fails."""
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    sized = {}
    try:  # its KV cache sized to the work, as astrai's is: left to itself, generate_batch sizes the
        # cache from the free memory and zero-fills it on every call (about 10 s a call on a CPU host)
        from transformers import ContinuousBatchingConfig

        page, tokens = 256, sum(len(p) + new_tokens for p in prompts)
        fields = inspect.signature(ContinuousBatchingConfig).parameters  # the page's name varies by version
        wanted = {"page_size" if "page_size" in fields else "block_size": page, "num_blocks": -(-tokens // page) + len(prompts),
                  "max_batch_tokens": max(256, sum(map(len, prompts)))}
        sized["continuous_batching_config"] = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})
    except ImportError:  # an older transformers: the peer as it comes
        pass

    def run() -> object:
        return model.generate_batch(prompts, generation_config=config, progress_bar=False, **sized)

    try:  # a two-token probe: is it usable here at all?
        probe = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert len(model.generate_batch(prompts[:1], generation_config=probe, progress_bar=False, **sized)) == 1
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
        print(f"(transformers generate_batch unavailable here: {type(exc).__name__}: {str(exc)[:120]})")
        return None
    return run


def naive_generate(model, prompts: list[list[int]], new_tokens: int) -> None:
    """Argmax decoding that re-runs the full (equal-length) sequences for every token."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)


def engine_fields(prompts: list[list[int]], new_tokens: int, args) -> dict:
    """Offline settings, as `LLM` and `astrai generate` use them: throughput first, no prefill cap."""
    return dict(max_num_seqs=len(prompts), max_num_batched_tokens=args.batched_tokens, long_prefill_token_threshold=0,
                kv_cache_tokens=len(prompts) * (max(map(len, prompts)) + new_tokens + 16))


def throughput_rows(name: str, hf_model, model, prompts, new_tokens: int, args,
                    engine: LLMEngine | None = None) -> list[tuple]:
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine = engine or LLMEngine(model, None, **engine_fields(prompts, new_tokens, args))
    engine.run_batch(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up

    sampled = SamplingParams(temperature=1.0, top_p=SAMPLED_TOP_P, max_tokens=new_tokens, ignore_eos=True)

    def astrai_run(params: SamplingParams = greedy) -> None:
        engine.reset_prefix_cache()  # no prefix hits between repeats
        engine.run_batch(prompts, params)

    # static batches: of 16, and all prompts in one batch (on the tiny model, whose steps cost
    # about the same whatever their size, one big batch is transformers' fastest setting)
    sizes = sorted({min(b, len(prompts)) for b in args.hf_batch_sizes})
    fns = {"astrai": astrai_run}
    for b in sizes:
        fns[f"hf_static_{b}"] = lambda b=b: hf_static(hf_model, prompts, new_tokens, b, 0)
    continuous = hf_continuous(hf_model, prompts, new_tokens) if not args.skip_continuous else None
    if continuous is not None:
        fns["hf_continuous"] = continuous
    # sampled generation (how serving and RL rollouts run), against transformers' fastest setting
    fns["astrai_sampled"] = lambda: astrai_run(sampled)
    fns["hf_sampled"] = lambda: hf_static(hf_model, prompts, new_tokens, len(prompts), 0, sample=True)
    t = interleaved(fns, args.repeats)
    tokens = len(prompts) * new_tokens
    rows = []
    for b in sizes:
        what = f"one padded batch of all {b}" if b == len(prompts) else f"padded batches of {b}"
        rows.append((f"{name}: offline tok/s vs transformers generate ({what})",
                     tokens / t["astrai"], tokens / t[f"hf_static_{b}"], t[f"hf_static_{b}"] / t["astrai"], 3.0))
    if "hf_continuous" in t:
        rows.append((f"{name}: offline tok/s vs transformers generate_batch (continuous)",
                     tokens / t["astrai"], tokens / t["hf_continuous"], t["hf_continuous"] / t["astrai"], 1.5))
    rows.append((f"{name}: sampled (temperature 1, top_p {SAMPLED_TOP_P}) tok/s vs transformers generate "
                 f"(one padded batch of all {len(prompts)})", tokens / t["astrai_sampled"], tokens / t["hf_sampled"],
                 t["hf_sampled"] / t["astrai_sampled"], None))
    return rows


def naive_row(name: str, model, args, naive_repeats: int) -> tuple:
    prompts = make_prompts(args.naive_prompts, 64, 64, model.config.vocab_size, seed=1)
    new_tokens = args.naive_tokens
    engine = LLMEngine(model, None, kv_cache_tokens=len(prompts) * (64 + new_tokens + 16))
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.run_batch(prompts[:1], SamplingParams(temperature=0, max_tokens=2))

    def astrai_run() -> None:
        engine.reset_prefix_cache()
        engine.run_batch(prompts, greedy)

    t = interleaved({"astrai": astrai_run}, max(1, args.repeats))
    naive = statistics.median(timed(lambda: naive_generate(model, prompts, new_tokens)) for _ in range(naive_repeats))
    tokens = len(prompts) * new_tokens
    return (f"{name}: run_batch vs naive full recompute ({len(prompts)} x 64-token prompts, {new_tokens} new)",
            tokens / t["astrai"], tokens / naive, naive / t["astrai"], 10.0)


def kv_row(model) -> tuple:
    engine = LLMEngine(model, None, kv_cache_tokens=1024)
    caches = engine.runner.kv_caches
    total = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)
    per_token = total / (engine.block_manager.num_blocks * engine.block_manager.block_size)
    cfg = model.config
    dtype = next(model.parameters()).dtype
    theory = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    return ("KV bytes per cached token (measured vs theoretical)", per_token, theory, theory / per_token, 1.0)


def tiny_models(tmp: Path, shape: dict = TINY):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    hf_model.save_pretrained(tmp)
    return hf_model, load_model(tmp).eval()


def smollm_rows(path: Path, args) -> list[tuple]:
    """The real model as users load it (`from_pretrained`, whose probes pick threads and weight
    layout; the thread count is process-wide, so transformers runs with the same)."""
    from transformers import AutoModelForCausalLM

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.smollm_prompts, 32, 256, vocab, seed=2)
    new_tokens = args.smollm_tokens
    engine = LLMEngine.from_pretrained(path, dtype="float32", num_threads=args.threads,
                                       **engine_fields(prompts, new_tokens, args))
    print(f"astrai engine: {json.dumps(engine.describe()['probes'])}", flush=True)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return throughput_rows(f"SmolLM2 ({len(prompts)} x {new_tokens})", hf_model, engine.model, prompts, new_tokens,
                           args, engine) + [kv_row(engine.model)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer prompts and tokens, one repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads for both sides")
    p.add_argument("--hf_batch_sizes", type=int, nargs="+", default=[16, 1 << 30],
                   help="static batch sizes for transformers generate (capped at the number of prompts)")
    p.add_argument("--batched_tokens", type=int, default=2048, help="astrai token budget per step")
    p.add_argument("--skip_continuous", action="store_true")
    p.add_argument("--smollm_dir", default=".cache/smollm2")
    p.add_argument("--smollm_only", action="store_true", help="only the real-model rows")
    p.add_argument("--smollm_prompts", type=int, default=None, help="default 32 (4 with --quick)")
    p.add_argument("--smollm_tokens", type=int, default=None, help="new tokens each; default 64 (16 with --quick)")
    args = p.parse_args(argv)
    args.smollm_prompts = args.smollm_prompts or (4 if args.quick else 32)
    args.smollm_tokens = args.smollm_tokens or (16 if args.quick else 64)
    num_prompts, new_tokens = (16, 32) if args.quick else (64, 128)
    args.naive_prompts, args.naive_tokens = (2, 64) if args.quick else (8, 256)
    if args.quick:
        args.repeats = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    if not args.smollm_only:
        with tempfile.TemporaryDirectory() as tmp:
            hf_model, model = tiny_models(Path(tmp))
            prompts = make_prompts(num_prompts, 32, 256, TINY["vocab_size"])
            rows += throughput_rows("tiny llama", hf_model, model, prompts, new_tokens, args)
            rows.append(naive_row("tiny llama", model, args, naive_repeats=max(1, args.repeats - 1)))
            rows.append(kv_row(model))
            _print_table(rows, args.repeats)  # the tiny-model rows, before the slower ones
            if not args.quick:
                _, small = tiny_models(Path(tmp) / "small", SMALL)
                rows.append(naive_row("small llama (hidden 256, 4 layers)", small, args, naive_repeats=1))
                _print_table(rows, args.repeats)
    smol = Path(args.smollm_dir)
    if (smol / "config.json").exists():
        rows += smollm_rows(smol, args)
        _print_table(rows, args.repeats)
    return 0


def _print_table(rows: list[tuple], repeats: int) -> None:
    print(f"\ntorch threads: {torch.get_num_threads()}, repeats: {repeats} (median)\n", flush=True)
    print("| measure | astrai | peer | ratio | target |")
    print("|---|---:|---:|---:|---:|")
    for name, ours, peer, ratio, target in rows:
        goal = "-" if target is None else f">= {target:g}x"
        print(f"| {name} | {ours:,.1f} | {peer:,.1f} | {ratio:.2f}x | {goal} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
