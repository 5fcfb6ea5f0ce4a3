"""The crossover learned from relayed streams (gateway.routing.crossover) and the router feeding it."""

from __future__ import annotations

import pytest

from gateway.config import Routing
from gateway.routing.crossover import (
    ALONE_BELOW,
    LEARNED_MARGIN,
    MIN_SAMPLES,
    MIN_TOKENS,
    MTP_STEP_COST,
    Advice,
    CrossoverEstimator,
    ThroughputCurve,
    mtp_step_cost,
    prior_faster,
)
from gateway.routing.policy import effective_crossover
from gateway.routing.pool import Ask, Lease, Outcome, Pool
from gateway.sim.profile import load_profiles
from tests.test_load import one_pair

PROFILES = load_profiles()


def per_stream_rate(backend: str, running: int, accept_length: float = 2.0) -> float:
    """Decode tokens per second per stream as the simulator's profile gives it."""
    profile = PROFILES[backend]
    tokens_per_step = accept_length if profile.speculative else 1.0
    return tokens_per_step / profile.decode_step_s(running)


def feed(estimator: CrossoverEstimator, backend: str, loads: range, accept_length: float = 2.0,
         streams: int = 20) -> None:
    for running in loads:
        rate = per_stream_rate(backend, running, accept_length)
        for _ in range(streams):
            estimator.observe(backend, 500, 500 / rate, running, 0.0, chunks=round(500 / (
                accept_length if backend == "mtp" else 1.0)))


def test_the_curve_interpolates_between_known_loads_and_never_guesses_beyond() -> None:
    curve = ThroughputCurve()
    for _ in range(3):
        curve.add(10, 50.0)
        curve.add(20, 40.0)
    assert curve.aggregate(10) == pytest.approx(500.0)
    assert curve.aggregate(15) == pytest.approx(15 * 45.0)
    assert curve.aggregate(9) is None and curve.aggregate(21) is None


def crossover(estimator: CrossoverEstimator, low: int, high: int, mtp_cap: int | None,
              plain_cap: int | None = None, accept_length: float | None = None) -> int | None:
    return estimator.advise(low, high, mtp_cap, plain_cap, accept_length).crossover


def test_no_estimate_until_both_servers_were_seen() -> None:
    estimator = CrossoverEstimator()  # plain's cap unknown: no prior either
    assert crossover(estimator, 16, 48, mtp_cap=24) is None
    feed(estimator, "mtp", range(1, 25))
    assert crossover(estimator, 16, 48, mtp_cap=24) is None


def test_the_estimate_finds_where_plain_is_clearly_faster_and_follows_a_drop_in_acceptance():
    estimator = CrossoverEstimator()
    feed(estimator, "mtp", range(1, 25), accept_length=2.0)
    feed(estimator, "plain", range(16, 65))
    # MTP at its cap of 24 with every draft accepted: 24 x 2 / 29.85 ms = 1,608 tok/s; plain
    # makes 33 / 19.625 ms = 1,682 at 33 running (4.6 % more: within the margin, no verdict)
    # and 34 / 19.75 ms = 1,722 at 34 (7.1 %): plain once 33 are in flight, the new one the 34th.
    assert crossover(estimator, 16, 48, mtp_cap=24) == 33
    feed(estimator, "mtp", range(1, 25), accept_length=1.5, streams=60)  # the traffic changed
    # MTP: 22 x 1.5 / 28.39 ms = 1,162 tok/s at 22 running, 1,185 at 23; plain: 1,214 at 22
    # (4.5 % more), 1,256 at 23 (6.0 %).
    assert crossover(estimator, 16, 48, mtp_cap=24) == 22


def test_mtp_ahead_over_the_whole_range_gives_the_upper_bound() -> None:
    estimator = CrossoverEstimator()
    feed(estimator, "mtp", range(1, 25), accept_length=4.0)
    feed(estimator, "plain", range(16, 42))
    assert crossover(estimator, 16, 40, mtp_cap=24) == 40


def test_the_prior_needs_no_sample_caps_and_accept_length_say_where_plain_can_overtake() -> None:
    """MTP's step costs 1.61x plain's at 24 running and 2.09x at 48 (the seed's step tables).
    With MTP's cap of 24 it makes 24 x accept / 1.61 plain-streams' worth: with the pair's 28
    slots plain never overtakes the seed (29.7 > 28), with the seed's 68 it does from the 30th
    stream (in flight 29; the configured crossover, fitted to the seed, is 31), and chat's
    accept length 1.7 brings it down to the 26th (25.3). With MTP's cap of 48 (4x H200) plain
    overtakes below it, where MTP's step outweighs its drafts: 1.7 from the 29th stream (the
    step ratio 1.70 there), 2.0 from the 44th. Low load stays on MTP until plain is measured
    faster there (alone the step ratio is 1.78 > 1.7: a burst from idle would split)."""
    cold = CrossoverEstimator()
    assert cold.advise(16, 256, 24, 28, 2.0) == Advice(256, 0)
    assert cold.advise(16, 256, 24, 68, 2.0) == Advice(29, 0)
    assert cold.advise(16, 256, 24, 28, 1.7) == Advice(25, 0)
    assert cold.advise(16, 256, 48, 100, 1.7) == Advice(28, 0)
    assert cold.advise(16, 256, 48, 100, 2.0) == Advice(43, 0)
    assert cold.advise(16, 256, 24, None, 2.0) == Advice(None, 0)  # a cap unknown: no prior
    assert [prior_faster(n, 24, 28, 1.7) for n in (24, 25, 26, 28)] == ["mtp", "mtp", "plain", "plain"]
    assert mtp_step_cost(1) == pytest.approx(1.78, abs=0.005)
    assert mtp_step_cost(36) == pytest.approx((1.614 + 2.093) / 2, abs=0.005)


def test_samples_override_the_prior_only_where_one_server_is_clearly_faster() -> None:
    """Chat on the pair's memory, prior 25: samples where plain at 26..28 is within 5 % of
    MTP leave it (the mode does not follow their noise); samples where MTP is clearly ahead at
    every load up to both caps keep the pair on MTP; plain measured clearly faster at 1..3
    running sends those low loads to plain."""
    def rates(backend: str, loads: range, scale: float) -> CrossoverEstimator:
        estimator = CrossoverEstimator()
        for running in loads:
            rate = per_stream_rate(backend, running, 1.7) * scale
            for _ in range(5):
                estimator.observe(backend, 500, 500 / rate, running, 0.0)
        return estimator

    def pair(mtp_scale: float, plain_scale: float, loads: range) -> CrossoverEstimator:
        estimator = rates("mtp", loads, mtp_scale)
        estimator.plain = rates("plain", loads, plain_scale).plain
        estimator.samples = 1
        return estimator

    # Per the profile, plain at 28 running makes 1,474 tok/s, MTP at its cap 24 x 1.7 / 29.85
    # ms = 1,367 (plain 7.8 % ahead). Scaled to a tie (plain 2 % ahead): the prior decides.
    tie = pair(1.0, 1.0 / 1.078 * 1.02, range(16, 29))
    assert tie.advise(16, 256, 24, 28, 1.7).crossover == 25
    mtp_ahead = pair(1.0, 0.85, range(16, 29))
    assert mtp_ahead.advise(16, 256, 24, 28, 1.7).crossover == 256
    alone = pair(1.0, 1.2, range(1, 4))  # plain 20 % faster at 1..3 running, unknown above
    assert alone.advise(16, 256, 24, 28, 1.7).plain_below == 3


def test_streams_that_shared_the_gpu_are_not_samples() -> None:
    estimator = CrossoverEstimator()
    for _ in range(10):
        estimator.observe("plain", 500, 50.0, running=20, other_running=3.0)
        estimator.observe("plain", 5, 0.1, running=20, other_running=0.0)  # too short
    assert estimator.samples == 0 and estimator.plain.aggregate(20) is None


def test_accept_length_follows_the_recent_streams() -> None:
    estimator = CrossoverEstimator()
    for _ in range(200):
        estimator.observe("mtp", 400, 10.0, 8, 0.0, chunks=200)  # 2.0 tokens per chunk
    for _ in range(30):
        estimator.observe("mtp", 300, 10.0, 8, 0.0, chunks=200)  # 1.5 from now on
    # The average since start (what SGLang's /server_info reports) would still say 1.93.
    assert estimator.accept_length == pytest.approx(1.5, abs=0.03)


def test_learned_crossover_wins_within_the_bounds() -> None:
    routing = Routing(crossover=31, crossover_bounds=(16, 40))
    assert effective_crossover(routing, 1.7, learned=None) == 26
    assert effective_crossover(routing, 1.7, learned=22) == 22
    assert effective_crossover(routing, 1.7, learned=60) == 40


def test_a_bound_at_or_below_the_hysteresis_is_refused() -> None:
    with pytest.raises(ValueError, match="crossover_bounds"):
        Routing(hysteresis=6, crossover_bounds=(6, 40))


def learning_pool() -> Pool:
    return one_pair(Routing(adaptive_crossover=True))


def test_the_router_samples_a_stream_with_its_mean_load() -> None:
    pool = learning_pool()
    leases = [pool.admit(Ask(), now=0.0) for _ in range(4)]
    assert all(isinstance(lease, Lease) for lease in leases)
    first = leases[0]
    first.first_byte(0.0)
    for lease in leases[1:3]:  # two others end halfway through its 20 s
        lease.end(Outcome.SUCCESS, 10.0)
    first.output_tokens, first.output_chunks = 1001, 501
    first.end(Outcome.SUCCESS, 20.0)
    estimator = pool.pairs["default"].estimator
    assert estimator.samples == 1
    ((running, bucket),) = estimator.mtp.buckets.items()
    assert running == 3  # 4 streams for 10 s, then 2 for 10 s
    assert bucket.rate == pytest.approx(1000 / 20.0)
    assert estimator.accept.rate == pytest.approx(2.0)


def test_the_estimate_is_on_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import PoolCollector

    pool = one_pair(Routing(adaptive_crossover=True, crossover_bounds=(16, 48)))
    pool.backends["mtp"].record_server_info(24, None)
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))
    before = generate_latest(registry).decode()
    assert "\ngateway_learned_crossover " not in before  # nothing learned: no sample, no guess
    estimator = pool.pairs["default"].estimator
    feed(estimator, "mtp", range(1, 25), accept_length=1.5)
    feed(estimator, "plain", range(16, 65))
    text = generate_latest(registry).decode()
    # Only ever seen at 1.5: plain is clearly (> 5 %) faster from 23 running, below MTP's cap
    # (23 x 1.5 / 29.12 ms = 1,185 tok/s against plain's 23 / 18.31 ms = 1,256): plain once
    # 22 are in flight. At 22 the two are within the margin (1,162 against 1,214).
    assert "gateway_learned_crossover 22.0" in text
    assert "gateway_crossover 22.0" in text  # and it is the one in force
    assert "gateway_recent_accept_length 1.50" in text
    assert 'gateway_estimated_throughput{backend="plain"} 1213.7' in text
    assert 'gateway_estimated_throughput{backend="mtp"} 1162.4' in text
    assert "gateway_plain_below 0.0" in text  # plain never seen alone at low load
    for _ in range(5):  # now plain alone at 1 running, 20 % faster than MTP's 1.5 / 16.46 ms
        estimator.observe("plain", 500, 500 / (1.2 * 1.5 / 0.01646), 1, 0.0)
    # Only 1 running was seen, then 16: no guess in between (interpolated, plain would read
    # faster up to 12).
    assert "gateway_plain_below 1.0" in generate_latest(registry).decode()


# --- live: the relay tells the router when a stream starts and how many tokens it made ------

@pytest.mark.timeout(30)
async def test_a_relayed_stream_is_started_at_its_first_byte_and_becomes_a_sample(sim) -> None:
    import httpx

    from tests.conftest import live_gateway
    from tests.test_gateway_live import OpenStream, chat, settled

    async with live_gateway(sim, routing={"adaptive_crossover": True}) as gateway, \
            httpx.AsyncClient(timeout=10) as client:
        mtp, estimator = gateway.pool.backends["mtp"], gateway.pool.pairs["default"].estimator
        body = chat(max_tokens=64, stream=True, stream_options={"include_usage": True},
                    ignore_eos=True)
        stream = await OpenStream(client, gateway.url + "/v1/chat/completions", body).open()
        try:
            assert stream.backend == "mtp"
            # Its first byte came: it is no longer movable, though still in flight.
            assert (mtp.inflight, mtp.not_started) == (1, 0)
            async for _ in stream.chunks:
                pass
        finally:
            await stream.close()
        await settled(gateway, 0)
        assert estimator.samples == 1
        ((running, bucket),) = estimator.mtp.buckets.items()
        assert running == 1 and bucket.rate > 0


def test_mtp_ahead_when_both_servers_are_full_means_plain_never_overtakes() -> None:
    """The pair's own memory (plain 28 running, MTP 24): MTP at its cap makes 24 x 2 / 29.85 ms
    = 1,608 tok/s, plain at its cap 28 / 19.1 ms = 1,466; beyond both caps neither makes
    more, so the crossover is the upper bound (never plain), not unknown."""
    estimator = CrossoverEstimator()
    feed(estimator, "mtp", range(1, 25))
    feed(estimator, "plain", range(16, 29))
    assert crossover(estimator, 16, 256, mtp_cap=24, plain_cap=28) == 256
    assert crossover(estimator, 16, 256, mtp_cap=24, plain_cap=None) is None  # plain's cap unknown


def test_a_sweep_can_carry_what_was_learned_from_level_to_level(monkeypatch) -> None:
    from gateway.bench import virtual
    from gateway.bench.levels import plan_levels
    from gateway.bench.workloads import make_workload

    handed: dict[bool, list[CrossoverEstimator | None]] = {False: [], True: []}
    run_level = virtual.run_virtual_level
    for carry in (False, True):
        def spy(*args, learned=None, carry=carry, **kwargs):
            handed[carry].append(learned)
            return run_level(*args, learned=learned, **kwargs)
        monkeypatch.setattr(virtual, "run_virtual_level", spy)
        virtual.run_virtual_sweep(lambda: make_workload("seed", max_tokens=50),
                                  plan_levels([2, 3], requests_per_level=4),
                                  Routing(adaptive_crossover=True), PROFILES,
                                  policies=("crossover",), carry_learning=carry)
    assert handed[False] == [None, None]  # each level starts cold
    first, second = handed[True]
    assert first is second and first is not None and first.samples > 0


def test_cold_the_prior_keeps_the_seed_on_mtp_where_the_pairs_plain_loses() -> None:
    """Before any sample, C=40 on the pair's memory: the caps say plain's 28 slots never catch
    MTP's 24 at accept length 2 (the configured crossover 31 sent it to plain: 0.918)."""
    from gateway.bench.levels import plan_levels
    from gateway.bench.virtual import run_virtual_sweep
    from gateway.bench.workloads import make_workload

    plans = plan_levels([40], duration_s=80.0, warmup_s=30.0)
    cold = run_virtual_sweep(lambda: make_workload("seed", max_tokens=200), plans,
                             Routing(adaptive_crossover=True), PROFILES,
                             policies=("crossover", "mtp-only"))
    assert cold["gateway"][0].share.get("mtp", 0) > 0.99
    assert cold["gateway"][0].aggregate_tps >= 0.95 * cold["mtp-only"][0].aggregate_tps


def test_streams_through_a_mode_change_and_its_aftermath_are_not_samples() -> None:
    """At the flip, the requests moved to plain prefill again and slow every plain stream for a
    while: samples from then read plain ~15 % slower than it is (chat on the pair's memory:
    1,009 tok/s at 28 running against the 1,189 plain-only makes), and the learned crossover
    kept chat on MTP (lab/results/bench/routing-pair.md)."""
    pool = one_pair(Routing(adaptive_crossover=True, crossover=4, hysteresis=1, min_dwell_s=600))
    leases = [pool.admit(Ask(), now=100.0) for _ in range(5)]  # the 5th flips the mode
    assert pool.pairs["default"].mode == "plain"
    for lease in leases[:4]:  # MTP is idle from the flip on: both would be samples else
        lease.end(Outcome.CLIENT_GONE, 100.0)
    during = leases[4]
    during.first_byte(101.0)
    during.output_tokens = 500
    during.end(Outcome.SUCCESS, 120.0)
    later = pool.admit(Ask(), now=125.0)
    later.first_byte(125.0)
    later.output_tokens = 500
    later.end(Outcome.SUCCESS, 140.0)
    estimator = pool.pairs["default"].estimator
    assert estimator.samples == 1  # the later one only
    assert list(estimator.plain.buckets) == [1]


def test_carried_over_a_rising_load_chat_at_28_running_goes_to_plain() -> None:
    """Chat on the pair's memory: plain alone makes 1,189 tok/s at C=28, MTP 1,087. Carried
    from C=24, the learned crossover used to sit at the load (28 counting the new request,
    against 27 in flight) after one low reading of plain had sent the pair back to MTP, where
    plain was never sampled again: 1,007 tok/s (0.847)."""
    from gateway.bench.levels import plan_levels
    from gateway.bench.virtual import run_virtual_sweep
    from gateway.bench.workloads import make_workload

    plans = plan_levels([24, 28], duration_s=150.0, warmup_s=50.0)
    results = run_virtual_sweep(lambda: make_workload("chat"), plans,
                                Routing(adaptive_crossover=True), PROFILES,
                                policies=("crossover", "plain-only"), carry_learning=True)
    gateway, plain = results["gateway"][1], results["plain-only"][1]
    assert gateway.concurrency == 28 and gateway.share.get("plain", 0) > 0.99
    assert gateway.aggregate_tps >= 0.95 * plain.aggregate_tps


# --- the edges of each rule ---------------------------------------------------------------

def measured(rates: dict[int, float], samples: int = MIN_SAMPLES) -> ThroughputCurve:
    """A curve with `samples` streams at each load, each at that load's per-stream rate."""
    curve = ThroughputCurve()
    for load, rate in rates.items():
        for _ in range(samples):
            curve.add(load, rate)
    return curve


def estimator_of(mtp: dict[int, float], plain: dict[int, float]) -> CrossoverEstimator:
    estimator = CrossoverEstimator(mtp=measured(mtp), plain=measured(plain))
    estimator.samples = 1  # advise's memo is keyed by the count
    return estimator


def test_a_load_is_measured_from_min_samples_streams() -> None:
    assert measured({4: 10.0}, MIN_SAMPLES).measured(4)
    assert measured({4: 10.0}, MIN_SAMPLES).aggregate(4) == 40.0
    assert not measured({4: 10.0}, MIN_SAMPLES - 1).measured(4)
    assert measured({4: 10.0}, MIN_SAMPLES - 1).aggregate(4) is None


def test_the_step_cost_between_and_beyond_its_points() -> None:
    (b0, r0), (b1, r1) = MTP_STEP_COST[:2]
    assert mtp_step_cost(0) == r0  # below the first point: flat
    assert mtp_step_cost(b0) == r0
    assert mtp_step_cost((b0 + b1) // 2) == pytest.approx(r0 + (r1 - r0) * ((b0 + b1) // 2 - b0) / (b1 - b0))
    assert mtp_step_cost(b1) == pytest.approx(r1)
    assert mtp_step_cost(MTP_STEP_COST[-1][0]) == pytest.approx(MTP_STEP_COST[-1][1])
    assert mtp_step_cost(500) == MTP_STEP_COST[-1][1]  # beyond the last: flat


def test_the_prior_calls_a_tie_for_plain() -> None:
    """Plain is faster when its tokens per MTP step reach MTP's: equal counts as reached."""
    accept = mtp_step_cost(1)  # alone, MTP's accepted tokens exactly pay for its dearer step
    assert prior_faster(1, 24, 28, accept) == "plain"
    assert prior_faster(1, 24, 28, accept * 1.01) == "mtp"
    assert prior_faster(1, 24, 28, 0.0) is None


@pytest.mark.parametrize(("tokens", "seconds", "running", "other", "sample"), [
    (MIN_TOKENS, 1.0, 4, 0.0, True),
    (MIN_TOKENS - 1, 1.0, 4, 0.0, False),
    (100, 0.0, 4, 0.0, False),  # no decode time measured: no rate
    (100, 1.0, 0.5, 0.0, True),
    (100, 1.0, 0.49, 0.0, False),
    (100, 1.0, 4, ALONE_BELOW - 0.01, True),
    (100, 1.0, 4, ALONE_BELOW, False),
])
def test_which_streams_are_samples(tokens, seconds, running, other, sample: bool) -> None:
    estimator = CrossoverEstimator()
    estimator.observe("plain", tokens, seconds, running, other)
    assert estimator.samples == (1 if sample else 0)
    assert bool(estimator.plain.buckets) is sample and not estimator.mtp.buckets


def test_the_accept_length_counts_streams_of_min_tokens_and_more() -> None:
    estimator = CrossoverEstimator()
    for _ in range(MIN_SAMPLES):
        estimator.observe("mtp", MIN_TOKENS - 1, 1.0, 4, 0.0, chunks=5)
    assert estimator.accept_length is None
    for _ in range(MIN_SAMPLES):
        estimator.observe("mtp", MIN_TOKENS, 1.0, 4, 9.0, chunks=8)  # shared the GPU: still counts
    assert estimator.accept_length == MIN_TOKENS / 8
    estimator.observe("plain", 100, 1.0, 4, 0.0, chunks=50)  # plain's chunks say nothing
    assert estimator.accept_length == MIN_TOKENS / 8


def test_the_margin_is_strict_both_ways() -> None:
    even = 100.0 * (1 + LEARNED_MARGIN)
    assert estimator_of({1: 100.0}, {1: even}).learned_faster(1, 24, 28) is None
    assert estimator_of({1: even}, {1: 100.0}).learned_faster(1, 24, 28) is None
    assert estimator_of({1: 100.0}, {1: even * 1.001}).learned_faster(1, 24, 28) == "plain"
    assert estimator_of({1: even * 1.001}, {1: 100.0}).learned_faster(1, 24, 28) == "mtp"


def test_beyond_its_cap_a_server_makes_what_it_makes_at_the_cap() -> None:
    """Past its running cap the rest wait: plain measured up to its cap of 4 is compared at
    6 by its rate at 4, against MTP (no cap known) at 6."""
    estimator = estimator_of({4: 100.0, 6: 60.0}, {4: 100.0})
    assert estimator.learned_faster(6, None, 4) == "plain"  # 400 against MTP's 360
    assert estimator.learned_faster(6, None, None) is None  # plain not seen at 6
    assert estimator.advise(1, 8, None, 4, None) == Advice(5, 0)
    capped_mtp = estimator_of({4: 100.0, 6: 80.0}, {4: 100.0, 6: 75.0})
    assert capped_mtp.learned_faster(6, 4, None) == "plain"  # 450 against MTP's 400 at its cap
    assert capped_mtp.learned_faster(6, None, None) == "mtp"  # 480 against 450


def test_low_loads_go_to_plain_where_measured_faster_each_server_at_most_at_its_cap() -> None:
    # Per-stream rates: plain 10 % ahead at 1 and 2 running. At 3, MTP running 3 beats plain
    # (360 against 330), but with MTP's cap of 2 it runs two (200): plain is faster up to 3.
    mtp_ahead_at_3 = estimator_of({1: 100.0, 2: 100.0, 3: 120.0}, {1: 110.0, 2: 110.0, 3: 110.0})
    assert mtp_ahead_at_3.advise(16, 40, 24, 28, None).plain_below == 2
    assert mtp_ahead_at_3.advise(16, 40, 2, 28, None).plain_below == 3
    # And the other way round: plain running 3 beats MTP (390 against 300), plain capped at 2
    # does not (220).
    plain_ahead_at_3 = estimator_of({1: 100.0, 2: 100.0, 3: 100.0}, {1: 110.0, 2: 110.0, 3: 130.0})
    assert plain_ahead_at_3.advise(16, 40, 24, 28, None).plain_below == 3
    assert plain_ahead_at_3.advise(16, 40, 24, 2, None).plain_below == 2


def test_low_load_advice_stops_below_the_crossovers_low_bound() -> None:
    plain_ahead = {n: 120.0 for n in range(1, 7)}
    estimator = estimator_of({n: 100.0 for n in range(1, 7)}, plain_ahead)
    assert estimator.advise(4, 40, 24, 28, None).plain_below == 3


def test_low_load_advice_is_kept_whatever_the_crossover() -> None:
    """Plain measured faster alone is advice even when the crossover cannot be told (no
    prior: a cap unknown) or MTP is ahead up to both caps."""
    alone = estimator_of({1: 100.0, 2: 100.0}, {1: 120.0, 2: 120.0})
    assert alone.advise(16, 40, 24, None, None) == Advice(None, 2)
    assert alone.advise(16, 40, 24, 28, 4.0) == Advice(40, 2)  # MTP far ahead by the prior


def test_the_crossover_at_both_caps_is_still_found() -> None:
    """MTP's cap 24, plain's 28: at accept 1.85 plain's 28 streams first overtake MTP's 24
    at a load of 28 (in flight 27), the last load before neither server makes more."""
    assert CrossoverEstimator().advise(16, 256, 24, 28, 1.85) == Advice(27, 0)


def test_no_crossover_is_advised_beyond_the_upper_bound() -> None:
    estimator = estimator_of({n: 100.0 for n in range(1, 41)}, {28: 200.0, 29: 200.0})
    assert estimator.advise(16, 26, None, None, None) == Advice(None, 0)
    assert estimator.advise(16, 27, None, None, None) == Advice(27, 0)


def test_a_known_plain_cap_with_mtps_unknown_gives_no_prior() -> None:
    assert CrossoverEstimator().advise(16, 40, None, 28, 2.0) == Advice(None, 0)


def test_the_accept_length_counts_to_two_decimals() -> None:
    """advise is asked on every request and remembers its answer until a sample or an
    argument changes: MTP's accept length moves in the third decimal from stream to stream."""
    cold = CrossoverEstimator()
    for step in range(600):
        accept = 1.5 + step * 0.000_7
        assert cold.advise(16, 256, 24, 68, accept) == cold.advise(16, 256, 24, 68, round(accept, 2))
