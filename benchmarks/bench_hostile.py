"""Hostile-neighbour benchmark: an unrelated short request's latency, alone and beside abuse.

One `astrai serve` on loopback (a tiny random model unless `--model` is given). The probe is a
short greedy chat request (8 tokens), sent one at a time; its median latency is measured alone
and then while hostile clients run beside it without pause: streams with the largest stop lists
allowed (16 strings of 256 characters), bodies near `--max_request_bytes` holding one huge
prompt, deeply nested JSON, and bodies that stall half-sent (408 after a 2 s `--body_timeout`). Each row reports the probe's
median and p90 and the ratio to the probe alone, plus the statuses the hostile requests got. A
ratio near 1 means the hostile requests did not stall the others.

    .venv/bin/python benchmarks/bench_hostile.py [--model DIR] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import make_tiny_model  # noqa: E402 - a sibling script, not a package

MAX_REQUEST_BYTES = 4 << 20
PROBE = {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 8, "temperature": 0,
         "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "astrai", "serve", "--model", str(model_dir), "--port", str(port),
           "--max_model_len", "1024", "--kv_cache_tokens", "32768", "--max_request_bytes", str(MAX_REQUEST_BYTES),
           "--body_timeout", "2", "--log_level", "error"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("ASTRAI_API_KEY", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"astrai serve exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("astrai serve did not become healthy")


# --------------------------------------------------------------------------- hostile clients
async def long_stops(client: httpx.AsyncClient, model: str) -> int:
    stops = [("zq" * 128)[:254] + f"{i:02d}" for i in range(16)]  # 16 x 256 characters: the caps
    body = {"model": model, "prompt": "go", "max_tokens": 256, "ignore_eos": True, "stop": stops, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for _ in response.aiter_bytes():
            pass
        return response.status_code


_HUGE: dict[str, bytes] = {}


async def huge_body(client: httpx.AsyncClient, model: str) -> int:
    if model not in _HUGE:  # encoded once, so the client's own JSON work does not slow the probe
        text = "word " * ((MAX_REQUEST_BYTES - 200) // 5)
        _HUGE[model] = json.dumps({"model": model, "prompt": text, "max_tokens": 1}).encode()
    response = await client.post("/v1/completions", content=_HUGE[model],
                                 headers={"Content-Type": "application/json"})
    return response.status_code


_DEEP = b"[" * 100_000 + b"]" * 100_000


async def deep_json(client: httpx.AsyncClient, model: str) -> int:
    response = await client.post("/v1/chat/completions", content=_DEEP, headers={"Content-Type": "application/json"})
    return response.status_code


async def stalled_body(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000000\r\n\r\n{\"model\": ")
    await writer.drain()
    try:
        status = (await reader.readline()).split()[1]  # the 408, after --body_timeout
        return int(status)
    finally:
        writer.close()


# --------------------------------------------------------------------------- measurement
async def probe_latencies(base: str, model: str, count: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        for _ in range(count):
            start = time.perf_counter()
            response = await client.post("/v1/chat/completions", json={"model": model, **PROBE})
            response.raise_for_status()
            out.append(time.perf_counter() - start)
    return out


Hostile = Callable[[httpx.AsyncClient], Awaitable[int]]


async def scenario(base: str, model: str, count: int, hostile: Hostile | None,
                   num_hostile: int) -> tuple[list[float], collections.Counter]:
    statuses: collections.Counter = collections.Counter()
    stop = asyncio.Event()

    async def keep_going(client: httpx.AsyncClient) -> None:
        assert hostile is not None
        while not stop.is_set():
            try:
                statuses[await hostile(client)] += 1
            except (httpx.HTTPError, OSError, IndexError, ValueError) as exc:
                statuses[type(exc).__name__] += 1

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        workers = [asyncio.create_task(keep_going(client)) for _ in range(num_hostile if hostile else 0)]
        await asyncio.sleep(0.5 if hostile else 0)  # let the hostile clients get going
        latencies = await probe_latencies(base, model, count)
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return latencies, statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: a tiny random one)")
    parser.add_argument("--quick", action="store_true", help="fewer probes (smoke test)")
    args = parser.parse_args(argv)
    count = 5 if args.quick else 30
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_tiny_model(Path(tmp) / "tiny-hostile")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start_server(model_dir, port)
        model = model_dir.resolve().name
        try:
            rows = []
            cases: list[tuple[str, Hostile | None, int]] = [
                ("alone", None, 0),
                ("4 streams with 16 stops of 256 chars", lambda c: long_stops(c, model), 4),
                (f"2 clients sending {MAX_REQUEST_BYTES >> 20} MiB prompts", lambda c: huge_body(c, model), 2),
                ("2 clients sending JSON nested 100k deep", lambda c: deep_json(c, model), 2),
                ("32 connections stalling mid-body", lambda c: stalled_body(port), 32),
            ]
            baseline = None
            for name, hostile, num in cases:
                asyncio.run(probe_latencies(base, model, 2))  # warm-up
                latencies, statuses = asyncio.run(scenario(base, model, count, hostile, num))
                p50 = statistics.median(latencies)
                p90 = sorted(latencies)[int(0.9 * (len(latencies) - 1))]
                baseline = baseline or p50
                seen = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str)) or "-"
                rows.append(f"| {name} | {p50 * 1e3:.1f} | {p90 * 1e3:.1f} | {p50 / baseline:.2f}x | {seen} |")
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\nShort request ({PROBE['max_tokens']} tokens, greedy chat), {count} probes per row, "
          f"model {model}\n")
    print("| beside the probe | p50 ms | p90 ms | p50 vs alone | hostile statuses |")
    print("|---|---:|---:|---:|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
