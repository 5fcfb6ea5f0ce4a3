"""Open-loop arrivals (gateway/bench/arrivals.py) and the open-loop driver in virtual time.

The statistical checks are seeded, so each gives the same answer on every run; each one's
interval is computed from the distribution it checks (not a loose tolerance), at 99.9 %:

- the mean rate: n intervals of Gamma(shape b, scale 1/(r b)) sum to S ~ Gamma(n b, 1/(r b)), so
  2 r b S ~ chi-square(2 n b) and r lies in [chi2_{a/2}(2nb), chi2_{1-a/2}(2nb)] / (2 b S);
- the count in a duration D of a Poisson process: Poisson(r D);
- the intervals' spread: with Y = r X ~ Gamma(b, 1/b) (mean 1, variance 1/b), V = mean((Y - 1)^2)
  has mean 1/b and, by the central limit theorem, standard deviation sqrt((2b + 6) / (b^3 n))
  (Var (Y - 1)^2 = mu4 - sigma^4 = 3(b + 2)/b^3 - 1/b^2); so the coefficient of variation is
  1/sqrt(b), as gamma says.
"""

import math
import statistics

import pytest

from gateway.bench.arrivals import OpenLoop, arrival_times, span_rate
from gateway.bench.targets import build_targets, run_open
from gateway.bench.workloads import Chat
from gateway.config import load_settings

Z = statistics.NormalDist().inv_cdf(1 - 0.001 / 2)  # two-sided 99.9 %
ROUTING = load_settings(None).routing


def chi2_quantile(p: float, k: float) -> float:
    """Wilson-Hilferty: the chi-square quantile, relative error < 1e-5 for k in the thousands."""
    z = statistics.NormalDist().inv_cdf(p)
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def rate_interval(times: list[float], burstiness: float, alpha: float = 0.001) -> tuple[float, float]:
    n = len(times) - 1  # intervals
    total = times[-1] - times[0]
    k = 2 * n * burstiness
    return (chi2_quantile(alpha / 2, k) / (2 * burstiness * total),
            chi2_quantile(1 - alpha / 2, k) / (2 * burstiness * total))


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_rate_within_its_confidence_interval(seed, burstiness):
    rate = 5.0
    times = arrival_times(rate, burstiness=burstiness, seed=seed, count=20_001)
    low, high = rate_interval(times, burstiness)
    assert low < rate < high
    # and it discriminates: a rate 15 % off falls outside it (a gamma scale without the
    # burstiness folded in would be off by 1/b)
    assert rate / 1.15 < low and high < rate * 1.15
    assert span_rate(times) == pytest.approx(rate, rel=(high - low) / rate)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_count_over_a_duration(seed):
    rate, duration = 20.0, 500.0
    times = arrival_times(rate, seed=seed, duration_s=duration)
    mean = rate * duration  # Poisson(r D); the arrival at 0 is one of the process's points
    assert abs(len(times) - mean) < Z * math.sqrt(mean)
    assert times[0] == 0.0 and all(t < duration for t in times)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_interval_cv_as_gamma_says(burstiness):
    rate, n = 3.0, 40_000
    times = arrival_times(rate, burstiness=burstiness, seed=7, count=n + 1)
    ys = [rate * (b - a) for a, b in zip(times, times[1:], strict=False)]
    v = statistics.fmean((y - 1) ** 2 for y in ys)
    sd = math.sqrt((2 * burstiness + 6) / (burstiness**3 * n))
    assert abs(v - 1 / burstiness) < Z * sd
    cv = statistics.pstdev(ys) / statistics.fmean(ys)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_bounds_order_and_refusals():
    times = arrival_times(2.0, seed=3, count=50)
    assert len(times) == 50 and times[0] == 0.0 and times == sorted(times)
    assert arrival_times(2.0, seed=3, count=50) == times  # seeded
    assert arrival_times(2.0, seed=4, count=50) != times
    both = arrival_times(2.0, seed=3, count=50, duration_s=5.0)
    assert both == [t for t in times if t < 5.0]
    assert arrival_times(math.inf, count=4) == [0.0] * 4  # bench_serving's --request-rate inf
    for bad in ({"rate": 0.0}, {"rate": -1.0}, {"rate": math.nan}, {"burstiness": 0.0},
                {"burstiness": math.inf}):
        with pytest.raises(ValueError):
            arrival_times(**{"rate": 1.0, "count": 3, **bad})
    with pytest.raises(ValueError, match="bound"):
        arrival_times(1.0)
    with pytest.raises(ValueError, match="count"):
        arrival_times(math.inf, duration_s=3.0)
    with pytest.raises(ValueError, match="order"):
        OpenLoop((1.0, 0.5))
    assert math.isinf(span_rate([0.0, 0.0])) and math.isnan(span_rate([1.0]))


# --- the open-loop driver in virtual time -------------------------------------------------------

def _overlapping(intervals: list[tuple[float, float]]) -> int:
    """The most intervals [start, end) alive at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    alive = peak = 0
    for _, step in events:
        alive += step
        peak = max(peak, alive)
    return peak


def test_requests_start_at_their_scheduled_time_whatever_is_running():
    """An overload (chat at 6 req/s on one MTP server): every request reaches the simulator at
    its scheduled arrival while earlier ones still run, and its latency counts from then."""
    target = build_targets(["single-mtp"])[0]
    times = tuple(arrival_times(6.0, seed=1, count=120))
    run = run_open(target, Chat(seed=0), OpenLoop(times), ROUTING, log_requests=True)
    log = run.request_log
    assert log is not None and len(log) == len(times)
    assert [e.at for e in log] == list(times)
    assert [r.start for r in run.records] == list(times)  # latency from the schedule
    assert all(r.sent == r.start for r in run.records)
    assert _overlapping([(e.at, e.end) for e in log if e.end is not None]) > 20  # not closed-loop
    # it fell behind: TTFT (from the arrival) grows with the queue
    ttfts = [r.ttft for r in run.records if r.ttft is not None]
    assert max(ttfts) > 10 * min(ttfts)


def test_max_in_flight_holds_arrivals_at_the_client_and_counts_their_wait():
    target = build_targets(["single-mtp"])[0]
    times = tuple(arrival_times(6.0, seed=1, count=60))
    run = run_open(target, Chat(seed=0), OpenLoop(times, max_in_flight=4), ROUTING, log_requests=True)
    log = run.request_log
    assert log is not None
    assert _overlapping([(e.at, e.end) for e in log if e.end is not None]) == 4
    held = [r for r in run.records if r.sent is not None and r.sent > r.start]
    assert held, "an overload past 4 in flight holds arrivals back"
    for r in run.records:
        assert r.sent is not None and r.end is not None and r.first is not None
        assert r.start in times and r.e2e == r.end - r.start and r.e2e >= r.end - r.sent
    # the client releases the oldest first: sent in arrival order, each timed from its arrival
    assert [r.start for r in run.records] == list(times)
