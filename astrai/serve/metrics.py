"""Prometheus metrics for the server, rendered as the text exposition format at `GET /metrics`.

The app counts HTTP responses by route and status; the async engine loop (`async_engine.py`)
records token counts, TTFT/TPOT/end-to-end latencies and a snapshot of the engine's scheduler and
KV-cache statistics after every step. Both threads write, so every update takes one lock. A few
dozen lines of our own instead of a `prometheus_client` dependency.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last slot is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.count}")
        return lines


class ServerMetrics:
    """All counters, gauges and histograms of one server process."""

    def __init__(self, model_name: str):
        self.model_name = model_name.replace("\\", "\\\\").replace('"', '\\"')  # label escaping
        self._lock = threading.Lock()
        self.http_requests: dict[tuple[str, int], int] = {}
        self.finished_requests: dict[str, int] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_aborted_by_disconnect = 0
        self.num_rejected_queue_full = 0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.tpot = _Histogram(TPOT_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.engine: dict[str, float] = {}

    def count_http(self, route: str, status: int) -> None:
        with self._lock:
            key = (route, status)
            self.http_requests[key] = self.http_requests.get(key, 0) + 1

    def count_prompt(self, num_tokens: int) -> None:
        with self._lock:
            self.num_prompt_tokens += num_tokens

    def count_generated(self, num_tokens: int) -> None:
        with self._lock:
            self.num_generation_tokens += num_tokens

    def count_disconnect(self) -> None:
        with self._lock:
            self.num_aborted_by_disconnect += 1

    def count_queue_full(self) -> None:
        with self._lock:
            self.num_rejected_queue_full += 1

    def observe_finished(self, finish_reason: str, ttft: float | None, tpot: float | None,
                         e2e: float) -> None:
        with self._lock:
            self.finished_requests[finish_reason] = self.finished_requests.get(finish_reason, 0) + 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            self.e2e.observe(e2e)

    def set_engine_stats(self, stats: Any) -> None:
        """Snapshot the engine's `EngineStats` (taken on the engine thread, read by /metrics)."""
        snapshot = {}
        for field in ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks",
                      "kv_usage", "prefix_cache_hit_rate", "num_preemptions"):
            value = getattr(stats, field, None)
            if value is not None:
                snapshot[field] = float(value)
        with self._lock:
            self.engine = snapshot

    def render(self) -> str:
        with self._lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self) -> list[str]:
        m = f'model_name="{self.model_name}"'
        out = ["# HELP astrai_http_requests_total HTTP responses by route and status code.",
               "# TYPE astrai_http_requests_total counter"]
        for (route, status), n in sorted(self.http_requests.items()):
            out.append(f'astrai_http_requests_total{{route="{route}",status="{status}"}} {n}')
        out += ["# HELP astrai_request_success_total Finished engine requests by finish reason.",
                "# TYPE astrai_request_success_total counter"]
        for reason, n in sorted(self.finished_requests.items()):
            out.append(f'astrai_request_success_total{{{m},finished_reason="{reason}"}} {n}')
        out += _simple("astrai_prompt_tokens_total", "counter", "Prompt tokens admitted.",
                       m, self.num_prompt_tokens)
        out += _simple("astrai_generation_tokens_total", "counter", "Tokens generated.",
                       m, self.num_generation_tokens)
        out += _simple("astrai_requests_aborted_by_disconnect_total", "counter",
                       "Requests aborted because the client went away.", m,
                       self.num_aborted_by_disconnect)
        out += _simple("astrai_requests_rejected_queue_full_total", "counter",
                       "Requests answered 429 because max_num_seqs plus max_waiting were taken.", m,
                       self.num_rejected_queue_full)
        gauges = {"num_running": ("astrai_num_requests_running", "Sequences running in the engine."),
                  "num_waiting": ("astrai_num_requests_waiting", "Sequences waiting to be scheduled."),
                  "kv_usage": ("astrai_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)."),
                  "num_free_blocks": ("astrai_kv_cache_free_blocks", "Free KV blocks."),
                  "num_total_blocks": ("astrai_kv_cache_total_blocks", "All KV blocks."),
                  "prefix_cache_hit_rate": ("astrai_prefix_cache_hit_rate",
                                            "Prompt tokens served from the prefix cache (0..1)."),
                  "num_preemptions": ("astrai_num_preemptions", "Preemptions so far.")}
        for key, (name, help_) in gauges.items():
            if key in self.engine:
                out += _simple(name, "gauge", help_, m, self.engine[key])
        for name, help_, hist in (
                ("astrai_time_to_first_token_seconds", "Time to first token.", self.ttft),
                ("astrai_time_per_output_token_seconds", "Time per output token after the first.",
                 self.tpot),
                ("astrai_e2e_request_latency_seconds", "End-to-end request latency.", self.e2e)):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + hist.render(name)
        return out


def _simple(name: str, kind: str, help_: str, labels: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
