"""Prometheus metrics for the server, exposed at `GET /metrics` through `prometheus_client`.

The app counts HTTP responses by route and status and requests that carried fields astrai
ignores; the async engine loop (`async_engine.py`) records token counts, TTFT/TPOT/end-to-end
latencies and a snapshot of the engine's scheduler and KV-cache statistics after every step.
Each server owns its registry (several apps may live in one test process); `render` picks the
text format or OpenMetrics from the scraper's Accept header. Names follow vLLM's with the
`astrai_` prefix.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import choose_encoder

disable_created_metrics()  # no `_created` twin of every counter: scrapers do not need it, as in vLLM

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# EngineStats field -> (gauge name, help)
ENGINE_GAUGES = {
    "num_running": ("astrai_num_requests_running", "Sequences running in the engine."),
    "num_waiting": ("astrai_num_requests_waiting", "Sequences waiting to be scheduled."),
    "kv_usage": ("astrai_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)."),
    "num_free_blocks": ("astrai_kv_cache_free_blocks", "Free KV blocks."),
    "num_total_blocks": ("astrai_kv_cache_total_blocks", "All KV blocks."),
    "prefix_cache_hit_rate": ("astrai_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0..1)."),
    "num_preemptions": ("astrai_num_preemptions", "Preemptions so far."),
}


class ServerMetrics:
    """All counters, gauges and histograms of one server process (thread-safe: prometheus_client locks)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.model_name = model_name
        self.http_requests = Counter("astrai_http_requests", "HTTP responses by route and status code.",
                                     ["route", "status"], registry=r)
        self.finished = Counter("astrai_request_success", "Finished engine requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("astrai_prompt_tokens", "Prompt tokens admitted.", m, registry=r)
        self.generation_tokens = Counter("astrai_generation_tokens", "Tokens generated.", m, registry=r)
        self.aborted_by_disconnect = Counter("astrai_requests_aborted_by_disconnect",
                                             "Requests aborted because the client went away.", m, registry=r)
        self.rejected_queue_full = Counter(
            "astrai_requests_rejected_queue_full",
            "Requests answered 429 because max_num_seqs plus max_waiting were taken.", m, registry=r)
        self.ignored_fields = Counter("astrai_requests_with_ignored_fields",
                                      "Requests that carried fields astrai accepts but ignores.", ["route"],
                                      registry=r)
        self.ttft = Histogram("astrai_time_to_first_token_seconds", "Time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("astrai_time_per_output_token_seconds", "Time per output token after the first.", m,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("astrai_e2e_request_latency_seconds", "End-to-end request latency.", m,
                             buckets=E2E_BUCKETS, registry=r)
        for series in (self.prompt_tokens, self.generation_tokens, self.aborted_by_disconnect,
                       self.rejected_queue_full):
            series.labels(model_name)  # present at 0 from the start, as a scraper expects
        # engine gauges appear once the engine reported them (none while the model loads)
        self._gauges: dict[str, Gauge] = {}

    def count_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def count_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)

    def count_generated(self, num_tokens: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(num_tokens)

    def count_disconnect(self) -> None:
        self.aborted_by_disconnect.labels(self.model_name).inc()

    def count_queue_full(self) -> None:
        self.rejected_queue_full.labels(self.model_name).inc()

    def count_ignored_fields(self, route: str) -> None:
        self.ignored_fields.labels(route).inc()

    def observe_finished(self, finish_reason: str, ttft: float | None, tpot: float | None,
                         e2e: float) -> None:
        self.finished.labels(self.model_name, finish_reason).inc()
        if ttft is not None:
            self.ttft.labels(self.model_name).observe(ttft)
        if tpot is not None:
            self.tpot.labels(self.model_name).observe(tpot)
        self.e2e.labels(self.model_name).observe(e2e)

    def set_engine_stats(self, stats: Any) -> None:
        """Snapshot the engine's `EngineStats` (taken on the engine thread, read by /metrics)."""
        for field, (name, help_) in ENGINE_GAUGES.items():
            value = getattr(stats, field, None)
            if value is None:
                continue
            gauge = self._gauges.get(field)
            if gauge is None:
                gauge = self._gauges[field] = Gauge(name, help_, ["model_name"], registry=self.registry)
            gauge.labels(self.model_name).set(float(value))

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type): the Prometheus text format, or OpenMetrics when `accept` asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
