"""The latency trade-off of `long_prefill_token_threshold`, measured on the engine itself.

A closed loop like `bench_serve.py`'s, without HTTP: `--concurrency` greedy chat requests are in
flight, each finished one is replaced by the next until `--num_requests` ran, and every
`engine.step()` output is timestamped. Each threshold (`auto`: the engine's probe; 0: no cap)
gets its own engine from the same directory, in turn. Prints output tok/s, time to first token
and inter-token latency (p50 / p99), with ratios against threshold 0 (no cap) of the same run.

    .venv/bin/python benchmarks/bench_schedule.py [--model .cache/smollm2] [--thresholds auto,64,128,0]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from astrai.infer.engine import LLMEngine  # noqa: E402
from astrai.infer.sampling import SamplingParams  # noqa: E402

TOPICS = ["the fox", "a tiny model", "numbers", "the weather", "tokenizers", "a dog", "the sea", "music"]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def closed_loop(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    queue = list(enumerate(prompts))

    def submit() -> None:
        i, prompt = queue.pop(0)
        engine.add_request(f"r{i}", prompt, params)
        sent[f"r{i}"] = time.perf_counter()

    for _ in range(min(concurrency, len(queue))):
        submit()
    num_tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            (itl.append(now - last[rid]) if rid in last else ttft.append(now - sent[rid]))
            last[rid] = now
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
                if queue:
                    submit()
    return {"tok_s": num_tokens / (time.perf_counter() - start), "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".cache/smollm2")
    p.add_argument("--thresholds", default="auto,64,128,0")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num_requests", type=int, default=64)
    p.add_argument("--max_tokens", type=int, default=64)
    args = p.parse_args(argv)
    rows = []
    for name in args.thresholds.split(","):
        fields = {} if name == "auto" else {"long_prefill_token_threshold": int(name)}
        engine = LLMEngine.from_pretrained(args.model, dtype="float32", max_model_len=1024, **fields)
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Request {i}: tell me about "
                                             f"{TOPICS[i % len(TOPICS)]}."}], add_generation_prompt=True)
                   for i in range(args.num_requests)]
        info = engine.describe()
        m = closed_loop(engine, prompts, args.concurrency, args.max_tokens)
        rows.append((name, info["long_prefill_token_threshold"], info["max_num_batched_tokens"], m))
        print(f"{name}: {info['long_prefill_token_threshold']} tokens, threads {info['torch_threads']}, "
              f"probes {info['probes'].get('step_cost')}", flush=True)
    base = next((m for n, _, _, m in rows if n == "0"), rows[0][3])
    print(f"\n### Engine closed loop: concurrency {args.concurrency}, {args.num_requests} greedy chat requests "
          f"x {args.max_tokens} tokens\n")
    print("| threshold | chunk / budget | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
          "| tok/s vs no cap | p99 ITL no cap / this |")
    print("|---|---|---:|---|---|---:|---:|")
    for name, chunk, budget, m in rows:
        print(f"| {name} | {chunk} / {budget} | {m['tok_s']:.1f} | {m['ttft_p50'] * 1e3:.0f} / {m['ttft_p99'] * 1e3:.0f} "
              f"| {m['itl_p50'] * 1e3:.0f} / {m['itl_p99'] * 1e3:.0f} | {m['tok_s'] / base['tok_s']:.2f}x "
              f"| {base['itl_p99'] / m['itl_p99']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
