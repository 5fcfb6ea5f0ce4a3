"""Prometheus metrics (prefix `gateway_`) on an injected registry.

Counters and histograms are updated on the request path; gauges that mirror router state
(in-flight, mode, backend health) are read from the Router at scrape time by a collector,
so they can never drift from the state the policy actually sees. Every label set is
bounded: backend, reason, code, kind, phase. No request or session ids.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.config import BACKEND_NAMES
from gateway.load import Router

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, router: Router) -> None:
        disable_created_metrics()  # `_created` series double the scrape for no dashboard's use
        self.registry = registry
        self.requests = Counter("gateway_requests", "Routing decisions by backend and reason.",
                                ["backend", "reason"], registry=registry)
        self.responses = Counter("gateway_responses", "Finished requests by backend and HTTP code.",
                                 ["backend", "code"], registry=registry)
        self.upstream_errors = Counter("gateway_upstream_errors", "Backend failures by kind.",
                                       ["backend", "kind"], registry=registry)
        self.retries = Counter("gateway_retries", "Requests retried on the other backend.",
                               ["from_backend", "to_backend"], registry=registry)
        self.disconnects = Counter("gateway_client_disconnects",
                                   "Clients that left before their response ended.",
                                   ["backend", "phase"], registry=registry)
        self.rejected = Counter("gateway_rejected", "Requests refused by the gateway itself.",
                                ["reason"], registry=registry)
        self.prompt_tokens = Counter("gateway_prompt_tokens", "Prompt tokens (from usage).",
                                     ["backend"], registry=registry)
        self.completion_tokens = Counter("gateway_completion_tokens",
                                         "Completion tokens (from usage).", ["backend"],
                                         registry=registry)
        self.ttft = Histogram("gateway_ttft_seconds",
                              "Streaming requests: arrival to the first model output sent to the client.",
                              ["backend"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("gateway_e2e_seconds", "Request arrival to response end.",
                             ["backend"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.overhead = Histogram("gateway_overhead_seconds",
                                  "Gateway time from request arrival to the upstream send.",
                                  ["backend"], buckets=_OVERHEAD_BUCKETS, registry=registry)
        registry.register(RouterCollector(router))
        # Plain running totals for the built-in dashboard (it computes per-interval means).
        self.ttft_totals: dict[str, list[float]] = {name: [0.0, 0] for name in BACKEND_NAMES}

    def observe_ttft(self, backend: str, seconds: float) -> None:
        self.ttft.labels(backend).observe(seconds)
        totals = self.ttft_totals[backend]
        totals[0] += seconds
        totals[1] += 1


class RouterCollector(Collector):
    """Gauges read from the router at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        router = self.router
        learning = router.learning_state()
        yield _per_backend("gateway_inflight", "Requests in flight per backend.",
                           router.inflight)
        concurrency = GaugeMetricFamily("gateway_concurrency",
                                        "Requests in flight through the gateway.")
        concurrency.add_metric([], router.concurrency)
        yield concurrency
        mode = GaugeMetricFamily("gateway_mode", "Current routing mode (1 = active).",
                                 labels=["mode"])
        for name in BACKEND_NAMES:
            mode.add_metric([name], 1.0 if router.mode == name else 0.0)
        yield mode
        for name, help_text, value in (
            ("gateway_crossover", "Crossover concurrency in force (accept-length adapted).",
             router.crossover),
            ("gateway_hysteresis", "Configured hysteresis.", router.routing.hysteresis),
            ("gateway_learned_crossover", "Crossover learned from relayed streams (absent "
             "until both servers were seen alone).", learning["crossover"]),
            ("gateway_recent_accept_length", "MTP tokens per SSE chunk over recent streams.",
             learning["accept_length"]),
        ):
            gauge = GaugeMetricFamily(name, help_text)
            if value is not None:
                gauge.add_metric([], value)
            yield gauge
        yield _per_backend("gateway_estimated_throughput",
                           "Tokens/s each backend makes at the crossover in force, learned "
                           "from relayed streams.", learning["throughput"])
        health = router.health
        yield _per_backend("gateway_backend_up", "1 if the backend passes health checks.",
                           {n: float(h.up) for n, h in health.items()})
        yield _per_backend("gateway_circuit_open", "1 while the backend's circuit is open.",
                           {n: float(h.circuit_open) for n, h in health.items()})
        yield _per_backend("gateway_backend_effective_cap",
                           "Effective running-request cap (server_info).",
                           {n: h.effective_cap for n, h in health.items()})
        yield _per_backend("gateway_backend_accept_length",
                           "Speculative accept length reported by the backend.",
                           {n: h.accept_length for n, h in health.items()})
        yield _per_backend("gateway_backend_running", "Running requests (/v1/loads).",
                           {n: h.reported_running for n, h in health.items()})
        yield _per_backend("gateway_backend_waiting", "Waiting requests (/v1/loads).",
                           {n: h.reported_waiting for n, h in health.items()})


def _per_backend(name: str, help_text: str, values: dict[str, float | int | None]) -> Metric:
    gauge = GaugeMetricFamily(name, help_text, labels=["backend"])
    for backend, value in values.items():
        if value is not None:
            gauge.add_metric([backend], float(value))
    return gauge
