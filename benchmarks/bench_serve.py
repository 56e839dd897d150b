"""Serving benchmark: `astrai serve` against `transformers serve --continuous-batching`.

Both servers load the same model directory and listen on loopback. For each concurrency level a
fixed set of greedy streaming chat requests is sent with at most `concurrency` in flight; the
two servers run in turn, interleaved over repeats, and each figure is the median over repeats.
Definitions follow vLLM's benchmark_serving: TTFT is the time from sending a request to its
first content chunk, ITL each gap between consecutive content chunks, TPOT a request's
(latency - TTFT) / (output tokens - 1), and output throughput all output tokens over the
wall time of the run. Greedy decoding makes both servers generate the same tokens, so they do
the same work. Without `--model`, a tiny random model directory is built in a temp folder.

    .venv/bin/python benchmarks/bench_serve.py [--model DIR] [--quick] [--no_peer]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the fox", "a tiny model", "numbers", "the weather", "tokenizers", "a dog", "the sea", "music"]


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str = ""


def make_tiny_model(path: Path) -> Path:
    from astrai.data.tokenizer_training import train_tokenizer
    from astrai.model.config import ModelConfig
    from astrai.model.hf import save_model
    from astrai.model.transformer import CausalLM

    texts = [f"{t} is a topic; the quick brown fox jumps over the lazy dog {i}" for i, t in
             enumerate(TOPICS * 8)]
    tok = train_tokenizer(texts, vocab_size=512)
    config = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    save_model(CausalLM(config, seed=0), path, tokenizer=tok)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, model_id: str, env: dict[str, str] | None = None):
        self.name, self.port, self.model_id = name, port, model_id
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not become healthy in {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def peer_cache_flags(max_seqs: int, max_model_len: int) -> list[str]:
    """`transformers serve`'s KV cache sized as astrai's is on a CPU (at most every sequence at full
    length) and its step budget at 2,048 tokens rather than 8,192 (its attention mask grows with
    both). Left to itself it sizes the cache from the free memory and zero-fills it: on a 24 GiB
    CPU host that took about 90 s of its start-up and made every step slower (8 tokens at
    concurrency 2: 21 tok/s against 178 with the sized cache, 2026-12-04). On CUDA its default (a
    share of free device memory, as astrai's) is kept."""
    if _has_cuda():
        return []
    page = 256
    return ["--cb-block-size", str(page), "--cb-num-blocks", str(-(-max_seqs * max_model_len // page)),
            "--cb-max-batch-tokens", str(max(256, min(max_seqs * max_model_len, 2048)))]


def start_servers(model_dir: Path, with_peer: bool, max_model_len: int, threads: int | None = None,
                  engine_flags: list[str] | None = None, max_seqs: int = 32) -> list[Server]:
    port = free_port()
    astrai_cmd = [sys.executable, "-c", "import sys; from astrai.serve.cli import main; sys.exit(main(sys.argv[1:]))",
                  "--model", str(model_dir), "--port", str(port), "--log_level", "warning",
                  "--max_model_len", str(max_model_len), *(engine_flags or [])]
    if threads:
        astrai_cmd += ["--num_threads", str(threads)]
    servers = [Server("astrai", astrai_cmd, port, model_dir.resolve().name)]
    if with_peer:
        port = free_port()
        exe = Path(sys.executable).with_name("transformers")
        device = "cuda" if _has_cuda() else "cpu"
        peer_cmd = [str(exe), "serve", "--continuous-batching", "--device", device, "--host", "127.0.0.1",
                    "--port", str(port), "--log-level", "warning", *peer_cache_flags(max_seqs, max_model_len),
                    str(model_dir)]
        servers.append(Server("transformers", peer_cmd, port, str(model_dir),
                              {"OMP_NUM_THREADS": str(threads)} if threads else None))
    for s in servers:
        s.wait_ready()
    return servers


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def one_request(client: httpx.AsyncClient, server: Server, i: int, max_tokens: int) -> RequestResult:
    body = {"model": server.model_id, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Request {i}: tell me about {TOPICS[i % len(TOPICS)]}."}]}
    start = time.perf_counter()
    chunk_times: list[float] = []
    usage_tokens = None
    try:
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    chunk_times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc))
    end = time.perf_counter()
    if not chunk_times:
        return RequestResult(False, error="no content chunks")
    num_tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    return RequestResult(True, chunk_times[0] - start, end - start,
                         [b - a for a, b in zip(chunk_times, chunk_times[1:])], num_tokens)


async def run_load(server: Server, concurrency: int, num_requests: int, max_tokens: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> RequestResult:
            async with semaphore:
                return await one_request(client, server, i, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(num_requests)))
        duration = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{server.name}: {len(failed)} of {num_requests} requests failed: {failed[0].error}")
    ttfts = [r.ttft for r in results]
    tpots = [(r.latency - r.ttft) / (r.num_tokens - 1) for r in results if r.num_tokens > 1]
    itls = [x for r in results for x in r.itls] or [0.0]
    return {"tok_s": sum(r.num_tokens for r in results) / duration,
            "ttft_p50": _pct(ttfts, 50), "ttft_p99": _pct(ttfts, 99),
            "tpot_p50": _pct(tpots, 50), "tpot_p99": _pct(tpots, 99),
            "itl_p50": _pct(itls, 50), "itl_p99": _pct(itls, 99),
            "tokens": sum(r.num_tokens for r in results)}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: a tiny random one)")
    p.add_argument("--quick", action="store_true", help="short run: fewer requests, one repeat")
    p.add_argument("--no_peer", action="store_true", help="measure astrai only")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max_tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--max_model_len", type=int, default=1024)
    p.add_argument("--num_requests", type=int, default=None, help="per concurrency level (default: from it)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of both servers (default: astrai probes its own, the peer uses torch's default)")
    p.add_argument("--engine_flags", default="", help="extra astrai serve flags, e.g. '--compile'")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else make_tiny_model(Path(tmp) / "tiny-random")
        servers = start_servers(model_dir, not args.no_peer, args.max_model_len, args.threads, args.engine_flags.split(),
                                max_seqs=max(levels))
        try:
            for s in servers:  # warm-up: first-request costs (lazy imports, allocations) are not measured
                asyncio.run(run_load(s, 2, 2, 8))
            rows = {}
            for c in levels:
                num_requests = args.num_requests or (max(2 * c, 8) if args.quick else max(4 * c, 16))
                runs: dict[str, list[dict[str, float]]] = {s.name: [] for s in servers}
                for rep in range(repeats):
                    order = servers if rep % 2 == 0 else servers[::-1]
                    for s in order:
                        runs[s.name].append(asyncio.run(run_load(s, c, num_requests, max_tokens)))
                        print(f"  c={c} repeat {rep + 1}: {s.name} {runs[s.name][-1]['tok_s']:.1f} tok/s",
                              file=sys.stderr, flush=True)
                rows[c] = {name: median_of(r) for name, r in runs.items()}
                print(f"concurrency {c}: " + ", ".join(f"{n} {v['tok_s']:.0f} tok/s" for n, v in rows[c].items()),
                      file=sys.stderr)
        finally:
            for s in servers:
                s.stop()
    print_table(rows, model_dir.name if args.model else "tiny random (64 hidden, 2 layers)", max_tokens, repeats)
    return 0


def print_table(rows: dict[int, dict[str, dict[str, float]]], model: str, max_tokens: int, repeats: int) -> None:
    print(f"\n### Serving: {model}, greedy streaming chat, max_tokens {max_tokens}, median of {repeats}\n")
    print("| concurrency | server | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|")
    for c, by_server in rows.items():
        for name, m in by_server.items():
            print(f"| {c} | {name} | {m['tok_s']:.0f} | {m['ttft_p50'] * 1e3:.1f} / {m['ttft_p99'] * 1e3:.1f} | "
                  f"{m['tpot_p50'] * 1e3:.2f} / {m['tpot_p99'] * 1e3:.2f} | "
                  f"{m['itl_p50'] * 1e3:.2f} / {m['itl_p99'] * 1e3:.2f} |")
    if all("transformers" in v for v in rows.values()):
        print("\n| concurrency | astrai / transformers output tok/s | transformers / astrai p50 TTFT "
              "| transformers / astrai p99 ITL |")
        print("|---|---|---|---|")
        for c, v in rows.items():
            a, t = v["astrai"], v["transformers"]
            print(f"| {c} | {a['tok_s'] / t['tok_s']:.2f}x | {t['ttft_p50'] / a['ttft_p50']:.2f}x "
                  f"| {t['itl_p99'] / max(a['itl_p99'], 1e-9):.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
