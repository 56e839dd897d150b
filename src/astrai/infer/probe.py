"""Load-time probes: what one forward pass costs on the machine at hand, and what follows from it.

The engine's scheduling defaults and a few CPU settings are not constants: a step's cost depends
on the model, the device and (on a shared CPU) on what else runs there. So when an engine starts
with these settings left to it, short timed forward passes of the model itself decide:

- `measure_step_cost`: the cost of a forward pass over 1 token (the step's floor: every weight
  is read once, every kernel launched once) and over growing token counts. The prefill chunk
  (`long_prefill_token_threshold`) is the largest power of two whose pass costs at most
  `CHUNK_COST_RATIO` single-token passes, so a running decode never waits behind more than
  that. On a CPU, where cost grows with tokens almost from the start, this gives tens of tokens
  for a 135M model; on a GPU, whose cost is flat until the device is busy, or for a tiny model
  bound by per-op overhead, it gives the upper bound.
- `choose_threads` (CPU, engines that own their model): torch's default intra-op thread count
  against one thread. On a CPU shared with other processes, threads of a parallel region wait
  for each other at every op, and one descheduled thread stalls the op for a time slice; one
  thread can then be several times faster. Whichever is faster here is kept.
- `choose_linear_layout` (engines that own their model): a linear layer's weight stored as
  (out, in), PyTorch's layout, or as the transpose of a contiguous (in, out) tensor, which BLAS
  reads without a transposed operand and which is faster on some CPUs; the weight tensors stay
  the same parameters (only their storage order changes), so nothing else notices.

Each probe returns what it measured and chose, which `LLMEngine.describe()` reports (the
server's startup summary). Timings take the minimum of interleaved repeats, since noise on a
shared machine only ever adds time.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

CHUNK_COST_RATIO = 4.0  # a prefill chunk may cost this many single-token forward passes
CHUNK_MIN, CHUNK_MAX = 16, 2048  # the chunk sizes probed (powers of two)
PROBE_TOKENS = 32  # tokens of the forward pass that compares threads and layouts (a decode batch)
MIN_GAIN = 0.05  # a non-default setting is kept only when at least this much faster

_step_costs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(threads, limit): StepCost}


@dataclass
class StepCost:
    forward_ms: dict[int, float] = field(default_factory=dict)  # tokens -> ms of one forward pass
    chunk: int = CHUNK_MAX  # tokens of the largest pass within CHUNK_COST_RATIO single-token passes
    seconds: float = 0.0  # what probing took

    def as_dict(self) -> dict:
        return {"forward_ms": {n: round(ms, 2) for n, ms in self.forward_ms.items()}, "chunk": self.chunk,
                "chunk_cost_ratio": CHUNK_COST_RATIO, "seconds": round(self.seconds, 2)}


def max_probe_tokens(model: nn.Module) -> int:
    """The longest row a probe may run: the model's positions, or its sliding window when shorter
    (astrai refuses longer sequences for a windowed model)."""
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    return min(cfg.max_position_embeddings, window or cfg.max_position_embeddings)


def _forward_seconds(model: nn.Module, num_tokens: int, repeats: int = 2) -> float:
    """Least wall time of `repeats` forward passes over one row of `num_tokens` tokens, last logits only."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, num_tokens), device=device)
    last = torch.tensor([num_tokens - 1], device=device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(ids, logits_indices=last)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_step_cost(model: nn.Module, max_tokens: int | None = None) -> StepCost:
    """Forward costs at 1, 16, 32, ... tokens (at most `max_tokens`, the engine's max_model_len),
    stopping past CHUNK_COST_RATIO single-token passes; cached per model, thread count and limit
    (callers hold inference mode or no_grad)."""
    limit = min(CHUNK_MAX, max_tokens or CHUNK_MAX, max_probe_tokens(model))
    key = (torch.get_num_threads(), limit)
    cached = _step_costs.get(model, {}).get(key)
    if cached is not None:
        return cached
    start = time.perf_counter()
    _forward_seconds(model, min(CHUNK_MIN, limit), repeats=1)  # warm-up: first-call allocations are not timed
    floor = _forward_seconds(model, 1, repeats=3)
    cost = StepCost({1: floor * 1e3}, chunk=CHUNK_MIN)  # a prompt never exceeds the limit anyway
    n = CHUNK_MIN
    while n <= limit:
        seconds = _forward_seconds(model, n)
        cost.forward_ms[n] = seconds * 1e3
        if seconds > CHUNK_COST_RATIO * floor:
            break
        cost.chunk = n
        n *= 2
    cost.seconds = time.perf_counter() - start
    _step_costs.setdefault(model, {})[key] = cost
    return cost


def choose_threads(model: nn.Module, repeats: int = 3) -> dict:
    """Keep torch's thread count or switch to one thread, whichever runs a forward pass faster."""
    default, tokens = torch.get_num_threads(), min(PROBE_TOKENS, max_probe_tokens(model))
    if default <= 1:
        return {"threads": default, "probed": False}
    times: dict[int, float] = {default: float("inf"), 1: float("inf")}
    for threads in (default, 1):  # warm-up
        torch.set_num_threads(threads)
        _forward_seconds(model, tokens, repeats=1)
    for _ in range(repeats):  # interleaved, so a burst of load hits both
        for threads in times:
            torch.set_num_threads(threads)
            times[threads] = min(times[threads], _forward_seconds(model, tokens, repeats=1))
    chosen = 1 if times[1] < (1 - MIN_GAIN) * times[default] else default
    torch.set_num_threads(chosen)
    return {"threads": chosen, "probed": True, "forward_ms": {t: round(s * 1e3, 2) for t, s in times.items()}}


def set_linear_layout(linears: list[nn.Linear], transposed: bool) -> None:
    """Store each weight as (out, in) contiguous, or (transposed) as the transpose of an (in, out) one."""
    for lin in linears:
        w = lin.weight.data
        if transposed and w.is_contiguous():
            lin.weight.data = w.t().contiguous().t()  # same (out, in) shape, stored as (in, out)
        elif not transposed and not w.is_contiguous():
            lin.weight.data = w.contiguous()


def choose_linear_layout(model: nn.Module, repeats: int = 3) -> dict:
    """Store linear weights as (out, in) or as transposed (in, out), whichever runs faster."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return {"linear_layout": "out_in", "probed": False}
    times = {"out_in": float("inf"), "in_out": float("inf")}
    tokens = min(PROBE_TOKENS, max_probe_tokens(model))
    for layout in times:  # warm-up
        set_linear_layout(linears, layout == "in_out")
        _forward_seconds(model, tokens, repeats=1)
    for _ in range(repeats):
        for layout in times:
            set_linear_layout(linears, layout == "in_out")
            times[layout] = min(times[layout], _forward_seconds(model, tokens, repeats=1))
    chosen = "in_out" if times["in_out"] < (1 - MIN_GAIN) * times["out_in"] else "out_in"
    set_linear_layout(linears, chosen == "in_out")
    return {"linear_layout": chosen, "probed": True, "forward_ms": {k: round(s * 1e3, 2) for k, s in times.items()}}


def check_tuning(num_threads: int | None, linear_layout: str | None) -> None:
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if linear_layout not in (None, "out_in", "in_out"):
        raise ValueError(f"linear_layout must be 'out_in', 'in_out' or unset (probed), got {linear_layout!r}")


def tune_owned_model(model: nn.Module, num_threads: int | None, linear_layout: str | None) -> dict:
    """Settings of a model an engine loaded itself (nobody else's threads or weights are touched):
    torch's CPU thread count and the linear weights' storage order, each given or probed (CPU)."""
    check_tuning(num_threads, linear_layout)
    probes: dict = {}
    on_cpu = next(model.parameters()).device.type == "cpu"
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif on_cpu:
        with torch.inference_mode():
            probes["threads"] = choose_threads(model)
    if linear_layout is not None:
        set_linear_layout([m for m in model.modules() if isinstance(m, nn.Linear)], linear_layout == "in_out")
    elif on_cpu:
        with torch.inference_mode():
            probes["linear_layout"] = choose_linear_layout(model)
    return probes
