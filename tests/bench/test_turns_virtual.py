"""The pair taking turns owning the GPUs' memory, in virtual time (gateway.bench.turns_virtual):
what a user relies on when choosing `memory: turns`."""

import json

import pytest

from gateway.bench.levels import LevelPlan
from gateway.bench.stats import summarise
from gateway.bench.targets import build_targets, run_target_sweep, tuned_profile, turns_profiles
from gateway.bench.turns_virtual import (
    Phase,
    TurnModel,
    parse_schedule,
    run_virtual,
    turns_routing,
)
from gateway.bench.workloads import Job, Send, Think, Workload, make_workload
from gateway.cli import main
from gateway.config import Routing
from gateway.sim.profile import packaged_timings, single_profile

ROUTING = Routing()
CROSSOVER = 40  # between MTP's cap (48) and the low levels below; fixed, no calibration


def seed(max_tokens=200):
    return lambda: make_workload("seed", max_tokens=max_tokens)


def targets(*names, cost=1.5, running="continue", payback=0.0):
    """payback=0: the turn's mechanics, at the moment the load crosses (the payback rule has
    its own tests below)."""
    return build_targets(list(names), "rtx-pro-6000",
                         turn=TurnModel(cost_s=cost, crossover=CROSSOVER, running=running,
                                        payback_turns=payback))


def run_pair(plan=None, phases=None, cost=1.5, running="continue", max_tokens=200, payback=0.0):
    (target,) = targets("pair-turns", cost=cost, running=running, payback=payback)
    return run_virtual(seed(max_tokens)(), ROUTING, target.profiles, plan=plan, phases=phases,
                       turns=target.turns, turns_routing=turns_routing(ROUTING, CROSSOVER),
                       log_steps=True)


def holder_at(turns, t, first="mtp"):
    holder = first
    for turn in turns:
        if turn.released_at <= t:
            holder = None if t < turn.settled_at else turn.to
    return holder


def assert_never_both_holding(run):
    assert run.step_log, "nothing ran"
    for start, _, backend in run.step_log:
        assert holder_at(run.turns, start) == backend, (start, backend)


def test_at_low_load_the_pair_is_its_adaptive_mtp_server_owning_the_gpus():
    plan = LevelPlan(2, duration_s=60.0, warmup_s=10.0)
    results = run_target_sweep(seed(), [plan], ROUTING, targets("pair-turns", "single-adaptive"))
    pair, single = results["pair-turns"][0], results["single-adaptive"][0]
    assert pair.share == {"mtp": 1.0}
    assert pair.aggregate_tps == pytest.approx(single.aggregate_tps, rel=0.005)
    assert pair.per_request_tps == pytest.approx(single.per_request_tps, rel=0.005)
    assert run_pair(plan=plan).turns == []


def test_at_high_load_the_pair_hands_over_once_and_is_one_plain_server_owning_the_gpus():
    plan = LevelPlan(96, duration_s=90.0, warmup_s=30.0)
    run = run_pair(plan=plan)
    during = [t for t in run.turns if t.start < plan.duration_s]
    assert [t.to for t in during] == ["plain"]
    single = run_target_sweep(seed(), [plan], ROUTING, targets("single-plain"))["single-plain"][0]
    pair = summarise("pair-turns", 96, run.records, run.wall_s, plan.window)
    assert pair.share == {"plain": 1.0}
    assert pair.aggregate_tps >= 0.98 * single.aggregate_tps
    assert_never_both_holding(run)


def test_a_turn_costs_its_cost_and_nothing_steps_meanwhile():
    for cost in (0.5, 5.0):
        run = run_pair(phases=[Phase(2, 30.0), Phase(64, 40.0)], cost=cost)
        turn = run.turns[0]
        assert turn.to == "plain" and turn.start == pytest.approx(30.0, abs=1.0)
        assert turn.settled_at - turn.released_at == pytest.approx(cost)
        assert not [s for s in run.step_log if turn.released_at < s[0] < turn.settled_at]
        assert_never_both_holding(run)


def test_running_streams_continue_on_the_incoming_server_with_what_they_generated():
    run = run_pair(phases=[Phase(8, 20.0), Phase(96, 30.0)], max_tokens=None)  # 1000 each
    turn = run.turns[0]
    assert turn.continued > 0 and turn.waited > 0
    # each continued stream re-prefills at least its 1000-token prompt and what it generated
    assert turn.continued_tokens > 1000 * turn.continued
    assert all(r.ok for r in run.records)
    assert {r.tokens for r in run.records} == {1000}  # every stream ends whole, none longer


def test_finishing_first_keeps_running_streams_where_they_are_and_the_arrivals_waiting():
    go_on = run_pair(phases=[Phase(8, 20.0), Phase(96, 30.0)], max_tokens=300)
    finish = run_pair(phases=[Phase(8, 20.0), Phase(96, 30.0)], max_tokens=300, running="finish")
    turn = finish.turns[0]
    assert turn.continued == 0 and turn.finished_first > 0
    assert turn.released_at > turn.start  # MTP drained its streams before releasing
    assert go_on.turns[0].released_at == go_on.turns[0].start
    assert all(r.ok and r.tokens == 300 for r in finish.records)
    assert_never_both_holding(finish)


def test_dearer_turns_serve_fewer_tokens_over_a_changing_load():
    phases = [Phase(2, 60.0), Phase(96, 60.0), Phase(2, 60.0)]
    tokens, turns = {}, {}
    for cost in (0.5, 15.0):
        run = run_pair(phases=phases, cost=cost)
        turns[cost] = [t.to for t in run.turns if t.start < 180]
        tokens[cost] = sum(r.tokens for r in run.records if r.ok)
    assert turns[0.5] == ["plain", "mtp"]
    # a 15 s turn holds plain for its dwell (10 turns), through the quiet phase
    assert turns[15.0] == ["plain"]
    assert tokens[0.5] > tokens[15.0]


def test_a_flapping_load_turns_at_most_once_per_dwell():
    phases = [Phase(64 if i % 2 else 2, 4.0) for i in range(30)]  # 120 s, the load jumps every 4 s
    run = run_pair(phases=phases)
    dwell = TurnModel(payback_turns=0).rules(ROUTING).dwell()
    assert 1 <= len(run.turns) <= 120 / dwell + 1
    for a, b in zip(run.turns, run.turns[1:], strict=False):
        assert b.start - a.settled_at >= dwell - 1e-9
    assert_never_both_holding(run)


def test_each_turns_server_owns_the_gpu_less_the_parked_ones_leftovers():
    timings = packaged_timings()
    turns = turns_profiles("rtx-pro-6000", "adaptive", timings)
    alone = {"plain": single_profile("plain", "rtx-pro-6000", timings=timings),
             "mtp": single_profile("adaptive", "rtx-pro-6000", timings=timings)}
    assert turns["plain"].effective_max_running == alone["plain"].effective_max_running
    assert turns["mtp"].effective_max_running == alone["mtp"].effective_max_running
    assert turns["mtp"].prefix_cache_tokens < alone["mtp"].prefix_cache_tokens


def test_the_tuned_single_mtp_server_runs_more_than_speculations_default_cap():
    timings = packaged_timings()
    for role in ("mtp", "adaptive"):
        default = single_profile(role, "rtx-pro-6000", timings=timings).effective_max_running
        tuned = tuned_profile(role, "rtx-pro-6000", timings).effective_max_running
        assert default <= 48 < tuned <= 128


def test_schedule_parsing():
    assert parse_schedule("4:600, 64:30.5") == [Phase(4, 600.0), Phase(64, 30.5)]
    for bad in ("", "4", "0:10", "4:0", "x:1", "4:-1"):
        with pytest.raises(ValueError, match="schedule"):
            parse_schedule(bad)


def test_bench_sim_schedule_reports_the_whole_run_and_each_phase(tmp_path, capsys):
    out_json = tmp_path / "schedule.json"
    code = main(["bench", "--sim", "--no-progress", "--schedule", "2:30,64:30", "--max-tokens", "150",
                 "--target", "pair-turns", "--target", "single-plain", "--turns-crossover", "40",
                 "--turn-cost", "0.5,5", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out_json.read_text())
    names = [r["target"] for r in data["results"]]
    assert names == ["pair-turns@0.5s", "pair-turns@5s", "single-plain"]
    by = {r["target"]: r for r in data["results"]}
    assert by["pair-turns@0.5s"]["tokens"] > by["pair-turns@5s"]["tokens"]
    assert all(len(r["phases"]) == 2 for r in data["results"])
    assert by["pair-turns@5s"]["turns"][0]["to"] == "plain"
    assert "C=64 (30 s)" in out and "tokens over the run" in out


def test_bench_sim_schedule_rejects_a_bad_schedule(capsys):
    assert main(["bench", "--sim", "--no-progress", "--schedule", "4:abc"]) == 2
    assert "--schedule takes C:SECONDS" in capsys.readouterr().err


def test_finish_back_continues_on_the_way_to_plain_and_finishes_on_the_way_back():
    run = run_pair(phases=[Phase(8, 20.0), Phase(96, 40.0), Phase(2, 60.0)], max_tokens=None,
                   running="finish-back")
    up, back = run.turns[0], run.turns[1]
    assert (up.to, back.to) == ("plain", "mtp")
    assert up.continued > 0 and up.released_at == up.start
    assert back.continued == 0 and back.finished_first > 0 and back.released_at > back.start
    assert all(r.ok for r in run.records) and {r.tokens for r in run.records} == {1000}
    assert_never_both_holding(run)


class LongSessions(Workload):
    """Sessions with a 1,024-token context of their own that grows by 256 tokens a call, a call
    every 2 s: the first two outlive every phase (60 calls), the others make 10."""

    name = "long-sessions"

    def script(self, index: int):
        base = 100_000 * (index + 1)
        ids = tuple(range(base, base + 1_024))
        for _ in range(60 if index < 2 else 10):
            yield Send([Job("/v1/chat/completions", {}, prompt_ids=ids, max_tokens=8, session=f"s{index}")])
            yield Think(2.0)
            ids += tuple(range(base + len(ids), base + len(ids) + 256))


def run_long_sessions(store, drain_bound_s=5.0, l3_write_bytes_per_s=1e9, l3_capacity_bytes=None):
    (target,) = build_targets(["pair-turns"], "h200",
                              turn=TurnModel(crossover=8, store=store, drain_bound_s=drain_bound_s,
                                             payback_turns=0,
                                             l3_write_bytes_per_s=l3_write_bytes_per_s,
                                             l3_capacity_bytes=l3_capacity_bytes))
    phases = [Phase(2, 30.0), Phase(16, 20.0), Phase(2, 60.0)]
    return run_virtual(LongSessions(), ROUTING, target.profiles, phases=phases, turns=target.turns,
                       turns_routing=turns_routing(ROUTING, 8), log_requests=True)


def test_with_its_own_store_mtp_finds_on_its_next_turn_the_contexts_it_served_before():
    carried = run_long_sessions("own")
    cold = run_long_sessions("none")
    assert [t.to for t in carried.turns] == [t.to for t in cold.turns] == ["plain", "mtp"]
    back, back_cold = carried.turns[1], cold.turns[1]
    # both sessions at work were MTP's before: only what they gained since is prefilled
    assert back.sessions == 2 and back.context_tokens > 2 * 1_024 + 2 * 256 * 20
    assert back.prefill_tokens < back.context_tokens / 2 and back.load_s > 0
    assert back_cold.prefill_tokens == back_cold.context_tokens
    # and the requests after the turn really loaded their prefixes
    after = [r for r in carried.request_log if r.backend == "mtp" and r.at >= back.settled_at]
    after_cold = [r for r in cold.request_log if r.backend == "mtp" and r.at >= back_cold.settled_at]
    assert sum(r.cached_tokens or 0 for r in after[:2]) > sum(r.cached_tokens or 0 for r in after_cold[:2])
    # the first turn, into plain, finds nothing: plain has never held the memory
    assert carried.turns[0].prefill_tokens == carried.turns[0].context_tokens


def test_the_outgoing_server_drains_its_writes_before_its_pause_within_the_bound():
    # a store that takes 100 MB/s a rank: MTP's last writes are still queued at the turn to plain
    drained = run_long_sessions("own", l3_write_bytes_per_s=1e8).turns[0]
    assert drained.to == "plain" and 0 < drained.drain_s <= 5.0 and drained.dropped_tokens == 0
    assert drained.released_at == pytest.approx(drained.start + drained.drain_s)
    # not waiting, the release drops them (lost for MTP's next turn)
    hurried = run_long_sessions("own", drain_bound_s=0.0, l3_write_bytes_per_s=1e8).turns[0]
    assert hurried.drain_s == 0 and hurried.dropped_tokens > 0 and hurried.released_at == hurried.start
    # and the bound holds however slow the store
    slow = run_long_sessions("own", drain_bound_s=1.0, l3_write_bytes_per_s=1e7).turns
    assert all(t.drain_s <= 1.0 for t in slow) and any(t.dropped_tokens for t in slow)


def test_one_store_for_both_servers_is_refused_before_anything_runs(capsys):
    code = main(["bench", "--sim", "--workload", "seed", "--max-tokens", "16", "--schedule", "2:5",
                 "--target", "pair-turns", "--turns-store", "shared", "--turns-crossover", "8",
                 "--no-progress"])
    assert code == 2
    assert "13 layers against 12" in capsys.readouterr().err


def test_a_store_too_small_for_a_turns_writes_finds_nothing_on_the_turn_back():
    # 1 GB: less than one Mamba state per session written meanwhile (154 MB each, a call every 2 s)
    back = run_long_sessions("own", l3_capacity_bytes=1e9).turns[1]
    assert back.to == "mtp" and back.prefill_tokens == back.context_tokens and back.load_s == 0


class WarmThenBurst(Workload):
    """Scripts 0-3: sessions with 150k-token contexts of their own, a call every 2 s for the whole
    run (their contexts warm on the holder); every later script: one short one-off prompt."""

    name = "warm-then-burst"

    def script(self, index: int):
        if index >= 4:
            yield Send([Job("/v1/chat/completions", {}, prompt_ids=tuple(range(10 * index, 10 * index + 64)),
                            max_tokens=64)])
            return
        base = 1_000_000 * (index + 1)
        ids = tuple(range(base, base + 150_000))
        for _ in range(40):
            yield Send([Job("/v1/chat/completions", {}, prompt_ids=ids, max_tokens=8, session=f"w{index}")])
            yield Think(2.0)
            ids += tuple(range(base + len(ids), base + len(ids) + 64))


def run_burst(payback, phases):
    (target,) = build_targets(["pair-turns"], "h200", turn=TurnModel(crossover=8, payback_turns=payback))
    return run_virtual(WarmThenBurst(), ROUTING, target.profiles, phases=phases, turns=target.turns,
                       turns_routing=turns_routing(ROUTING, 8), log_requests=True)


def test_a_short_burst_does_not_throw_away_the_warm_sessions_contexts_to_turn():
    """Four sessions of 150k tokens at work on MTP (600k tokens, ~37 s to prefill again), then
    20 s of a burst past the crossover: the burst cannot repay them, so the pair stays on MTP
    and the sessions keep hitting their cache; without the payback it turns to plain (and holds
    it for its dwell, 10 turns' cost), where each session prefills its whole context again."""
    phases = [Phase(4, 100.0), Phase(24, 20.0), Phase(4, 40.0)]  # their first calls end by ~50 s
    kept, turned = run_burst(1.0, phases), run_burst(0.0, phases)
    assert kept.turns == [] and [t.to for t in turned.turns] == ["plain"]
    assert turned.turns[0].prefill_tokens >= 4 * 150_000  # the warm contexts, all thrown away

    def prefilled(run):
        return sum(r.prompt_tokens - (r.cached_tokens or 0) for r in run.request_log
                   if r.cached_tokens is not None and r.at >= 100.0)

    assert prefilled(turned) - prefilled(kept) > 3.5 * 150_000  # the four contexts, prefilled again


def test_a_burst_that_stays_repays_the_contexts_and_turns():
    """The same warm sessions, but the burst stays: once MTP has forgone the contexts' prefill
    at plain's gain, the pair turns (gain 0.5 x 17/8 at 24 clients, capped at 1: ~37 s)."""
    run = run_burst(1.0, [Phase(4, 100.0), Phase(24, 120.0)])
    (turn,) = [t for t in run.turns if t.start < 220.0]
    assert turn.to == "plain" and turn.reason == "load_above_crossover"
    assert 100.0 + 0.9 * turn.prefill_tokens / ROUTING.prefill_tokens_per_s <= turn.start < 220.0
