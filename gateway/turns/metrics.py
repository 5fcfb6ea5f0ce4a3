"""The turns' metrics: turns by outcome, each step's duration, requests waiting for a turn,
who holds the memory, and each pair's phase. Label sets are bounded: pair, outcome, step,
kind, backend, phase."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.turns.state import PHASES

_STEP_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


class TurnMetrics:
    """A driver's TurnEvents, on the gateway's registry."""

    def __init__(self, registry: CollectorRegistry, drivers: Callable[[], Mapping[str, Any]],
                 waiting: Callable[[], int]) -> None:
        self.turns = Counter(
            "gateway_memory_turns", "Turns pairs' hand-overs and settlings by outcome: done, "
            "done_speculation_lost, failed (a step failed; the pair settled after), settled, "
            "stuck (no safe step).", ["pair", "outcome"], registry=registry)
        self.failures = Counter("gateway_memory_turn_failures",
                                "Steps of a turn or a settling that failed, by step and kind "
                                "(error, timeout, gone, check).", ["pair", "step", "kind"],
                                registry=registry)
        self.steps = Histogram("gateway_memory_turn_step_seconds", "Each step's duration.",
                               ["pair", "step"], buckets=_STEP_BUCKETS, registry=registry)
        self.seconds = Histogram("gateway_memory_turn_seconds",
                                 "A whole turn, from the decision to admitting again.", ["pair"],
                                 buckets=_STEP_BUCKETS, registry=registry)
        registry.register(_TurnsCollector(drivers, waiting))

    def step(self, pair: str, action: str, seconds: float) -> None:
        self.steps.labels(pair, action).observe(seconds)

    def outcome(self, pair: str, outcome: str, seconds: float | None = None) -> None:
        self.turns.labels(pair, outcome).inc()
        if seconds is not None:
            self.seconds.labels(pair).observe(seconds)

    def failure(self, pair: str, action: str, kind: str) -> None:
        self.failures.labels(pair, action, kind).inc()


class _TurnsCollector(Collector):
    """Read from the drivers at scrape time."""

    def __init__(self, drivers: Callable[[], Mapping[str, Any]], waiting: Callable[[], int]) -> None:
        self.drivers = drivers
        self.waiting = waiting

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily("gateway_memory_turn_waiting",
                                    "Requests waiting at the gateway for a turn to end, or "
                                    "for the holder's circuit.")
        waiting.add_metric([], self.waiting())
        yield waiting
        holder = GaugeMetricFamily("gateway_memory_holder",
                                   "1 for the server that holds its pair's GPU memory.",
                                   labels=["pair", "backend"])
        phase = GaugeMetricFamily("gateway_memory_phase", "A turns pair's phase (1 = now).",
                                  labels=["pair", "phase"])
        for name, driver in self.drivers().items():
            for role, backend in driver.pair.backends.items():
                holder.add_metric([name, backend.name], float(driver.holder == role))
            for each in PHASES:
                phase.add_metric([name, each], float(driver.phase == each))
        yield holder
        yield phase
