"""Runs in virtual time whose figures end at a time (a steady level, a schedule): on agent
sessions they stop soon after it, with the figures a run left to drain every session reports."""

import pytest

from gateway.bench import virtual
from gateway.bench.levels import LevelPlan
from gateway.bench.schedule import run_schedule
from gateway.bench.stats import summarise
from gateway.bench.targets import build_targets, run_target_sweep
from gateway.bench.turns_virtual import Phase, TurnModel, phase_windows, run_virtual
from gateway.bench.virtual import routing_for, run_virtual_level
from gateway.bench.workloads import make_workload
from gateway.config import Routing

ROUTING = Routing()
PHASES = [Phase(2, 40.0), Phase(4, 40.0)]
END = phase_windows(PHASES)[-1][1]


def agent():
    return make_workload("agent", seed=3, max_tokens=48)


def targets():
    # a fixed crossover: no calibration; 3 sessions and no payback, so the pair turns within the day
    return build_targets(["single-plain", "pair-turns"], "rtx-pro-6000",
                         turn=TurnModel(crossover=3, payback_turns=0))


@pytest.fixture
def drained(monkeypatch):
    """Runs left to drain until every session has ended, as they ran before."""
    def run(fn):
        with monkeypatch.context() as patch:
            patch.setattr(virtual.UntilCounted, "stop_if_counted", lambda self: None)
            return fn()
    return run


def _runs_alike(capped, full, end):
    """Up to the capped run's end the two are the same run, request for request."""
    def seen(run):
        return [(r.start, r.end, r.tokens, r.chunk_times) for r in run if r.start < end]
    assert seen(capped) == seen(full)


def test_a_day_of_agent_sessions_stops_when_its_last_counted_request_ends(drained):
    (plain, _) = targets()

    def day():
        return run_virtual(agent(), ROUTING, plain.profiles, phases=PHASES)

    full, capped = drained(day), day()
    assert full.wall_s > END + 3600  # the sessions' human gaps: hours after the last phase
    counted = [r for r in capped.records if r.start < END]
    assert all(r.end is not None for r in counted)
    assert capped.wall_s == max(r.end for r in counted if r.end is not None) < END + 300
    _runs_alike(capped.records, full.records, END)


def test_a_day_of_agent_sessions_reports_the_figures_of_a_run_left_to_drain(drained):
    def day():
        return run_schedule(agent, PHASES, ROUTING, targets())

    full, capped = drained(day), day()
    assert [r.to_dict() for r in capped] == [r.to_dict() for r in full]
    pair = capped[1]
    assert pair.target == "pair-turns" and pair.turns  # the pair turned within the day
    assert all(turn.start < END for turn in pair.turns)
    assert all(phase.requests > 0 for r in capped for phase in r.phases)


def test_a_steady_level_of_agent_sessions_stops_soon_after_its_duration_with_the_same_figures(drained):
    plan = LevelPlan(4, duration_s=60.0, warmup_s=15.0)

    def level():
        return run_virtual_level(agent(), plan, routing_for("plain-only", ROUTING), targets()[0].profiles)

    (full, full_wall), (capped, capped_wall) = drained(level), level()
    assert full_wall > 3600 and capped_wall < 60.0 + 300
    _runs_alike(capped, full, 60.0)
    assert summarise("plain", 4, capped, capped_wall, plan.window) == \
        summarise("plain", 4, full, full_wall, plan.window)


def test_a_sweep_on_agent_sessions_reports_the_figures_of_levels_left_to_drain(drained):
    plans = [LevelPlan(2, duration_s=40.0, warmup_s=10.0), LevelPlan(4, duration_s=40.0, warmup_s=10.0)]

    def sweep():
        turn_log: dict[str, list[list[object]]] = {}
        results = run_target_sweep(agent, plans, ROUTING, targets(), turn_log=turn_log)
        return results, {name: [len(level) for level in levels] for name, levels in turn_log.items()}

    assert drained(sweep) == sweep()
