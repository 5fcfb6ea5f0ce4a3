"""The routing decision, table-driven: one row per reason and per boundary."""

from __future__ import annotations

import pytest

from gateway.config import Routing
from gateway.routing.policy import (
    BackendView,
    Decision,
    Moves,
    RequestFacts,
    Snapshot,
    decide,
    effective_crossover,
    plan_moves,
)

ROUTING = Routing(crossover=24, hysteresis=6, min_dwell_s=5.0, capacity_guard=True,
                  session_affinity=True)


def snap(mode: str = "mtp", since: float = 0.0, mtp: int = 0, plain: int = 0, *,
         mtp_up: bool = True, plain_up: bool = True, cap: int | None = 24,
         mtp_reported: int | None = None, plain_below: int = 0) -> Snapshot:
    return Snapshot(mode, since, {  # type: ignore[arg-type]
        "mtp": BackendView(healthy=mtp_up, inflight=mtp, effective_cap=cap,
                           reported_load=mtp_reported),
        "plain": BackendView(healthy=plain_up, inflight=plain),
    }, plain_below=plain_below)


CASES = [
    # (name, snapshot, facts, now, expected backend, reason, mode after)
    ("quiet goes to mtp", snap(mtp=0), RequestFacts(), 10, "mtp", "below_crossover", "mtp"),
    ("one below crossover stays mtp", snap(mtp=23), RequestFacts(), 10, "mtp", "below_crossover", "mtp"),
    ("reaching crossover flips to plain", snap(mtp=20, plain=4), RequestFacts(), 10,
     "plain", "above_crossover", "plain"),
    ("plain mode above crossover", snap("plain", 0, 10, 30), RequestFacts(), 10,
     "plain", "above_crossover", "plain"),
    ("inside the band plain holds", snap("plain", 0, 0, 20), RequestFacts(), 10,
     "plain", "hysteresis_hold", "plain"),
    ("at crossover - hysteresis returns to mtp", snap("plain", 0, 0, 18), RequestFacts(), 10,
     "mtp", "below_crossover", "mtp"),
    ("dwell not yet passed holds plain", snap("plain", 8, 0, 2), RequestFacts(), 10,
     "plain", "hysteresis_hold", "plain"),
    ("plain faster alone: a quiet pair's request goes to plain", snap(mtp=0, plain_below=1),
     RequestFacts(), 10, "plain", "plain_at_low_load", "mtp"),
    ("just above, plain keeps it while only plain is busy", snap(mtp=0, plain=1, plain_below=1),
     RequestFacts(), 10, "plain", "plain_at_low_load", "mtp"),
    ("just above with mtp busy: mtp", snap(mtp=1, plain=0, plain_below=1), RequestFacts(), 10,
     "mtp", "below_crossover", "mtp"),
    ("above the low-load band: mtp", snap(mtp=0, plain=2, plain_below=1), RequestFacts(), 10,
     "mtp", "below_crossover", "mtp"),
    ("session affinity decides inside the band", snap("plain", 0, 0, 20),
     RequestFacts(session_backend="mtp"), 10, "mtp", "session_affinity", "plain"),
    ("affinity does not apply below the band", snap("mtp", 0, 5, 0),
     RequestFacts(session_backend="plain"), 10, "mtp", "below_crossover", "mtp"),
    ("affinity does not apply above crossover", snap("plain", 0, 0, 30),
     RequestFacts(session_backend="mtp"), 10, "plain", "above_crossover", "plain"),
    ("capacity guard: mtp full goes to plain", snap(mtp=24, cap=24, plain=0),
     RequestFacts(), 10, "plain", "above_crossover", "plain"),
    ("capacity guard with a low cap", snap(mtp=8, cap=8), RequestFacts(), 10,
     "plain", "mtp_at_capacity", "mtp"),
    ("bypass traffic counts toward the cap", snap(mtp=2, cap=8, mtp_reported=8), RequestFacts(),
     10, "plain", "mtp_at_capacity", "mtp"),
    ("affinity to a full mtp is overruled", snap("plain", 0, 8, 12, cap=8),
     RequestFacts(session_backend="mtp"), 10, "plain", "mtp_at_capacity", "plain"),
    ("pin wins over the mode", snap("plain", 0, 0, 40), RequestFacts(pin="mtp"), 10,
     "mtp", "pinned", "plain"),
    ("pin is not capacity-guarded", snap(mtp=8, cap=8), RequestFacts(pin="mtp"), 10,
     "mtp", "pinned", "mtp"),
    ("mtp down fails over", snap(mtp_up=False), RequestFacts(), 10, "plain", "failover", "mtp"),
    ("plain down fails over", snap("plain", 0, 0, 30, plain_up=False), RequestFacts(), 10,
     "mtp", "failover", "plain"),
    ("pinned to a dead backend fails over", snap(mtp_up=False), RequestFacts(pin="mtp"), 10,
     "plain", "failover", "mtp"),
    ("both down: no backend", snap(mtp_up=False, plain_up=False), RequestFacts(), 10,
     None, "no_backend", "mtp"),
]


@pytest.mark.parametrize(("name", "snapshot", "facts", "now", "backend", "reason", "mode"), CASES,
                         ids=[c[0] for c in CASES])
def test_crossover_policy(name, snapshot, facts, now, backend, reason, mode) -> None:
    decision = decide(snapshot, facts, ROUTING, now)
    assert (decision.backend, decision.reason, decision.mode) == (backend, reason, mode)


def test_mode_change_records_when() -> None:
    decision = decide(snap(mtp=24, cap=None), RequestFacts(), ROUTING, now=42.0)
    assert (decision.mode, decision.mode_since) == ("plain", 42.0)
    held = decide(snap("plain", 42.0, 0, 30), RequestFacts(), ROUTING, now=50.0)
    assert held.mode_since == 42.0


@pytest.mark.parametrize(("policy", "expected"), [("mtp-only", "mtp"), ("plain-only", "plain")])
def test_static_policies_ignore_load(policy: str, expected: str) -> None:
    routing = Routing(policy=policy)  # type: ignore[arg-type]
    for load in (0, 100):
        decision = decide(snap("mtp", 0, load, load, cap=8), RequestFacts(), routing, 10)
        assert (decision.backend, decision.reason) == (expected, "static_policy")


def test_static_policy_still_fails_over() -> None:
    decision = decide(snap(mtp_up=False), RequestFacts(), Routing(policy="mtp-only"), 10)
    assert (decision.backend, decision.reason) == ("plain", "failover")


def test_capacity_guard_can_be_turned_off() -> None:
    routing = Routing(crossover=24, hysteresis=6, capacity_guard=False)
    assert decide(snap(mtp=8, cap=8), RequestFacts(), routing, 10).backend == "mtp"


@pytest.mark.parametrize(("accept_length", "adapt", "expected"), [
    (None, True, 31), (2.0, True, 31), (1.7, True, 26), (1.0, True, 16), (3.0, True, 46),
    (1.7, False, 31), (0.0, True, 31),
])
def test_crossover_follows_the_accept_length(accept_length, adapt, expected) -> None:
    routing = Routing(crossover=31, reference_accept_length=2.0, adapt_to_accept_length=adapt)
    assert effective_crossover(routing, accept_length) == expected


def test_lower_acceptance_flips_to_plain_sooner() -> None:
    routing = Routing(crossover=31, hysteresis=6, reference_accept_length=2.0)
    at_26 = snap(mtp=26, cap=24)
    assert decide(at_26, RequestFacts(), routing, 10).backend == "mtp"
    seen_text = Snapshot(at_26.mode, at_26.mode_since, at_26.backends, accept_length=1.7)
    assert decide(seen_text, RequestFacts(), routing, 10).reason == "above_crossover"


def test_every_reason_is_covered_by_the_table() -> None:
    from gateway.routing.policy import REASONS

    pool_reasons = {"memory_holder", "memory_turn", "holder_circuit"}  # a turns pair's, by the pool
    seen = {case[5] for case in CASES} | {"static_policy"} | pool_reasons
    assert seen == set(REASONS)


# --- moves at the flip to plain (a burst from idle) -----------------------------------------

def moving(mode: str, mtp: int, not_started: int, *, plain_up: bool = True) -> Snapshot:
    return Snapshot(mode, 0.0, {  # type: ignore[arg-type]
        "mtp": BackendView(inflight=mtp, effective_cap=24, not_started=not_started),
        "plain": BackendView(healthy=plain_up, inflight=1),
    })


@pytest.mark.parametrize(("name", "snapshot", "flipped", "routing", "expected"), [
    ("a burst's unstarted requests leave mtp at the flip", moving("plain", 31, 31), True,
     Routing(), Moves(not_started=31)),
    ("streams stay unless hand-off is on", moving("plain", 31, 7), True, Routing(),
     Moves(not_started=7)),
    ("hand-off moves the streams too", moving("plain", 31, 7), True,
     Routing(handoff_running=True), Moves(not_started=7, running=24)),
    ("nothing moves between flips", moving("plain", 31, 7), False,
     Routing(handoff_running=True), Moves()),
    ("nothing moves in mtp mode", moving("mtp", 20, 20), True, Routing(), Moves()),
    ("off switch", moving("plain", 31, 31), True, Routing(move_unstarted=False), Moves()),
    ("not onto a dead plain", moving("plain", 31, 31, plain_up=False), True, Routing(), Moves()),
    ("static policies never move", moving("plain", 31, 31), True, Routing(policy="mtp-only"),
     Moves()),
], ids=lambda v: v if isinstance(v, str) else "")
def test_plan_moves(name, snapshot, flipped, routing, expected) -> None:
    assert plan_moves(snapshot, routing, flipped=flipped) == expected


# --- edges the table above does not reach ---------------------------------------------------

def test_moves_are_true_when_anything_moves() -> None:
    assert not Moves()
    assert Moves(not_started=1) and Moves(running=1)


def test_a_decision_with_no_backend_keeps_the_mode_and_its_start() -> None:
    decision = decide(snap("plain", 3.0, 0, 30, mtp_up=False, plain_up=False), RequestFacts(),
                      ROUTING, 10)
    assert decision == Decision(None, "no_backend", "plain", 3.0)


def test_plain_returns_to_mtp_exactly_when_the_dwell_has_passed() -> None:
    assert decide(snap("plain", 5.0, 0, 2), RequestFacts(), ROUTING, 10.0).mode == "mtp"
    assert decide(snap("plain", 5.0, 0, 2), RequestFacts(), ROUTING, 9.99).mode == "plain"


@pytest.mark.parametrize(("name", "snapshot", "held", "backend", "reason"), [
    # The band is open at both ends: at crossover - hysteresis the session follows the mode
    # back to mtp, at the crossover it follows the mode to plain.
    ("at the band's low end", snap("plain", 0, 0, 18), "plain", "mtp", "below_crossover"),
    ("at the crossover", snap("mtp", 0, 24, 0, cap=None), "mtp", "plain", "above_crossover"),
    ("just inside the band", snap("plain", 0, 0, 19), "mtp", "mtp", "session_affinity"),
    ("just below the crossover", snap("mtp", 0, 0, 23), "plain", "plain", "session_affinity"),
], ids=lambda v: v if isinstance(v, str) and " " in v else "")
def test_session_affinity_holds_only_strictly_inside_the_band(name, snapshot, held, backend,
                                                               reason) -> None:
    decision = decide(snapshot, RequestFacts(session_backend=held), ROUTING, 10)
    assert (decision.backend, decision.reason) == (backend, reason)


def test_low_load_band_needs_plain_busy_and_mtp_idle() -> None:
    """Above `plain_below`, plain keeps one more request only while it is the only server
    busy: both busy, or neither (sessions idle between turns, nothing in flight), is mtp's."""
    both_busy = snap(mtp=1, plain=1, plain_below=2)
    assert decide(both_busy, RequestFacts(), ROUTING, 10).reason == "below_crossover"
    idle = Snapshot("mtp", 0.0, snap(mtp=0, plain=0).backends, plain_below=2, sessions_at_work=2)
    assert decide(idle, RequestFacts(), ROUTING, 10).reason == "below_crossover"


def test_static_policies_are_not_capacity_guarded() -> None:
    routing = Routing(policy="mtp-only", capacity_guard=True)
    decision = decide(snap(mtp=8, cap=8), RequestFacts(), routing, 10)
    assert (decision.backend, decision.reason) == ("mtp", "static_policy")


@pytest.mark.parametrize(("learned", "expected"), [(5, 16), (16, 16), (40, 40), (256, 256), (300, 256)])
def test_a_learned_crossover_is_held_inside_its_bounds(learned: int, expected: int) -> None:
    routing = Routing(crossover=31, crossover_bounds=(16, 256), hysteresis=6)
    assert effective_crossover(routing, 1.0, learned) == expected


def test_a_scaled_crossover_is_at_least_one() -> None:
    routing = Routing(crossover=1, hysteresis=0, reference_accept_length=2.0)
    assert effective_crossover(routing, 1.0) == 1


def test_decide_follows_the_learned_crossover() -> None:
    at_20 = snap(mtp=20, cap=None)
    assert decide(at_20, RequestFacts(), ROUTING, 10).backend == "mtp"
    learned = Snapshot("mtp", 0.0, at_20.backends, learned_crossover=18)
    assert decide(learned, RequestFacts(), ROUTING, 10).reason == "above_crossover"


SESSIONS = Routing(load_signal="sessions", session_crossover=22, crossover=31, hysteresis=6)


def sessions_snap(mtp: int, plain: int, at_work: int | None, with_session: int,
                  mtp_reported: int | None = None) -> Snapshot:
    backends = snap(mtp=mtp, plain=plain, mtp_reported=mtp_reported).backends
    return Snapshot("mtp", 0.0, backends, sessions_at_work=at_work, session_requests=with_session)


@pytest.mark.parametrize(("name", "snapshot", "routing", "load"), [
    ("sessions, plus each request without one", sessions_snap(10, 2, 3, 10), SESSIONS, (5, 22, 6)),
    ("more session requests than in flight count none extra", sessions_snap(1, 1, 3, 5), SESSIONS,
     (3, 22, 6)),
    ("no session at work: requests", sessions_snap(10, 2, 0, 0), SESSIONS, (12, 31, 6)),
    ("sessions unknown: requests", sessions_snap(10, 2, None, 0), SESSIONS, (12, 31, 6)),
    ("the requests signal", sessions_snap(10, 2, 3, 10),
     Routing(load_signal="requests", crossover=31, hysteresis=6), (12, 31, 6)),
    ("another replica's traffic: requests", sessions_snap(4, 2, 3, 6, mtp_reported=9), SESSIONS,
     (11, 31, 6)),
    ("a fresh reading equal to ours is no bypass", sessions_snap(4, 2, 3, 6, mtp_reported=4),
     SESSIONS, (3, 22, 6)),
], ids=lambda v: v if isinstance(v, str) and " " in v else "")
def test_the_load_against_the_crossover(name, snapshot, routing, load) -> None:
    assert snapshot.against_crossover(routing, routing.crossover) == load
