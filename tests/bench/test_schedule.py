"""A load that changes within one run (gateway.bench.schedule): a day of agent sessions ends
soon after its last phase, with the figures a run left to drain every session would report."""

import pytest

from gateway.bench import turns_virtual
from gateway.bench.schedule import run_schedule
from gateway.bench.targets import build_targets
from gateway.bench.turns_virtual import Phase, TurnModel, phase_windows, run_virtual
from gateway.bench.workloads import make_workload
from gateway.config import Routing

ROUTING = Routing()
PHASES = [Phase(2, 40.0), Phase(4, 40.0)]
END = phase_windows(PHASES)[-1][1]


def agent():
    return make_workload("agent", seed=3, max_tokens=48)


def targets():
    # a fixed crossover: no calibration; 3 sessions, so the pair turns within the day
    return build_targets(["single-plain", "pair-turns"], "rtx-pro-6000", turn=TurnModel(crossover=3))


@pytest.fixture
def drained(monkeypatch):
    """Runs left to drain until every session has ended, as schedules ran before."""
    def run(fn):
        with monkeypatch.context() as patch:
            patch.setattr(turns_virtual._UntilCounted, "stop_if_counted", lambda self: None)
            return fn()
    return run


def test_a_day_of_agent_sessions_stops_when_its_last_counted_request_ends(drained):
    (plain, _) = targets()

    def day():
        return run_virtual(agent(), ROUTING, plain.profiles, phases=PHASES)

    full, capped = drained(day), day()
    assert full.wall_s > END + 3600  # the sessions' human gaps: hours after the last phase
    counted = [r for r in capped.records if r.start < END]
    assert all(r.end is not None for r in counted)
    assert capped.wall_s == max(r.end for r in counted if r.end is not None) < END + 300
    # up to there it is the same run, request for request
    assert [(r.start, r.end, r.tokens, r.chunk_times) for r in capped.records if r.start < END] == \
        [(r.start, r.end, r.tokens, r.chunk_times) for r in full.records if r.start < END]


def test_a_day_of_agent_sessions_reports_the_figures_of_a_run_left_to_drain(drained):
    def day():
        return run_schedule(agent, PHASES, ROUTING, targets())

    full, capped = drained(day), day()
    assert [r.to_dict() for r in capped] == [r.to_dict() for r in full]
    pair = capped[1]
    assert pair.target == "pair-turns" and pair.turns  # the pair turned within the day
    assert all(turn.start < END for turn in pair.turns)
    assert all(phase.requests > 0 for r in capped for phase in r.phases)
