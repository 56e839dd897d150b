"""Compiled decode (`--compile`) against eager decode steps, on one model directory, in one process.

Two engines load the same directory (`from_pretrained`), one with `compile=True`; each holds
`--batch` sequences in steady decode, and their decode steps are timed in turns (interleaved,
medians). Prints the warm-up time and a table with the ratio. Greedy tokens of the two are
compared as well (they must be equal).

    .venv/bin/python benchmarks/bench_compile.py [--model .cache/smollm2] [--batch 32] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from astrai.infer.engine import LLMEngine  # noqa: E402
from astrai.infer.sampling import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".cache/smollm2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=40)
    args = p.parse_args(argv)
    fields = dict(dtype="float32", max_num_seqs=args.batch, long_prefill_token_threshold=0,
                  kv_cache_tokens=args.batch * (args.prompt_len + 2 * args.steps + 64))
    eager = LLMEngine.from_pretrained(args.model, **fields)
    start = time.perf_counter()
    compiled = LLMEngine.from_pretrained(args.model, compile=True, **fields)
    print(f"compile warm-up: {compiled.describe()['probes']['compile']} "
          f"(engine start {time.perf_counter() - start:.1f} s), torch threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    vocab = eager.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 4, ignore_eos=True)
    engines = {"eager": eager, "compiled": compiled}
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        engine.step()  # prefill
        engine.step()
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.steps):
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t)
    outs = {}
    for name, engine in engines.items():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs.setdefault(name, {})[out.request_id] = out.outputs[0].token_ids
    same = outs["eager"] == outs["compiled"]
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    print(f"\n### Decode step, {args.batch} sequences, median of {args.steps} interleaved steps\n")
    print("| engine | ms / decode step | tok/s | ratio vs eager | greedy tokens equal |")
    print("|---|---:|---:|---:|---|")
    print(f"| eager | {e * 1e3:.1f} | {args.batch / e:.1f} | 1.00x | - |")
    print(f"| compiled | {c * 1e3:.1f} | {args.batch / c:.1f} | {e / c:.2f}x | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
