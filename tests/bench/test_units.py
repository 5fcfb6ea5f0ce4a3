"""Pure parts of the bench: SSE parsing, percentiles, the crossover rule, the config writer."""

import math
import random

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gateway.bench.calibrate import (
    accept_prob_for,
    crossing,
    find_crossover,
    fit_profile,
    gain_past_crossover,
    set_routing_values,
    suggested_hysteresis,
)
from gateway.bench.levels import LevelPlan, parse_levels, plan_levels
from gateway.bench.sse import SSEEvent, SSEParser
from gateway.bench.stats import LevelResult, RequestRecord, percentile, summarise
from gateway.bench.workloads import Agentic, Outcome, Send, Think, make_workload
from gateway.config import load_settings
from gateway.sim.profile import load_profiles

STREAM = (
    b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\r\n\r\n'
    b": keep-alive\n\n"
    b'data: {"choices":[{"delta":{"content":"h\xc3\xa9llo"}}]}\n\n'
    b"event: note\rdata: line one\rdata: line two\r\r"
    b'data: {"choices":[],"usage":{"completion_tokens":7}}\r\n\r\n'
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent('{"choices":[{"delta":{"role":"assistant","content":""}}]}'),
    SSEEvent('{"choices":[{"delta":{"content":"héllo"}}]}'),
    SSEEvent("line one\nline two", "note"),
    SSEEvent('{"choices":[],"usage":{"completion_tokens":7}}'),
    SSEEvent("[DONE]"),
]


def parse_in_pieces(data: bytes, cuts: list[int]) -> list[SSEEvent]:
    parser, events, last = SSEParser(), [], 0
    for cut in sorted(set(cuts)) + [len(data)]:
        events += parser.feed(data[last:cut])
        last = cut
    return events + parser.close()


def test_sse_whole_stream():
    assert parse_in_pieces(STREAM, []) == EXPECTED


def test_sse_every_single_byte_boundary():
    assert parse_in_pieces(STREAM, list(range(len(STREAM)))) == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_sse_any_one_cut(cut):
    assert parse_in_pieces(STREAM, [cut]) == EXPECTED


@given(st.lists(st.integers(0, len(STREAM)), max_size=30))
def test_sse_random_cuts(cuts):
    assert parse_in_pieces(STREAM, cuts) == EXPECTED


def test_sse_crlf_split_between_chunks_is_one_line_end():
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\r") == []
    assert parser.feed(b"\n") == [SSEEvent("a")]


def test_sse_last_event_without_blank_line_is_flushed_on_close():
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == [SSEEvent("[DONE]")]


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_summarise_both_methods():
    records = [RequestRecord(start=0.0, first=1.0, end=3.0, tokens=10, chunk_times=[1.0, 2.0, 3.0],
                             chunk_tokens=[2, 4, 4], backend="mtp"),
               RequestRecord(start=0.5, error="HTTP 503")]
    level = summarise("t", 2, records, wall_s=4.0)
    assert (level.requests, level.errors, level.output_tokens) == (2, 1, 10)
    assert level.per_request_tps == 5.0 and level.aggregate_tps == 2.5
    assert level.itl_p50_s == 1.0 and level.share == {"mtp": 1.0}
    steady = summarise("t", 2, records, wall_s=4.0, window=(0.0, 2.0))
    assert steady.aggregate_tps == 3.0  # 6 tokens emitted in [0, 2]


def test_levels():
    assert parse_levels("1, 2,4") == [1, 2, 4]
    with pytest.raises(ValueError):
        parse_levels("1,x")
    assert plan_levels([2]) == [LevelPlan(2, requests=6)]
    assert plan_levels([2], duration_s=10, warmup_s=2)[0].window == (2, 10)
    with pytest.raises(ValueError):
        plan_levels([2], requests_per_level=5, duration_s=3)


# --- the crossover rule -------------------------------------------------------------------

def level(c, aggregate, user):
    nan = math.nan
    return LevelResult("x", c, 1, 0, nan, aggregate, user, 0, 1, nan, nan, nan, nan, nan, nan, {})


LEVELS = [1, 8, 16, 24, 32, 64, 128]


def curves(mtp_agg, plain_agg, mtp_user=None, plain_user=None):
    mtp_user = mtp_user or mtp_agg
    plain_user = plain_user or plain_agg
    return ([level(c, a, u) for c, a, u in zip(LEVELS, mtp_agg, mtp_user, strict=True)],
            [level(c, a, u) for c, a, u in zip(LEVELS, plain_agg, plain_user, strict=True)])


def test_crossing_interpolates_between_the_last_mtp_win_and_the_first_plain_win():
    c = crossing([24, 32], [1600, 1600], [1300, 1700])
    assert c.first_plain_level == 32 and c.level == pytest.approx(24 + 8 * 300 / 400)


def test_crossing_ignores_a_noisy_plain_win_below_the_real_one():
    c = crossing(LEVELS, [1, 9, 10, 10, 10, 10, 10], [1, 10, 9, 9, 11, 12, 13])
    assert c.first_plain_level == 32  # plain also "won" at 8, but lost again at 16


def test_crossing_none_and_from_the_start():
    assert crossing([1, 2], [2, 2], [1, 1]).level is None
    assert crossing([4, 8], [1, 1], [2, 2]).level == 3


# Aggregate tok/s cross at 30.0, per-request tok/s at 32 + 32 * 4 / 21 = 38.1.
SPLIT = curves([100, 800, 1300, 1600, 1600, 1600, 1600], [90, 600, 900, 1300, 1700, 2700, 2800],
               mtp_user=[100, 90, 80, 66, 56, 25, 12], plain_user=[90, 75, 60, 54, 52, 42, 22])


def test_find_crossover_takes_the_aggregate_crossing_by_default_and_floors():
    result = find_crossover(*SPLIT)
    assert result.aggregate.level == pytest.approx(30.0)
    assert result.per_request.level == pytest.approx(32 + 32 * 4 / 21)
    assert (result.objective, result.crossover) == ("aggregate", 30)


def test_find_crossover_per_request_objective_takes_the_other_crossing():
    result = find_crossover(*SPLIT, objective="per-request")
    assert result.crossover == 38
    with pytest.raises(ValueError, match="objective"):
        find_crossover(*SPLIT, objective="both")


def test_explain_names_both_crossings_and_the_chosen_one():
    text = find_crossover(*SPLIT, objective="per-request").explain()
    assert "aggregate tok/s crossing: equal at C = 30.0 (plain ahead from the measured level 32 on) " \
           "-> crossover 30" in text
    assert "per-request tok/s crossing: equal at C = 38.1 (plain ahead from the measured level 64 on) " \
           "-> crossover 38" in text
    assert "objective: per-request: MTP's requests are no longer faster for their users" in text
    assert "chosen: the per-request crossing, crossover = 38" in text
    assert "objective: aggregate (the default)" in find_crossover(*SPLIT).explain()


def test_find_crossover_is_capped_at_mtps_running_cap():
    mtp, plain = curves([100, 800, 1300, 1600, 1600, 1600, 1600], [90, 600, 900, 1300, 1700, 2700, 2800])
    result = find_crossover(mtp, plain, mtp_cap=24)
    assert (result.crossover, result.uncapped) == (24, 30)
    assert "capped" in result.explain()


def test_find_crossover_none_when_mtp_always_wins():
    mtp, plain = curves([2] * 7, [1] * 7)
    assert find_crossover(mtp, plain).crossover is None


def test_hysteresis_kept_when_it_fits():
    assert suggested_hysteresis(24, 6) == 6
    assert suggested_hysteresis(8, 6) == 2
    assert suggested_hysteresis(1, 0) == 0


# --- the in-place config writer ---------------------------------------------------------------

CONFIG = """# top comment
listen:
  port: 8000   # keep me

routing:
  # crossover: comment that mentions the key
  policy: crossover
  crossover: 24          # Live concurrency ...
  hysteresis: 6
  nested:
    crossover: 3
timeouts:
  crossover: 99
"""


def test_writer_changes_only_the_value():
    out = set_routing_values(CONFIG, {"crossover": 31})
    before, after = CONFIG.splitlines(), out.splitlines()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert changed == [("  crossover: 24          # Live concurrency ...",
                        "  crossover: 31          # Live concurrency ...")]
    data = yaml.safe_load(out)
    assert data["routing"]["crossover"] == 31 and data["timeouts"]["crossover"] == 99
    assert data["routing"]["nested"]["crossover"] == 3


def test_writer_adds_missing_keys_and_sections():
    out = set_routing_values(CONFIG, {"min_dwell_s": 2.5})
    assert yaml.safe_load(out)["routing"]["min_dwell_s"] == 2.5
    assert yaml.safe_load(set_routing_values("listen:\n  port: 1\n", {"crossover": 9})) == {
        "listen": {"port": 1}, "routing": {"crossover": 9}}
    with pytest.raises(ValueError):
        set_routing_values("routing: {crossover: 3}\n", {"crossover": 4})


def test_writer_sets_another_sections_key_and_leaves_routings_alone():
    out = set_routing_values(CONFIG, {"crossover": 7}, "timeouts")
    data = yaml.safe_load(out)
    assert data["timeouts"]["crossover"] == 7 and data["routing"]["crossover"] == 24
    added = yaml.safe_load(set_routing_values(CONFIG, {"gain_per_crossover": 0.27}, "turns"))
    assert added["turns"] == {"gain_per_crossover": 0.27}


def test_the_gain_past_the_crossover_is_measured_at_the_level_nearest_twice_it():
    def rows(name, by_level):
        return [LevelResult(name, c, 10, 0, 1.0, tps, 1.0, 0.0, 1.0, 0.1, 0.1, 0.01, 0.01, 1.0, 1.0, {})
                for c, tps in by_level.items()]

    mtp = rows("mtp", {16: 1000.0, 32: 1100.0, 64: 1150.0, 128: 1200.0})
    plain = rows("plain", {16: 900.0, 32: 1100.0, 64: 1500.0, 128: 2400.0})
    # crossover 32: the level nearest 64 is 64, where plain makes 1500 / 1150 - 1 = 0.304 more,
    # 33 levels past the crossover: 33/32 of a crossover
    assert gain_past_crossover(mtp, plain, 32) == pytest.approx((1500 / 1150 - 1) * 32 / 33)
    assert gain_past_crossover(mtp, plain, 128) is None  # nothing measured past it


def test_writer_on_the_shipped_config_keeps_every_comment(tmp_path):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "config.yaml").read_text()
    out = set_routing_values(text, {"crossover": 40, "hysteresis": 10})
    assert [ln for ln in out.splitlines() if ln.lstrip().startswith("#")] == \
        [ln for ln in text.splitlines() if ln.lstrip().startswith("#")]
    path = tmp_path / "c.yaml"
    path.write_text(out)
    routing = load_settings(path).routing
    assert (routing.crossover, routing.hysteresis) == (40, 10)
    assert len(out.splitlines()) == len(text.splitlines())


# --- profiles from measured curves --------------------------------------------------------

def test_accept_prob_inverts_the_accept_length():
    assert accept_prob_for(2.0, 1) == pytest.approx(1.0, abs=1e-3)
    assert accept_prob_for(1.7, 1) == pytest.approx(0.7, abs=1e-3)
    p = accept_prob_for(2.5, 3)
    assert 1 + p + p * p + p**3 == pytest.approx(2.5, abs=1e-3)


def test_fit_profile_replays_the_measured_speeds():
    base = load_profiles()["mtp"]
    measured = [level(c, math.nan, math.nan) for c in (1, 16, 24, 64)]
    for r, speed in zip(measured, (120.0, 80.0, 66.0, 66.0), strict=True):
        r.per_request_tps = speed
    profile = fit_profile(base, measured, cap=24, accept_length=2.0, num_steps=1)
    assert profile.step_ms == ((1, pytest.approx(16.667, abs=1e-3)), (16, 25.0),
                               (24, pytest.approx(30.303, abs=1e-3)))
    assert profile.effective_max_running == 24
    assert 2 * 1000 / (profile.decode_step_s(16) * 1000) == pytest.approx(80.0)


# --- workloads ------------------------------------------------------------------------------

def test_seed_job_is_the_seeds_method():
    job = next(make_workload("seed").script(0)).jobs[0]
    assert job.path == "/v1/completions" and job.body["prompt"] == [23066] * 1000
    assert job.body["max_tokens"] == 1000 and job.body["ignore_eos"] and job.body["temperature"] == 0
    assert job.body["stream_options"] == {"include_usage": True} and job.greedy


def test_chat_is_varied_and_reproducible():
    jobs = [next(make_workload("chat", seed=1).script(i)).jobs[0] for i in range(50)]
    again = [next(make_workload("chat", seed=1).script(i)).jobs[0] for i in range(50)]
    assert jobs == again
    assert len({j.max_tokens for j in jobs}) > 20 and len({len(j.prompt_ids) for j in jobs}) > 20
    assert all(j.body["temperature"] == 0.7 and not j.greedy for j in jobs)


def test_agentic_sessions_grow_think_and_burst():
    saw_burst = False
    for index in range(20):
        script = Agentic(seed=3).script(index)
        action, sizes, value = script.send(None), [], None
        while True:
            if isinstance(action, Send):
                assert {j.headers["x-session-id"] for j in action.jobs} == {f"bench-3-{index}"}
                saw_burst |= len(action.jobs) > 1
                if len(action.jobs) == 1:  # the main turn (a burst's tasks differ)
                    sizes.append(len(action.jobs[0].prompt_ids))
                value = [Outcome(50, "answer " * 50)] * len(action.jobs)
            else:
                assert isinstance(action, Think) and 0.2 <= action.seconds <= 10
                value = None
            try:
                action = script.send(value)
            except StopIteration:
                break
        assert sizes == sorted(sizes) and sizes[0] >= 4000
    assert saw_burst


def test_file_workload(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"path": "/v1/chat/completions", "body": {"messages": [{"role": "user", '
                    '"content": "hi there"}], "max_tokens": 900}, "headers": {"x-session-id": "s"}}\n\n')
    job = next(make_workload(f"file:{path}", max_tokens=64).script(random.randrange(5))).jobs[0]
    assert job.max_tokens == 64 and job.body["stream"] and job.session == "s"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        make_workload(f"file:{bad}")


def test_a_level_without_any_successful_request_is_left_out_of_the_crossing():
    nan = math.nan
    # MTP failed every request at the top level: that is no evidence that MTP wins there.
    top = crossing([24, 32, 64], [1600, 1600, nan], [1300, 1700, 2700])
    assert top.first_plain_level == 32 and top.level == pytest.approx(24 + 8 * 300 / 400)
    # ... nor in the middle, where interpolating through it gave NaN (and floor() raised).
    middle = crossing([16, 24, 32], [1300, nan, 1600], [900, 1300, 1700])
    assert middle.first_plain_level == 32 and middle.level == pytest.approx(16 + 16 * 400 / 500)
