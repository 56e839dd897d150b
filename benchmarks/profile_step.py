"""Where one engine step spends its time: torch profiler tables of a decode step and a prefill chunk.

Loads a model directory the way `astrai serve` does (`LLMEngine.from_pretrained`, whose probes
pick threads and weight layout unless given), decodes `--batch` sequences and profiles
`--steps` decode steps (`engine.step()`, so scheduling, sampling and postprocessing count too),
then one step that prefills a single `--chunk`-token prompt. Prints, per step, the top ops by
self CPU time as markdown tables (what docs/inference.md shows).

    .venv/bin/python benchmarks/profile_step.py [--model .cache/smollm2] [--batch 32] [--chunk 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch.profiler import profile  # noqa: E402

from astrai.infer.config import EngineConfig  # noqa: E402
from astrai.infer.engine import LLMEngine  # noqa: E402
from astrai.infer.sampling import SamplingParams  # noqa: E402


def top_ops(prof, num_steps: int, limit: int) -> list[tuple[str, float, float, int]]:
    """(op, ms per step, share of all self CPU time, calls per step), most expensive first."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [(e.key, e.self_cpu_time_total / 1e3 / num_steps, e.self_cpu_time_total / total, e.count // num_steps)
            for e in events[:limit]], total / 1e3 / num_steps


def print_table(title: str, rows: list, total_ms: float) -> None:
    print(f"\n{title}: {total_ms:.1f} ms of self CPU time per step\n")
    print("| op | ms / step | share | calls / step |")
    print("|---|---:|---:|---:|")
    for name, ms, share, calls in rows:
        print(f"| `{name}` | {ms:.1f} | {share:.1%} | {calls} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".cache/smollm2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt_len", type=int, default=40)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--threads", type=int, default=None, help="torch threads, set before loading (no probe)")
    p.add_argument("--engine", default="{}", help="EngineConfig fields as JSON, e.g. '{\"num_threads\": 1}'")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    fields = dict(dtype="float32", max_num_seqs=args.batch + 1, max_num_batched_tokens=4096,
                  kv_cache_tokens=(args.batch + 1) * (args.prompt_len + args.chunk + 64),
                  long_prefill_token_threshold=0, **json.loads(args.engine))
    engine = LLMEngine.from_pretrained(args.model, **{k: v for k, v in fields.items() if k in known})
    if hasattr(engine, "describe"):
        print(f"engine: {json.dumps(engine.describe())}")
    print(f"torch threads: {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"d{i}", torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(), params)
    for _ in range(4):  # the prefill, then decode steps that settle the kept KV copy
        engine.step()
    with profile() as prof:
        for _ in range(args.steps):
            engine.step()
    rows, total = top_ops(prof, args.steps, args.limit)
    print_table(f"decode step, {args.batch} sequences", rows, total)
    for i in range(args.batch):
        engine.abort(f"d{i}")
    engine.add_request("p", torch.randint(3, vocab, (args.chunk,), generator=gen).tolist(), params)
    with profile() as prof:
        engine.step()
    rows, total = top_ops(prof, 1, args.limit)
    print_table(f"prefill chunk, {args.chunk} tokens", rows, total)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
