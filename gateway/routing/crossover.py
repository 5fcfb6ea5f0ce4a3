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
plain's aggregate reaches MTP's.

Before there are samples, a prior from what the monitor knows (each server's running cap from
/server_info, MTP's accept length) says where plain can overtake MTP at all: MTP's step costs a
measured factor more than plain's at the same batch (`MTP_STEP_COST`), so at its cap it makes
``mtp_cap x accept / factor`` plain-steps' worth of tokens, which plain reaches only with that
many streams running, and never if its cap is lower (`prior_faster`). Per load the learned
estimate overrides the prior only where one server is measured clearly faster
(`LEARNED_MARGIN`): within that margin the samples cannot settle it, and a decision that followed
their noise would flip the mode with it. The answer is which server is faster at each load:
plain from the crossover up, and at low load too where plain was measured clearly faster alone
(`Advice`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from gateway.config import Role

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
# MTP's decode step over plain's at the same batch (one draft step: MTP verifies two tokens a
# request, so the ratio grows with the batch), from the simulator's step tables fitted to the
# seed (gateway/sim/profiles/default.yaml; MTP's points over plain's at the same batch):
# 16.46 / 9.26 ms alone (the seed's C=1 row), 24.0 / 17.0 at 16, 29.85 / 18.5 at 24 (MTP's
# cap, the seed's 24-running row), 45.0 / 21.5 at 48.
MTP_STEP_COST = ((1, 16.46 / 9.26), (8, 20.5 / 13.5), (16, 24.0 / 17.0), (24, 29.85 / 18.5),
                 (48, 45.0 / 21.5))  # 1.78, 1.52, 1.41, 1.61, 2.09
# The learned estimate overrides the prior at a load only where one server's aggregate is
# measured this much above the other's. A stream's decode speed leaves out queueing and
# prefill: chat on the pair's memory read plain 1,142 tok/s at 28 running against MTP's 1,121
# at 24, where plain-only makes 1,189 and mtp-only 1,087 (bench, virtual time).
LEARNED_MARGIN = 0.05


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

    def measured(self, load: int) -> bool:
        """Streams were seen at `load` itself (not only around it)."""
        bucket = self.buckets.get(load)
        return bucket is not None and bucket.samples >= MIN_SAMPLES

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


@dataclass(frozen=True, slots=True)
class Advice:
    """Where plain is the faster server, in the router's units: requests in flight on the
    pair, the new one not counted (the new one makes the load one more)."""

    crossover: int | None  # plain once in flight reaches this (None: cannot tell)
    plain_below: int = 0  # ... and while in flight is below this (plain faster at low load)


def mtp_step_cost(batch: int) -> float:
    """MTP's step over plain's at `batch` running (linear between MTP_STEP_COST's points,
    flat beyond them)."""
    points = MTP_STEP_COST
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, r0), (b1, r1) in zip(points, points[1:], strict=False):
        if batch <= b1:
            return r0 + (r1 - r0) * (batch - b0) / (b1 - b0)
    return points[-1][1]


def prior_faster(load: int, mtp_cap: int | None, plain_cap: int | None,
                 accept_length: float | None) -> Role | None:
    """The faster server at `load` by the running caps and MTP's accept length alone (None when
    one is unknown). At `load`, MTP runs k = min(load, mtp_cap) streams making `accept_length`
    tokens a step at `mtp_step_cost(k)` times plain's step; plain runs q = min(load,
    plain_cap) making one. Plain's step is taken as the same at q as at k (it grows a little
    with the batch, so the real crossover is a load or two higher): plain is faster when
    q x mtp_step_cost(k) >= k x accept_length. Below MTP's cap that is where its dearer step
    outweighs its accepted drafts; above it, plain's extra streams make up the rest, and never
    if plain's cap is too low.

    The crossover is looked for from `crossover_bounds`' low end up. Alone plain is faster too
    when the accept length is below 1.78 (chat's 1.7: 106 against 101 tok/s), but that is not
    used: the first request of a burst from idle would go to plain and share the GPU with MTP's
    batch behind it (chat makespan C=4..24, carried: 0.88-0.95 of the pair's better server
    against 0.98-1.00; lab/results/bench/routing-pair.md). Only streams measured alone send low load
    there."""
    if mtp_cap is None or plain_cap is None or not accept_length:
        return None
    mtp_running, plain_running = min(load, mtp_cap), min(load, plain_cap)
    if plain_running * mtp_step_cost(mtp_running) >= mtp_running * accept_length:
        return "plain"
    return "mtp"


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
    _memo: tuple[tuple[object, ...], Advice] | None = None

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

    def advise(self, low: int, high: int, mtp_cap: int | None, plain_cap: int | None,
               accept_length: float | None) -> Advice:
        """Where plain is faster, by the samples where they are clear, else by the prior:
        the crossover within [low, high] (`high` when MTP is faster up to where both servers
        are at their caps, beyond which neither makes more), and the low loads below `low`
        where plain is faster from the first stream on."""
        accept = None if accept_length is None else round(accept_length, 2)
        key = (self.samples, low, high, mtp_cap, plain_cap, accept)
        if self._memo is None or self._memo[0] != key:
            self._memo = (key, self._advise(low, high, mtp_cap, plain_cap, accept))
        return self._memo[1]

    def _advise(self, low: int, high: int, mtp_cap: int | None, plain_cap: int | None,
                accept: float | None) -> Advice:
        def faster(load: int) -> Role | None:
            learned = self.learned_faster(load, mtp_cap, plain_cap)
            return learned or prior_faster(load, mtp_cap, plain_cap, accept)

        def both_seen_at(load: int) -> bool:  # at low load no guess between far buckets
            return self.mtp.measured(load) and self.plain.measured(load)

        plain_up_to = 0  # a load (streams with the new one): measured only, see prior_faster
        while (plain_up_to + 1 < low and both_seen_at(plain_up_to + 1)
               and self.learned_faster(plain_up_to + 1, mtp_cap, plain_cap) == "plain"):
            plain_up_to += 1
        both_full = None if mtp_cap is None or plain_cap is None else max(mtp_cap, plain_cap)
        for in_flight in range(low, high + 1):
            server = faster(in_flight + 1)
            if server == "plain":
                return Advice(in_flight, plain_up_to)
            if server == "mtp" and (in_flight == high or (both_full is not None
                                                          and in_flight + 1 >= both_full)):
                break
        else:
            return Advice(None, plain_up_to)
        return Advice(high, plain_up_to)

    def learned_faster(self, load: int, mtp_cap: int | None,
                       plain_cap: int | None) -> Role | None:
        """The server measured faster at `load` by more than `LEARNED_MARGIN` (None: unknown,
        or too close to call)."""
        mtp = self.mtp.aggregate(load if mtp_cap is None else min(load, mtp_cap))
        plain = self.plain.aggregate(load if plain_cap is None else min(load, plain_cap))
        if mtp is None or plain is None:
            return None
        if plain > mtp * (1 + LEARNED_MARGIN):
            return "plain"
        if mtp > plain * (1 + LEARNED_MARGIN):
            return "mtp"
        return None

    @property
    def accept_length(self) -> float | None:
        return self.accept.rate if self.accept.samples >= MIN_SAMPLES else None
