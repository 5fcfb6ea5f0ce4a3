"""The request path's counters and histograms (gateway.metrics): counted beside prometheus_client
and added to its children when a metric is read; every read (a scrape, get_sample_value, a
metric's own collect()) shows exactly what prometheus_client would have counted itself."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.app import create_app
from gateway.config import build_settings

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def _gateway_metrics() -> tuple[object, CollectorRegistry]:
    registry = CollectorRegistry()
    app = create_app(build_settings({"backends": {"mtp": {"url": "http://127.0.0.1:9"},
                                                  "plain": {"url": "http://127.0.0.1:9"}}}),
                     registry=registry)
    return app.state.runtime.metrics, registry


def _scraped(registry: CollectorRegistry, prefix: str) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith(prefix)]


def test_counts_and_observations_read_as_prometheus_clients_own() -> None:
    metrics, registry = _gateway_metrics()
    plain = CollectorRegistry()
    e2e = Histogram("gateway_e2e_seconds", "x", ["backend"], buckets=BOUNDS, registry=plain)
    responses = Counter("gateway_responses", "x", ["backend", "code"], registry=plain)
    # On bounds, between them, below the first, above the last, and more after a read.
    for values in ([0.005, 0.0049, 0.01, 0.3, 600, 601.5, 0.0], [2.5, 1e-9, 120.0]):
        for value in values:
            metrics.e2e.labels("mtp").observe(value)  # type: ignore[attr-defined]
            e2e.labels("mtp").observe(value)
            metrics.responses.labels("mtp", "200").inc()  # type: ignore[attr-defined]
            responses.labels("mtp", "200").inc()
        metrics.responses.labels("plain", "499").inc(3)  # type: ignore[attr-defined]
        responses.labels("plain", "499").inc(3)
        for prefix in ("gateway_e2e_seconds", "gateway_responses_total"):
            assert _scraped(registry, prefix) == _scraped(plain, prefix)
    assert registry.get_sample_value("gateway_responses_total",
                                     {"backend": "mtp", "code": "200"}) == 10.0


def test_the_process_memory_and_the_garbage_collector_are_on_metrics() -> None:
    """An operator watches the gateway's own memory, CPU and the garbage collector's findings
    beside the routing's metrics, as prometheus_client exports them for any process."""
    _, registry = _gateway_metrics()
    assert (registry.get_sample_value("process_resident_memory_bytes") or 0) > 10 * 2**20
    assert registry.get_sample_value("process_cpu_seconds_total") is not None
    assert registry.get_sample_value("python_gc_objects_collected_total", {"generation": "2"}) is not None
