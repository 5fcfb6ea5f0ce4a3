"""Per-request records and the figures of one concurrency level.

Definitions (the same for HTTP and virtual time, and the same as the seed's benchmark):

- per-request tok/s: mean over requests of ``completion_tokens / (e2e - ttft)``, i.e. decode
  speed once the first token is out (requests with a single token or no decode time are left
  out of the mean);
- aggregate tok/s, two methods:
  *makespan* (the seed's): all output tokens of the level / wall time of the level (first
  request sent to last request finished), ramp-up and drain included;
  *steady*: output tokens emitted inside a window [warm-up end, level end] / window length,
  while every client slot is kept busy (the drain after the window is not counted); the
  other figures then cover the requests that started inside the window;
- user-visible per-request tok/s: all output tokens / the sum of the requests' e2e times
  (queueing included: a request that waited for a slot decodes fast, but its user waited);
- TTFT, e2e: per request; ITL: the gaps between consecutive content chunks of a stream (an MTP
  chunk carries several tokens, so its gaps are longer while its tokens come faster);
- p50/p99: linear interpolation between closest ranks (numpy's default).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    data = sorted(values)
    if not data:
        return math.nan
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds on the driver's clock."""

    start: float
    first: float | None = None  # first content token
    end: float | None = None
    tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[float] = field(default_factory=list)  # tokens per chunk (estimated over HTTP)
    backend: str | None = None  # x-gateway-backend, or the target's name when absent
    error: str | None = None
    text: str = ""
    # Open loop: ``start`` is the scheduled arrival, ``sent`` when it left the client (later
    # when the client held it back); the prompt length the server reported (usage), if any.
    sent: float | None = None
    prompt_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def decode_tps(self) -> float | None:
        if self.first is None or self.end is None or self.tokens <= 1 or self.end <= self.first:
            return None
        return self.tokens / (self.end - self.first)


@dataclass
class LevelResult:
    target: str
    concurrency: int
    requests: int
    errors: int
    per_request_tps: float
    aggregate_tps: float
    user_tps: float
    output_tokens: float
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    share: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}


def summarise(target: str, concurrency: int, records: Sequence[RequestRecord],
              wall_s: float, window: tuple[float, float] | None = None) -> LevelResult:
    """The level's figures; with ``window`` (t0, t1) the steady method, else the makespan one."""
    if window is not None:
        t0, t1 = window
        in_window = sum(n for r in records if r.error is None
                        for t, n in zip(r.chunk_times, r.chunk_tokens, strict=False) if t0 <= t <= t1)
        records = [r for r in records if t0 <= r.start < t1]
    ok = [r for r in records if r.ok]
    speeds = [s for r in ok if (s := r.decode_tps) is not None]
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tokens_ok = sum(r.tokens for r in ok)
    tokens: float = tokens_ok  # the window's count is a float: chunk tokens are estimated
    if window is not None:
        tokens, wall_s = in_window, window[1] - window[0]
    backends = Counter(r.backend or "?" for r in ok)
    return LevelResult(
        target=target,
        concurrency=concurrency,
        requests=len(records),
        errors=len(records) - len(ok),
        per_request_tps=statistics.fmean(speeds) if speeds else math.nan,
        aggregate_tps=tokens / wall_s if wall_s > 0 else math.nan,
        user_tps=tokens_ok / sum(e2es) if e2es and sum(e2es) > 0 else math.nan,
        output_tokens=tokens,
        wall_s=wall_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p99_s=percentile(e2es, 99),
        share={name: n / len(ok) for name, n in sorted(backends.items())} if ok else {},
    )


# --- open loop ------------------------------------------------------------------------------

@dataclass
class ArrivalRecord:
    """One open-loop arrival (a request, or a session of several): when it was due, when its
    first request left the client, and when its last answer ended."""

    scheduled: float
    started: float | None = None
    end: float | None = None
    requests: int = 0
    errors: int = 0
    records: list[RequestRecord] = field(default_factory=list)  # its requests, in send order
    output_asked: int = 0  # the max_tokens of its requests (ignore_eos: what should come back)

    @property
    def ok(self) -> bool:
        return self.end is not None and self.errors == 0 and self.requests > 0


@dataclass
class OpenLoopResult:
    """An open-loop run on one target: offered against achieved rate, and the request figures
    with latencies from each request's scheduled arrival (queueing included).

    - offered: the arrivals' mean rate, (n - 1) / (last - first scheduled arrival);
    - achieved: the same of the successful arrivals' ends, (k - 1) / (last - first end): what
      the target kept up with (lower than offered when it could not);
    - aggregate tok/s: output tokens / (first arrival to last end), the drain included;
    - client lag: how late a request left the client against its schedule (a driver that kept
      up: ~0; beyond --max-in-flight arrivals wait at the client, counted in their latency).
    """

    target: str
    label: str
    unit: str
    arrivals: int
    completed: int  # arrivals whose requests all succeeded
    offered_rate: float
    achieved_rate: float
    client_lag_p99_s: float
    client_lag_max_s: float
    output_asked: int  # tokens the requests asked for (max_tokens)
    prompt_tokens_reported: int | None  # what the servers' usage said (HTTP), None if unknown
    level: LevelResult

    def to_dict(self) -> dict[str, Any]:
        head = {k: (None if isinstance(v, float) and math.isnan(v) else
                    "inf" if isinstance(v, float) and math.isinf(v) else v)
                for k, v in asdict(self).items() if k != "level"}
        return {**head, **self.level.to_dict()}


def summarise_open(target: str, label: str, unit: str, records: Sequence[RequestRecord],
                   arrivals: Sequence[ArrivalRecord]) -> OpenLoopResult:
    from gateway.bench.arrivals import span_rate

    ends = [r.end for r in records if r.end is not None]
    first = min((a.scheduled for a in arrivals), default=0.0)
    makespan = max(ends) - first if ends else 0.0
    lags = [r.sent - r.start for r in records if r.sent is not None]
    done = [a.end for a in arrivals if a.ok and a.end is not None]
    reported = [r.prompt_tokens for r in records]
    return OpenLoopResult(
        target=target, label=label, unit=unit, arrivals=len(arrivals), completed=len(done),
        offered_rate=span_rate([a.scheduled for a in arrivals]), achieved_rate=span_rate(done),
        client_lag_p99_s=percentile(lags, 99), client_lag_max_s=max(lags, default=math.nan),
        output_asked=sum(a.output_asked for a in arrivals),
        prompt_tokens_reported=None if not reported or None in reported
        else sum(n for n in reported if n is not None),
        level=summarise(target, 0, records, makespan))
