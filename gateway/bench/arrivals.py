"""Open-loop arrivals: when each request (or session) arrives, whatever the server is doing.

A closed loop (``gateway.bench.levels``) sends the next request when an answer comes back, so a
slow server is offered less load. An open loop offers the load on a clock: request ``i`` arrives
at its scheduled time ``t_i`` whether or not earlier ones have ended, and its latency counts from
``t_i``, so time queued anywhere (at the client, in the gateway, in the server) is in its TTFT
and e2e.

The times (seconds from the start, the first at 0) come from:

- a rate: intervals drawn from a gamma distribution of shape ``burstiness`` and mean
  ``1 / rate`` (scale ``1 / (rate * burstiness)``). ``burstiness`` 1 is the exponential, i.e. a
  Poisson process; below 1 the arrivals are burstier (the intervals' coefficient of variation is
  ``1 / sqrt(burstiness)``), above 1 more regular. This is vLLM's ``benchmark_serving
  --burstiness``; SGLang 0.5.23's ``bench_serving`` has only the Poisson case (sglang 0.5.23
  wheel: sglang/benchmark/serving.py:1126-1129, ``np.random.exponential(1.0 / request_rate)``,
  and ``--request-rate inf`` sends everything at once, :1122-1124);
- a trace's timestamps (``gateway.bench.traces``).

SGLang sleeps each interval after sending (serving.py:1129), so its schedule drifts by the time
the send itself takes; here every time is absolute, from the start.

``OpenLoop`` is what a driver needs: the times, the unit (``request``: each arrival is one
request; ``session``: each arrival starts a workload script, closed-loop inside), and the bound on
what is alive at once (``max_in_flight``: beyond it arrivals wait at the client, in order, and
that wait counts in their latency).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

Unit = Literal["request", "session"]
DEFAULT_MAX_IN_FLIGHT = 1024


def arrival_times(rate: float, *, burstiness: float = 1.0, seed: int = 0, count: int | None = None,
                  duration_s: float | None = None) -> list[float]:
    """Arrival times from 0: the first at 0, then one interval after another; the first
    ``count`` of them, or those before ``duration_s`` (both: whichever ends first)."""
    _check(rate, burstiness)
    if count is None and duration_s is None:
        raise ValueError("arrivals need a bound: a count or a duration")
    if count is not None and count < 0:
        raise ValueError("the count of arrivals must be >= 0")
    if duration_s is not None and not duration_s > 0:
        raise ValueError("the duration must be > 0")
    if math.isinf(rate):
        if count is None:
            raise ValueError("an infinite rate (all at once) needs a count, not a duration")
        return [0.0] * count
    rng = random.Random(f"{seed}:arrivals:{rate!r}:{burstiness!r}")
    scale = 1.0 / (rate * burstiness)
    times: list[float] = []
    t = 0.0
    while (count is None or len(times) < count) and (duration_s is None or t < duration_s):
        times.append(t)
        # burstiness 1: the exponential (gammavariate(1, scale) is it too, by another draw)
        t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, scale)
    return times


def _check(rate: float, burstiness: float) -> None:
    if not rate > 0:  # NaN too
        raise ValueError(f"the rate must be > 0 (inf: all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"the burstiness must be a finite number > 0, got {burstiness}")


@dataclass(frozen=True)
class OpenLoop:
    """An open-loop run: arrival ``i`` starts the source's script ``i`` at ``times[i]``."""

    times: tuple[float, ...]
    unit: Unit = "request"
    label: str = ""  # how the arrivals were made, for the report
    rate: float | None = None  # the nominal rate (per second of the unit), None for a trace
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT

    def __post_init__(self) -> None:
        if any(b < a for a, b in zip(self.times, self.times[1:], strict=False)):
            raise ValueError("arrival times must be in order")
        if self.max_in_flight < 1:
            raise ValueError("--max-in-flight must be >= 1")

    @property
    def offered_rate(self) -> float:
        """The arrivals' own mean rate: (n - 1) intervals over their span; inf when all arrive
        at once, NaN for fewer than two."""
        return span_rate(self.times)


def span_rate(times: tuple[float, ...] | list[float]) -> float:
    """(n - 1) / (last - first): a point process's mean rate over its span (the maximum
    likelihood rate of its intervals); inf for a span of 0, NaN for fewer than two points."""
    if len(times) < 2:
        return math.nan
    span = max(times) - min(times)
    return math.inf if span == 0 else (len(times) - 1) / span


def poisson_label(rate: float, burstiness: float, unit: Unit) -> str:
    per = "req/s" if unit == "request" else "sessions/s"
    if math.isinf(rate):
        return f"all {unit}s at once (rate inf)"
    if burstiness == 1.0:
        return f"Poisson arrivals at {rate:g} {per}"
    return f"arrivals at {rate:g} {per}, gamma intervals (burstiness {burstiness:g})"
