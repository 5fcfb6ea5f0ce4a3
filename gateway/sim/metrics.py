"""``/metrics`` with SGLang's ``sglang:*`` names and labels, on a registry owned by one app.

Scheduler gauges are read from the engine at scrape time (SGLang samples them every 40 decode
steps; the sim is fresher, which no client should rely on either way). Tokenizer-side counters
and histograms are updated by the HTTP handlers. Times are wall-clock seconds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.sim.engine import Engine

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
               0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800,
               1200, 1600, 2000, 2400)  # fmt: skip


class _SchedulerCollector(Collector):
    """The scheduler's gauges, with SGLang's per-rank labels."""

    LABELS = ("engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank")

    def __init__(self, engine: Engine, speed: float) -> None:
        self._engine = engine
        self._speed = speed

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine, stats = self._engine, self._engine.stats
        values = {
            "num_running_reqs": ("The number of running requests.", engine.num_running),
            "num_queue_reqs": ("The number of requests in the waiting queue.", engine.num_waiting),
            "gen_throughput": (
                "The generation throughput (token/s).",
                stats.gen_throughput * self._speed,
            ),
            "token_usage": ("The token usage.", engine.kv_token_usage),
            "cache_hit_rate": ("The prefix cache hit rate.", engine.cache_hit_rate),
            "spec_accept_length": (
                "Mean acceptance length of speculative decoding (accepted drafts + bonus token "
                "per forward).",
                stats.avg_spec_accept_length,
            ),
            "spec_accept_rate": (
                "Accepted drafts / proposed drafts of speculative decoding.",
                stats.spec_accept_rate,
            ),
            "max_running_requests_under_SLO": (
                "The effective maximum number of running requests.",
                engine.profile.effective_max_running,
            ),
        }
        label_values = ["unified", engine.profile.served_model_name, "0", "0", "0"]
        for name, (documentation, value) in values.items():
            family = GaugeMetricFamily(f"sglang:{name}", documentation, labels=self.LABELS)
            family.add_metric(label_values, float(value))
            yield family


class SimMetrics:
    """All metrics of one simulated server; ``registry`` is what /metrics exposes."""

    def __init__(self, engine: Engine, speed: float) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(engine, speed))
        labels = ("model_name", "engine_type")
        self._labels = (engine.profile.served_model_name, "unified")

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"sglang:{name}", doc, labels, registry=self.registry, buckets=buckets)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.requests = counter("num_requests", "Number of requests processed.")
        self.aborted = counter("num_aborted_requests", "Number of requests aborted.")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        )  # fmt: skip

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(*self._labels).observe(seconds)

    def chunk(self, interval_s: float, tokens: int) -> None:
        # Like SGLang: one observation per token of interval / tokens, so _sum adds up to interval.
        itl = self.itl.labels(*self._labels)
        for _ in range(tokens):
            itl.observe(interval_s / tokens)

    def finished(self, prompt_tokens: int, completion_tokens: int, e2e_s: float, aborted: bool) -> None:
        self.requests.labels(*self._labels).inc()
        self.prompt_tokens.labels(*self._labels).inc(prompt_tokens)
        self.generation_tokens.labels(*self._labels).inc(completion_tokens)
        self.e2e.labels(*self._labels).observe(e2e_s)
        if aborted:
            self.aborted.labels(*self._labels).inc()
