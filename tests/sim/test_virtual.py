"""Virtual-time behaviour: the seed calibration, the shared device, caps, cache and aborts."""

import dataclasses
import functools

import pytest

from gateway.sim.engine import QueueFullError, Request
from gateway.sim.profile import seed_profiles
from gateway.sim.virtual import VirtualSim, run_seed_benchmark

PROFILES = seed_profiles()  # the seed's single servers: the calibration target


@functools.cache  # the runs are deterministic, so tests share them
def seed(backend: str, concurrency: int):
    return run_seed_benchmark(PROFILES, {backend: concurrency})[backend]


def within(value: float, target: float, tolerance: float = 0.10) -> bool:
    return abs(value - target) <= tolerance * target


# --- calibration against the seed (docs/results.md, "The seed workload") -----------------


@pytest.mark.parametrize(
    ("backend", "concurrency", "per_request", "aggregate"),
    [
        ("plain", 1, 108, 108),
        ("mtp", 1, 121.5, 121.5),
        ("plain", 128, 41, 2800),
        ("mtp", 128, 64.5, 1635),
    ],
)
def test_seed_rows_within_ten_percent(backend, concurrency, per_request, aggregate):
    result = seed(backend, concurrency)
    assert within(result.per_request_tps, per_request), result
    assert within(result.aggregate_tps, aggregate), result


def test_mtp_runs_24_of_48_at_full_acceptance_on_the_seed_prompt():
    result = seed("mtp", 128)
    assert result.max_running == 24
    assert PROFILES["mtp"].resolved_max_running_requests == 48
    assert result.accept_length == pytest.approx(2.0)


@pytest.mark.parametrize("concurrency", [1, 8, 16])
def test_mtp_is_ahead_per_request_up_to_c16(concurrency):
    ratio = seed("mtp", concurrency).per_request_tps / seed("plain", concurrency).per_request_tps
    assert 1.10 <= ratio <= 1.50


def test_aggregate_crossover_lies_between_c24_and_c64():
    sweep = [1, 16, 24, 32, 64, 128]
    plain_wins = [seed("plain", c).aggregate_tps > seed("mtp", c).aggregate_tps for c in sweep]
    crossover = sweep[plain_wins.index(True)]
    assert 24 < crossover <= 64
    assert all(plain_wins[sweep.index(crossover) :])  # and plain stays ahead above it


def test_seed_benchmark_is_deterministic():
    assert run_seed_benchmark(PROFILES, {"mtp": 16}) == run_seed_benchmark(PROFILES, {"mtp": 16})


# --- the shared device --------------------------------------------------------------------


def test_both_servers_at_once_share_the_device():
    split = run_seed_benchmark(PROFILES, {"mtp": 24, "plain": 40})
    plain_alone_64 = seed("plain", 64)
    assert split["mtp"].aggregate_tps + split["plain"].aggregate_tps < plain_alone_64.aggregate_tps
    assert split["mtp"].per_request_tps < 0.8 * seed("mtp", 24).per_request_tps
    assert split["plain"].per_request_tps < 0.8 * seed("plain", 40).per_request_tps


def test_separate_devices_do_not_slow_each_other():
    split = run_seed_benchmark(PROFILES, {"mtp": 24, "plain": 40}, shared_device=False)
    assert split["mtp"].per_request_tps == pytest.approx(seed("mtp", 24).per_request_tps, rel=0.01)


# --- engine behaviour seen through the virtual clock --------------------------------------


class Recorder:
    """Collects what one request receives."""

    def __init__(self, sim: VirtualSim) -> None:
        self.sim = sim
        self.first_token_at: float | None = None
        self.chunks: list[tuple[float, int]] = []
        self.finish: tuple[float, str] | None = None

    def submit(self, backend: str, request: Request) -> "Recorder":
        self.sim.submit(
            backend,
            request,
            on_first_token=lambda t: setattr(self, "first_token_at", t),
            on_chunk=lambda t, n: self.chunks.append((t, n)),
            on_finish=lambda t, reason: setattr(self, "finish", (t, reason)),
        )
        return self


def text_prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    return tuple(range(salt * 1_000_000, salt * 1_000_000 + n))


def with_steps(num_steps: int):
    return {**PROFILES, "mtp": dataclasses.replace(PROFILES["mtp"], num_steps=num_steps)}


def test_mtp_chunks_carry_accepted_drafts_plus_one():
    sim = VirtualSim(with_steps(3), seed=1)
    rec = Recorder(sim).submit("mtp", Request("a", text_prompt(100), 2000))
    sim.run_until_idle()
    sizes = [n for _, n in rec.chunks[1:-1]]  # first token comes from prefill; last is capped
    assert set(sizes) == {1, 2, 3, 4}
    assert sum(n for _, n in rec.chunks) == 2000
    assert rec.finish[1] == "length"
    # p = 0.7 for ordinary text: expected length 1 + .7 + .49 + .343 = 2.53
    assert sim.engines["mtp"].stats.avg_spec_accept_length == pytest.approx(2.53, abs=0.1)


def test_same_seed_same_chunks_other_seed_other_chunks():
    def chunk_sizes(seed_value: int) -> list[int]:
        sim = VirtualSim(with_steps(3), seed=seed_value)
        rec = Recorder(sim).submit("mtp", Request("a", text_prompt(100), 300))
        sim.run_until_idle()
        return [n for _, n in rec.chunks]

    assert chunk_sizes(5) == chunk_sizes(5)
    assert chunk_sizes(5) != chunk_sizes(6)


def test_running_set_never_exceeds_the_effective_cap():
    sim = VirtualSim(PROFILES)
    for i in range(30):
        sim.submit("mtp", Request(f"r{i}", text_prompt(50, i), 100))
    sim.run(until=0.5)
    engine = sim.engines["mtp"]
    assert (engine.num_running, engine.num_waiting) == (24, 6)
    sim.run_until_idle()
    assert engine.stats.peak_running == 24


def test_prefix_cache_makes_a_repeat_cheap_only_where_it_ran():
    sim = VirtualSim(PROFILES, shared_device=False)
    prompt = text_prompt(20_000)
    first = Recorder(sim).submit("plain", Request("a", prompt, 5))
    sim.run_until_idle()
    start = sim.now
    repeat = Recorder(sim).submit("plain", Request("b", prompt + (7,), 5))
    elsewhere = Recorder(sim).submit("mtp", Request("c", prompt + (7,), 5))
    sim.run_until_idle()
    assert first.first_token_at > 1.0  # 20k uncached tokens
    assert repeat.first_token_at - start < 0.1
    assert elsewhere.first_token_at - start > 1.0


def test_a_long_prefill_delays_the_running_decode():
    sim = VirtualSim(PROFILES)
    runner = Recorder(sim).submit("plain", Request("run", text_prompt(10), 400))
    sim.run(until=1.0)
    Recorder(sim).submit("plain", Request("long", text_prompt(64_000, 1), 5))
    sim.run_until_idle()
    gaps = [b[0] - a[0] for a, b in zip(runner.chunks, runner.chunks[1:], strict=False)]
    assert max(gaps) > 0.4  # one 8192-token chunk at 60 ms/1k; plain's decode step is ~9 ms
    assert sorted(gaps)[len(gaps) // 2] < 0.02


def test_queue_limit_rejects_like_sglang():
    profiles = {"plain": dataclasses.replace(PROFILES["plain"], max_queued_requests=2)}
    sim = VirtualSim(profiles)
    for i in range(2):
        sim.submit("plain", Request(f"r{i}", text_prompt(10, i), 10))
    with pytest.raises(QueueFullError, match="The request queue is full."):
        sim.submit("plain", Request("r2", text_prompt(10, 2), 10))


def test_abort_frees_the_slot_at_once():
    sim = VirtualSim(PROFILES)
    rec = Recorder(sim).submit("mtp", Request("a", text_prompt(10), 10_000))
    sim.run(until=1.0)
    sim.abort("mtp", "a")
    assert sim.engines["mtp"].num_running == 0
    assert rec.finish == (1.0, "abort")


def test_a_disconnected_stream_frees_its_slot_one_step_later():
    # SGLang 0.5.23 aborts a stream when the disconnect cancels it (tokenizer_manager.py:958),
    # not after the 2 s fallback task.
    sim = VirtualSim(PROFILES)
    Recorder(sim).submit("plain", Request("a", text_prompt(10), 10_000))
    sim.run(until=1.0)
    sim.disconnect("plain", "a")
    sim.run(until=1.0 + 2 * PROFILES["plain"].decode_step_s(1))
    assert sim.engines["plain"].num_running == 0


def test_a_disconnected_non_streamed_request_is_noticed_within_four_seconds():
    sim = VirtualSim(PROFILES)
    Recorder(sim).submit("plain", Request("a", text_prompt(10), 10_000))
    sim.run(until=1.0)
    sim.disconnect("plain", "a", streaming=False)
    sim.run(until=4.9)
    assert sim.engines["plain"].num_running == 1
    sim.run(until=5.0 + 2 * PROFILES["plain"].decode_step_s(1))
    assert sim.engines["plain"].num_running == 0
