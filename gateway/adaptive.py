"""The crossover learned from the traffic: each server's throughput at a load, from what it relays.

Every stream the gateway relays tells how fast that server decoded (completion tokens over the
time from its first byte to its end) and, from the router's load integral over the same span,
how many streams the server was running meanwhile. A stream is a sample only when the other
server was (nearly) idle: on shared GPUs the other's steps slow it, and that is not the
server's own speed at that load.

Per server, samples go into buckets by running streams; each bucket keeps an exponentially
weighted mean of the per-stream rate, so a change of accept length or prompt mix shows within
the next few dozen streams (SGLang's `avg_spec_accept_length` is cumulative since start and
lags for hours). The aggregate at load ``n`` is ``n x rate(n)``, MTP's stays flat beyond its
running cap (the rest wait). The crossover is the lowest load in the configured bounds at which
plain's aggregate reaches MTP's; without samples covering that comparison there is no estimate
and the configured crossover applies.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# A stream counts as alone when the other server ran less than this many streams on average.
ALONE_BELOW = 0.5
# Weight of the newest sample in its bucket's mean: about the last 1 / ALPHA streams count.
ALPHA = 0.1
# Samples a bucket needs before it is used.
MIN_SAMPLES = 3
# A stream that began decoding before a mode change or less than this after it is no sample:
# the requests moved at the flip prefill again meanwhile and slow every stream of the server.
SETTLE_S = 10.0
# Streams shorter than this (tokens) say more about prefill than about decode speed.
MIN_TOKENS = 16


@dataclass
class _Bucket:
    rate: float = 0.0  # tokens per second per stream (or per chunk, for the accept length)
    samples: int = 0

    def add(self, rate: float) -> None:
        self.samples += 1
        weight = max(ALPHA, 1.0 / self.samples)  # a plain mean until 1 / ALPHA samples
        self.rate += weight * (rate - self.rate)


@dataclass
class ThroughputCurve:
    """One server's per-stream decode rate by the number of streams it was running."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)
    _known: list[int] | None = None  # loads with enough samples, sorted (None: recompute)

    def add(self, running: float, rate: float) -> None:
        self.buckets.setdefault(max(1, round(running)), _Bucket()).add(rate)
        self._known = None

    def aggregate(self, load: int) -> float | None:
        """Tokens per second at `load` streams, interpolated between known buckets; None
        outside them (no extrapolation: a guess is worse than the configured crossover)."""
        if self._known is None:
            self._known = sorted(n for n, b in self.buckets.items() if b.samples >= MIN_SAMPLES)
        known = self._known
        if not known or not known[0] <= load <= known[-1]:
            return None
        i = bisect.bisect_left(known, load)
        above = known[i]
        if above == load:
            return load * self.buckets[load].rate
        below = known[i - 1]
        share = (load - below) / (above - below)
        low_rate, high_rate = self.buckets[below].rate, self.buckets[above].rate
        return load * (low_rate + share * (high_rate - low_rate))


@dataclass
class CrossoverEstimator:
    """Both servers' curves and the crossover they imply."""

    mtp: ThroughputCurve = field(default_factory=ThroughputCurve)
    plain: ThroughputCurve = field(default_factory=ThroughputCurve)
    samples: int = 0
    # MTP's accept length over its recent streams (tokens per SSE chunk: SGLang sends one
    # chunk per decode step, holding the accepted drafts and the bonus token).
    accept: _Bucket = field(default_factory=_Bucket)
    # The last answer, by (samples, arguments): admission asks on every request, samples
    # change only when a stream ends.
    _memo: tuple[tuple[int, int, int, int | None, int | None], int | None] | None = None

    def observe(self, backend: str, tokens: int, seconds: float, running: float,
                other_running: float, chunks: int | None = None) -> None:
        """One finished stream: `tokens` decoded in `seconds` (in `chunks` SSE chunks, when
        counted), after its first byte, with `running` streams on its server and
        `other_running` on the other (both means over the stream's life)."""
        if backend == "mtp" and chunks and tokens >= MIN_TOKENS:
            self.accept.add(tokens / chunks)
        if tokens < MIN_TOKENS or seconds <= 0 or running < 0.5 or other_running >= ALONE_BELOW:
            return
        curve = self.mtp if backend == "mtp" else self.plain
        curve.add(running, tokens / seconds)
        self.samples += 1

    def crossover(self, low: int, high: int, mtp_cap: int | None,
                  plain_cap: int | None = None) -> int | None:
        """The lowest load in [low, high] where plain's aggregate reaches MTP's (loads where
        either is unknown are skipped); `high` when MTP is ahead up to `high`, or up to where
        both servers are at their running caps (beyond, neither makes more); None when the
        samples cannot tell."""
        key = (self.samples, low, high, mtp_cap, plain_cap)
        if self._memo is None or self._memo[0] != key:
            self._memo = (key, self._crossing(low, high, mtp_cap, plain_cap))
        return self._memo[1]

    def _crossing(self, low: int, high: int, mtp_cap: int | None,
                  plain_cap: int | None) -> int | None:
        both_full = None if mtp_cap is None or plain_cap is None else max(mtp_cap, plain_cap)
        for load in range(low, high + 1):
            mtp = self.mtp.aggregate(load if mtp_cap is None else min(load, mtp_cap))
            plain = self.plain.aggregate(load if plain_cap is None else min(load, plain_cap))
            if mtp is None or plain is None:
                continue
            if plain >= mtp:
                return load
            if load == high or (both_full is not None and load >= both_full):
                return high
        return None

    @property
    def accept_length(self) -> float | None:
        return self.accept.rate if self.accept.samples >= MIN_SAMPLES else None

    def throughput(self, backend: str, load: int) -> float:
        """The estimate at `load` (NaN when unknown), for /metrics and the dashboard."""
        value = (self.mtp if backend == "mtp" else self.plain).aggregate(load)
        return math.nan if value is None else value
