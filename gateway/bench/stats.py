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
