"""Prometheus metrics (prefix `gateway_`) on an injected registry.

Counters and histograms are updated on the request path; gauges that mirror the pool's state
(in-flight, mode, backend health) are read from the pool at scrape time by a collector, so
they can never drift from the state the policy actually sees. Every label set is bounded:
backend, pair, reason, code, kind, phase. No request or session ids.

With several pairs, a backend's name says its pair ("a/mtp"), and the gauges carry a `pair`
label too (each pair has its own mode and crossover); with one pair, the series are today's.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.routing.pair import PairState
from gateway.routing.pool import Pool

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, pool: Pool) -> None:
        # `_created` series double the scrape for no dashboard's use (prometheus_client leaves
        # this function untyped).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry
        self.requests = Counter("gateway_requests", "Routing decisions by backend and reason.",
                                ["backend", "reason"], registry=registry)
        self.responses = Counter("gateway_responses", "Finished requests by backend and HTTP code.",
                                 ["backend", "code"], registry=registry)
        self.upstream_errors = Counter("gateway_upstream_errors", "Backend failures by kind.",
                                       ["backend", "kind"], registry=registry)
        self.retries = Counter("gateway_retries", "Requests retried on the other backend.",
                               ["from_backend", "to_backend"], registry=registry)
        self.moves = Counter("gateway_moved_requests",
                             "Streams moved before their first byte when the pair flipped to "
                             "plain (cancelled, re-sent whole).", ["from_backend", "to_backend"],
                             registry=registry)
        self.continued = Counter(
            "gateway_continued_requests", "Running streams continued on another server from what "
            "their client had (gateway.relay.continuing), by cause: failure, turn, flip.",
            ["from_backend", "to_backend", "cause"], registry=registry)
        self.disconnects = Counter("gateway_client_disconnects",
                                   "Clients that left before their response ended.",
                                   ["backend", "phase"], registry=registry)
        self.relayed_streams = Counter(
            "gateway_relayed_streams", "Streams relayed, by how they were written to the client: "
            "writer (the fast path) or send (ASGI).", ["path"], registry=registry)
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
        registry.register(PoolCollector(pool))
        # The process's own, read at scrape time: process_resident_memory_bytes, CPU seconds,
        # open fds; and python_gc_objects_collected_total, which stays near 0 while the
        # request path leaves no reference cycles (docs/soak.md: when it did, the heap grew).
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
        for metric in vars(self).values():
            if isinstance(metric, Counter | Histogram) and metric._labelnames:
                _cache_children(metric)
        # Plain running totals for the built-in dashboard (it computes per-interval means).
        self.ttft_totals: dict[str, list[float]] = {name: [0.0, 0] for name in pool.backends}

    def observe_ttft(self, backend: str, seconds: float) -> None:
        self.ttft.labels(backend).observe(seconds)
        totals = self.ttft_totals[backend]
        totals[0] += seconds
        totals[1] += 1


class _Tally:
    """A counter child's increments, added to it when the registry is read: Counter.inc checks
    and takes a lock on every call (4.4k instructions, callgrind; nine a streamed request)."""

    __slots__ = ("child", "pending")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.pending: float = 0

    def inc(self, amount: float = 1) -> None:
        self.pending += amount

    def flush(self) -> None:
        if self.pending:
            self.child.inc(self.pending)
            self.pending = 0


class _Observations:
    """A histogram child's observations, counted per bucket here and added to it when the
    registry is read: Histogram.observe walks the buckets in Python and takes two locks
    (8.9k instructions, callgrind; three a request)."""

    __slots__ = ("child", "bounds", "counts", "total", "seen")

    def __init__(self, child: Any) -> None:
        self.child = child
        self.bounds: list[float] = child._upper_bounds  # ascending, +Inf last
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.seen = False

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount
        self.total += amount
        self.seen = True

    def flush(self) -> None:
        if not self.seen:
            return
        for bucket, count in zip(self.child._buckets, self.counts, strict=True):
            if count:
                bucket.inc(count)
        self.child._sum.inc(self.total)
        self.counts = [0] * len(self.bounds)
        self.total, self.seen = 0.0, False


def _cache_children(metric: Counter | Histogram) -> None:
    """Each label set's child looked up once, then kept, behind what counts for it until the
    metric is next read (its collect(): the scrape, get_sample_value): the label sets are
    bounded (see above), and prometheus_client's labels() converts, checks, locks and looks up
    on every call (about 2.8 us each on this machine; six or more a request)."""
    children: dict[tuple[object, ...], Any] = {}
    labels, collect = metric.labels, metric.collect
    defer = _Tally if isinstance(metric, Counter) else _Observations

    def cached(*values: object, **by_name: object) -> Any:
        if by_name:
            return labels(*values, **by_name)
        child = children.get(values)
        if child is None:
            child = children[values] = defer(labels(*values))
        return child

    def flushed() -> Iterable[Metric]:
        for child in children.values():
            child.flush()
        return collect()

    metric.labels = cached  # type: ignore[method-assign]
    metric.collect = flushed  # type: ignore[method-assign]


class PoolCollector(Collector):
    """Gauges read from the pool at scrape time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.by_pair = len(pool.pairs) > 1

    def collect(self) -> Iterator[Metric]:
        pool = self.pool
        concurrency = GaugeMetricFamily("gateway_concurrency",
                                        "Requests in flight through the gateway.")
        concurrency.add_metric([], pool.concurrency)
        yield concurrency
        yield from self._per_pair(pool.pairs.values())
        backends = pool.backends.values()
        now = time.monotonic()
        for name, help_text, value_of in (
            ("gateway_inflight", "Requests in flight per backend.", lambda b: b.inflight),
            ("gateway_backend_up", "1 if the backend passes health checks.",
             lambda b: float(b.up)),
            ("gateway_circuit_open", "1 while the backend's circuit is open.",
             lambda b: float(b.circuit.is_open(now))),
            ("gateway_backend_effective_cap", "Effective running-request cap (server_info).",
             lambda b: b.effective_cap),
            ("gateway_backend_accept_length",
             "Speculative accept length reported by the backend.", lambda b: b.accept_length),
            ("gateway_backend_running", "Running requests (/v1/loads).",
             lambda b: None if b.loads is None else b.loads.running),
            ("gateway_backend_waiting", "Waiting requests (/v1/loads).",
             lambda b: None if b.loads is None else b.loads.waiting),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=self._labels(["backend"]))
            for backend in backends:
                value = value_of(backend)
                if value is not None:
                    gauge.add_metric(self._values(backend.pair, [backend.name]), float(value))
            yield gauge

    def _per_pair(self, pairs: Iterable[PairState]) -> Iterator[Metric]:
        mode = GaugeMetricFamily("gateway_mode", "Current routing mode (1 = active).",
                                 labels=self._labels(["mode"]))
        families = {
            "crossover": GaugeMetricFamily(
                "gateway_crossover", "Crossover concurrency in force (accept-length adapted).",
                labels=self._labels([])),
            "hysteresis": GaugeMetricFamily("gateway_hysteresis", "Configured hysteresis.",
                                            labels=self._labels([])),
            "learned": GaugeMetricFamily(
                "gateway_learned_crossover", "Crossover learned from relayed streams, or "
                "before them from the running caps and accept length (absent while neither "
                "tells).", labels=self._labels([])),
            "accept": GaugeMetricFamily(
                "gateway_recent_accept_length", "MTP tokens per SSE chunk over recent streams.",
                labels=self._labels([])),
            "plain_below": GaugeMetricFamily(
                "gateway_plain_below", "Below this many requests in flight plain is the faster "
                "server too, measured alone (0: MTP at low load).", labels=self._labels([])),
            "sessions": GaugeMetricFamily(
                "gateway_sessions_at_work", "Sessions with a request in flight or idle at most "
                "routing.session_idle_s: what the mode follows with load_signal sessions.",
                labels=self._labels([])),
            "session_crossover": GaugeMetricFamily(
                "gateway_session_crossover", "Sessions at work from which the mode is plain "
                "(load_signal sessions).", labels=self._labels([])),
        }
        throughput = GaugeMetricFamily(
            "gateway_estimated_throughput", "Tokens/s each backend makes at the crossover in "
            "force, learned from relayed streams.", labels=self._labels(["backend"]))
        now = time.monotonic()
        for pair in pairs:
            learning = pair.learning_state()
            routing = pair.routing
            by_sessions = routing.load_signal == "sessions"
            for name in ("mtp", "plain"):
                mode.add_metric(self._values(pair.name, [name]), 1.0 if pair.mode == name else 0.0)
            for key, value in (("crossover", pair.crossover),
                               ("hysteresis", pair.routing.hysteresis),
                               ("learned", learning["crossover"]),
                               ("accept", learning["accept_length"]),
                               ("plain_below", learning["plain_below"]),
                               ("sessions", pair.sessions.at_work(now, routing.session_idle_s)
                                if by_sessions else None),
                               ("session_crossover",
                                routing.session_crossover if by_sessions else None)):
                if isinstance(value, int | float):  # None: not known (not learning, no sessions)
                    families[key].add_metric(self._values(pair.name, []), value)
            for role, value in learning["throughput"].items():  # type: ignore[attr-defined]
                if value is not None:
                    throughput.add_metric(self._values(pair.name, [pair.backends[role].name]),
                                          value)
        yield mode
        yield from families.values()
        yield throughput

    def _labels(self, labels: list[str]) -> list[str]:
        return ["pair", *labels] if self.by_pair else labels

    def _values(self, pair: str, values: list[str]) -> list[str]:
        return [pair, *values] if self.by_pair else values
