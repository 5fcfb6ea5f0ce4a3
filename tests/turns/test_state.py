"""The turns pair's memory state machine (gateway/turns/state.py): every transition and
every failure, and the one invariant: never both servers hold the memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.turns.discovery import SETTLE_ATTEMPTS, discovered
from gateway.turns.journal import from_journal, journal
from gateway.turns.state import (
    ACTIONS,
    Failure,
    PairMemory,
    Step,
    begin_turn,
    can_turn_to,
    holder_lost,
    initial,
    reprobed,
    sending,
    step_done,
    step_failed,
    turn_plan,
)
from gateway.upstream.engine.probe import Probe

PAUSED = Probe(alive=True, ready=False, scheduler_answers=True)
READY = Probe(alive=True, ready=True, scheduler_answers=True)
STUCK_IN_CALL = Probe(alive=True, ready=False, scheduler_answers=False)
DEAD = Probe(alive=False)


def holding(role: str = "mtp") -> PairMemory:
    other = "plain" if role == "mtp" else "mtp"
    state = initial(0.0, {role: "held", other: "released"})
    state = discovered(state, {role: READY, other: PAUSED}, "mtp", 0.0)
    while state.phase == "settling":
        state = step_done(state, 0.0)
    assert state.phase == "holding" and state.holder == role
    return state


def run_until(state: PairMemory, action: str, now: float = 1.0) -> PairMemory:
    """Steps done up to (not including) the first `action`; the invariant checked at each."""
    while state.step is not None and state.step.action != action:
        state = step_done(sending(state), now)
        assert_never_both(state)
    assert state.step is not None, f"no {action} step"
    return sending(state)


def finish(state: PairMemory, now: float = 2.0) -> PairMemory:
    while state.phase in ("settling", "handing"):
        state = step_done(sending(state), now)
        assert_never_both(state)
    return state


def assert_never_both(state: PairMemory) -> None:
    assert [m for _, m in state.memory].count("held") <= 1, state.memory


def test_a_fresh_gateway_admits_nowhere_until_discovery():
    state = initial(0.0)
    assert state.phase == "discovering" and state.admitting is None
    assert dict(state.memory) == {"mtp": "unknown", "plain": "unknown"}


def test_discovery_without_a_journal_finds_the_ready_server_holding():
    state = discovered(initial(0.0), {"mtp": PAUSED, "plain": READY}, "mtp", 1.0)
    # plain serves; what waits on the paused mtp server comes over, then plain admits
    assert state.phase == "settling"
    assert state.plan == (Step("move_unstarted", "mtp"), Step("end_streams", "mtp"))
    assert dict(state.memory) == {"mtp": "released", "plain": "held"}
    state = step_done(step_done(state, 1.5), 1.6)
    assert state.phase == "holding" and state.admitting == "plain"


def test_a_turn_each_way_in_order_never_both_holding():
    state = begin_turn(holding("mtp"), "plain", 1.0)
    assert state.phase == "handing" and state.admitting is None and state.source == "mtp"
    assert [str(s) for s in state.plan] == [
        "stop_admitting(mtp)", "move_unstarted(mtp)", "running_streams(mtp)", "keep_caches(mtp)",
        "pause(mtp)", "release(mtp)", "check_memory(mtp)", "resume(plain)", "continue(plain)",
        "check_ready(plain)"]
    state = run_until(state, "resume")
    assert dict(state.memory) == {"mtp": "released", "plain": "resuming"}  # neither, in doubt
    state = finish(state)
    assert state.phase == "holding" and state.admitting == "plain"
    back = begin_turn(state, "mtp", 3.0)
    assert back.plan[-1] == Step("check_speculation", "mtp")  # only into MTP
    back = finish(back, 4.0)
    assert back.admitting == "mtp" and dict(back.memory) == {"mtp": "held", "plain": "released"}


@pytest.mark.parametrize("target,phase", [("mtp", "holding"), ("plain", "discovering")])
def test_no_turn_to_the_holder_nor_outside_holding(target, phase):
    state = holding("mtp")
    if phase != "holding":
        state = initial(0.0)
    with pytest.raises(ValueError):
        begin_turn(state, target, 1.0)


def test_no_step_to_finish_or_fail_outside_a_plan():
    with pytest.raises(ValueError):
        step_done(holding(), 1.0)
    with pytest.raises(ValueError):
        step_failed(holding(), "error", "x", 1.0)
    with pytest.raises(ValueError):
        discovered(holding(), {"mtp": READY, "plain": PAUSED}, "mtp", 1.0)


def test_the_journal_marks_a_release_and_a_resume_in_doubt_before_they_go():
    state = run_until(begin_turn(holding(), "plain", 1.0), "release")
    assert state.of("mtp") == "releasing"
    assert journal(state)["memory"] == {"mtp": "releasing", "plain": "released"}
    assert journal(state)["step"] == "release(mtp)"
    assert sending(holding()) == holding()  # nothing in doubt outside a call


@pytest.mark.parametrize("action", ["move_unstarted", "running_streams", "keep_caches", "pause"])
def test_a_failure_before_the_release_rolls_back_to_the_source(action):
    state = run_until(begin_turn(holding(), "plain", 1.0), action)
    state = step_failed(state, "timeout", "no answer", 2.0)
    assert state.phase == "discovering" and state.admitting is None
    assert state.failure is not None and state.failure.step.action == action
    state = discovered(state, {"mtp": PAUSED, "plain": PAUSED}, "plain", 3.0)
    assert [str(s) for s in state.plan] == ["continue(mtp)", "check_ready(mtp)",
                                            "move_unstarted(plain)", "end_streams(plain)"]
    assert finish(state).admitting == "mtp"


@pytest.mark.parametrize("kind,sent", [("error", True), ("gone", False), ("timeout", False)])
def test_a_release_that_did_not_happen_leaves_the_source_holding(kind, sent):
    state = run_until(begin_turn(holding(), "plain", 1.0), "release")
    state = step_failed(state, kind, "release failed", 2.0, sent=sent)
    assert state.of("mtp") == "held"
    state = discovered(state, {"mtp": PAUSED, "plain": PAUSED}, "plain", 3.0)
    assert state.target == "mtp" and finish(state).admitting == "mtp"


def test_a_release_without_an_answer_then_done_goes_on_to_the_target():
    state = step_failed(run_until(begin_turn(holding(), "plain", 1.0), "release"),
                        "timeout", "no answer in 60 s", 2.0)
    assert state.of("mtp") == "releasing"
    state = discovered(state, {"mtp": PAUSED, "plain": PAUSED}, "plain", 3.0)
    assert dict(state.memory) == {"mtp": "released", "plain": "released"}
    assert state.plan[:2] == (Step("check_memory", "plain"), Step("resume", "plain"))
    assert finish(state).admitting == "plain"


def test_a_release_still_running_leaves_the_pair_stuck_and_waiting():
    state = step_failed(run_until(begin_turn(holding(), "plain", 1.0), "release"),
                        "timeout", "no answer", 2.0)
    state = discovered(state, {"mtp": STUCK_IN_CALL, "plain": PAUSED}, "plain", 3.0)
    assert state.phase == "stuck" and state.admitting is None and "mtp (releasing)" in state.why
    # discovery again, once the release has finished
    state = discovered(state, {"mtp": PAUSED, "plain": PAUSED}, "plain", 9.0)
    assert state.phase == "settling" and finish(state).admitting == "plain"


def test_the_source_dying_mid_turn_frees_its_memory_for_the_target():
    state = run_until(begin_turn(holding(), "plain", 1.0), "pause")
    state = step_failed(state, "gone", "connection refused", 2.0, sent=False)
    state = discovered(state, {"mtp": DEAD, "plain": PAUSED}, "mtp", 3.0)
    assert state.of("mtp") == "gone" and state.target == "plain"
    assert Step("move_unstarted", "mtp") not in state.plan  # nothing to ask a dead server
    assert finish(state).admitting == "plain"


def test_memory_that_does_not_come_back_retries_then_sticks():
    state = run_until(begin_turn(holding(), "plain", 1.0), "check_memory")
    for attempt in range(SETTLE_ATTEMPTS):
        state = step_failed(state, "check", "GPU 0: 12 % free", 2.0 + attempt)
        state = discovered(state, {"mtp": PAUSED, "plain": PAUSED}, "plain", 2.5 + attempt)
        if state.phase == "stuck":
            break
        assert state.step == Step("check_memory", state.target)
        if attempt == 0:  # the memory was in doubt for plain: mtp takes it back first
            assert state.target == "mtp"
    assert state.phase == "stuck" and "in a row" in state.why
    assert dict(state.memory) == {"mtp": "released", "plain": "released"}


def test_a_resume_error_resumes_the_source_instead():
    state = step_failed(run_until(begin_turn(holding(), "plain", 1.0), "resume"),
                        "error", "HTTP 400", 2.0)
    assert state.of("plain") == "released" and state.avoid == "plain"
    state = discovered(state, {"mtp": PAUSED, "plain": PAUSED}, "plain", 3.0)
    assert state.plan[:2] == (Step("check_memory", "mtp"), Step("resume", "mtp"))
    done = finish(state)
    assert done.admitting == "mtp" and done.avoid is None


def test_a_resume_that_never_answers_leaves_that_server_alone():
    state = step_failed(run_until(begin_turn(holding(), "plain", 1.0), "resume"),
                        "timeout", "no answer", 2.0)
    state = discovered(state, {"mtp": PAUSED, "plain": STUCK_IN_CALL}, "plain", 3.0)
    assert dict(state.memory) == {"mtp": "released", "plain": "hung"}
    assert all(step.role == "mtp" or step.action in ("move_unstarted", "end_streams")
               for step in state.plan)
    assert finish(state).admitting == "mtp"


def test_no_turn_to_a_hung_server_until_it_answers_again_paused():
    state = step_failed(run_until(begin_turn(holding(), "plain", 1.0), "resume"),
                        "timeout", "no answer", 2.0)
    state = finish(discovered(state, {"mtp": PAUSED, "plain": STUCK_IN_CALL}, "plain", 3.0))
    assert state.admitting == "mtp" and not can_turn_to(state, "plain")
    with pytest.raises(ValueError):
        begin_turn(state, "plain", 4.0)
    assert reprobed(state, "plain", STUCK_IN_CALL) is state  # still hung
    assert reprobed(state, "plain", DEAD) is state
    again = reprobed(state, "plain", PAUSED)  # restarted, paused beside the holder
    assert again.of("plain") == "released" and can_turn_to(again, "plain")
    assert reprobed(holding(), "mtp", PAUSED) == holding()  # the holder is not reprobed


def test_a_resume_answered_late_counts_as_held():
    state = step_failed(run_until(begin_turn(holding(), "plain", 1.0), "resume"),
                        "timeout", "no answer", 2.0)
    state = discovered(state, {"mtp": PAUSED, "plain": PAUSED}, "mtp", 3.0)
    assert state.target == "plain" and state.plan[0] == Step("continue", "plain")


@pytest.mark.parametrize("action", ["continue", "check_ready"])
def test_the_target_holding_but_not_serving_is_retried_then_stuck(action):
    state = run_until(begin_turn(holding(), "plain", 1.0), action)
    for attempt in range(SETTLE_ATTEMPTS):
        state = step_failed(state, "timeout", "/ready 503", 2.0 + attempt)
        state = discovered(state, {"mtp": PAUSED, "plain": PAUSED}, "mtp", 2.5 + attempt)
        if state.phase == "stuck":
            break
        assert state.target == "plain"  # it holds the memory: no one else may take it
        state = run_until(state, "check_ready")
    assert state.phase == "stuck"


def test_a_release_whose_connection_broke_is_in_doubt_until_the_probes_tell():
    state = step_failed(run_until(begin_turn(holding(), "plain", 1.0), "release"),
                        "gone", "closed before answering", 2.0)
    assert state.of("mtp") == "releasing"
    dead = discovered(state, {"mtp": DEAD, "plain": PAUSED}, "mtp", 3.0)
    assert dead.of("mtp") == "gone" and dead.target == "plain"


def test_the_target_dying_after_its_resume_frees_the_memory_for_the_source():
    state = step_failed(run_until(begin_turn(holding(), "plain", 1.0), "continue"),
                        "gone", "connection reset", 2.0)
    state = discovered(state, {"mtp": PAUSED, "plain": DEAD}, "plain", 3.0)
    assert state.target == "mtp" and finish(state).admitting == "mtp"


def test_a_holder_lost_while_holding_is_settled_again():
    state = holder_lost(holding("mtp"), 5.0)
    assert state.phase == "discovering" and state.admitting is None
    state = discovered(state, {"mtp": DEAD, "plain": PAUSED}, "mtp", 6.0)
    assert state.target == "plain" and finish(state).admitting == "plain"
    with pytest.raises(ValueError):
        holder_lost(state, 7.0)


def test_speculation_that_no_longer_pays_keeps_serving_and_is_remembered():
    state = run_until(begin_turn(holding("plain"), "mtp", 1.0), "check_speculation")
    state = step_failed(state, "check", "accept length 1.00 < 1.2", 2.0)
    assert state.phase == "holding" and state.admitting == "mtp"
    assert state.speculation_lost and state.failure is not None
    assert state.failure.step == Step("check_speculation", "mtp")


@pytest.mark.parametrize("kind", ["error", "timeout", "gone"])
def test_a_speculation_check_that_measured_nothing_is_no_lost_speculation(kind):
    state = run_until(begin_turn(holding("plain"), "mtp", 1.0), "check_speculation")
    state = step_failed(state, kind, "mtp /generate: connection lost", 2.0)
    assert state.phase == "holding" and state.admitting == "mtp"
    assert not state.speculation_lost  # MTP may be wished for again
    assert state.failure is not None and state.failure.kind == kind  # said all the same


def test_a_lost_speculation_stays_lost_through_a_later_check_that_measured_nothing():
    lost = replace(holding("plain"), speculation_lost=True)
    state = run_until(begin_turn(lost, "mtp", 1.0), "check_speculation")
    assert step_failed(state, "timeout", "no answer", 2.0).speculation_lost


def test_restart_mid_release_settles_from_the_journal():
    state = run_until(begin_turn(holding(), "plain", 1.0), "release")
    restarted = from_journal(journal(state), 10.0)
    assert restarted.phase == "discovering" and restarted.of("mtp") == "releasing"
    settled = discovered(restarted, {"mtp": PAUSED, "plain": PAUSED}, "mtp", 11.0)
    assert settled.target == "mtp" and settled.plan[1] == Step("resume", "mtp")


def test_restart_before_the_release_continues_the_source():
    state = run_until(begin_turn(holding(), "plain", 1.0), "pause")
    state = step_done(state, 1.5)  # paused, not yet released
    restarted = from_journal(journal(state), 10.0)
    settled = discovered(restarted, {"mtp": PAUSED, "plain": PAUSED}, "plain", 11.0)
    assert settled.plan[0] == Step("continue", "mtp")


def test_both_resident_at_start_the_unwanted_one_is_parked():
    state = discovered(initial(0.0), {"mtp": READY, "plain": READY}, "mtp", 1.0)
    assert state.plan[:2] == (Step("pause", "plain"), Step("release", "plain"))
    state = step_done(step_done(sending(step_done(state, 1.1)), 1.2), 1.3)  # found both: ours
    assert_never_both(state)  # from the release on, one
    assert finish(state).admitting == "mtp"


def test_a_server_without_the_memory_saver_serves_but_never_turns():
    plain = Probe(alive=True, ready=False, scheduler_answers=True, memory_saver=False)
    state = finish(discovered(initial(0.0), {"mtp": READY, "plain": plain}, "mtp", 1.0))
    assert state.admitting == "mtp" and not can_turn_to(state, "plain")
    assert "plain runs without --enable-memory-saver" in state.cannot_turn


def test_every_action_is_in_some_plan():
    settle = discovered(initial(0.0), {"mtp": PAUSED, "plain": READY}, "mtp", 1.0).plan
    seen = {s.action for s in (*turn_plan("plain", "mtp"), *turn_plan("plain", "mtp", "vllm"), *settle)}
    assert seen == set(ACTIONS)


# --- each transition as a whole value (what /admin/state and the journal say of it) ----------


def test_a_start_after_a_restart_forgets_only_what_the_restart_ended():
    assert initial(4.0, {"mtp": "hung", "plain": "held"}) == PairMemory(
        "discovering", (("mtp", "unknown"), ("plain", "held")), since=4.0, step_since=4.0)


def test_a_turn_begins_with_its_whole_plan_and_a_fresh_count():
    before = replace(holding(), why="earlier", failed_plans=2)
    assert begin_turn(before, "plain", 5.0) == replace(
        before, phase="handing", plan=turn_plan("mtp", "plain"), target="plain", since=5.0,
        step_since=5.0, failed_plans=0, why="")
    with pytest.raises(ValueError, match=r"^no turn to mtp from holding \(memory \{'mtp': 'held', "
                                         r"'plain': 'released'\}\)$"):
        begin_turn(holding(), "mtp", 5.0)


def test_a_holder_lost_goes_back_to_discovery_from_now():
    assert holder_lost(holding(), 6.0) == replace(holding(), phase="discovering", since=6.0,
                                                  step_since=6.0)
    with pytest.raises(ValueError, match="^no holder to lose in discovering$"):
        holder_lost(initial(0.0), 6.0)


def test_each_step_done_moves_the_step_clock_and_the_last_holds_from_now():
    turn = run_until(begin_turn(holding(), "plain", 1.0), "release")
    released = step_done(turn, 2.0)
    assert released == replace(turn, memory=(("mtp", "released"), ("plain", "released")),
                               plan=turn.plan[1:], step_since=2.0)
    last = replace(run_until(released, "check_ready"), failed_plans=1, avoid="mtp")
    assert step_done(last, 3.0) == replace(last, phase="holding", plan=(), since=3.0,
                                           step_since=3.0, failed_plans=0, avoid=None)
    with pytest.raises(ValueError, match=r"^no step in progress \(holding\)$"):
        step_done(holding(), 3.0)


@pytest.mark.parametrize("action", ["check_memory", "resume", "continue", "check_ready"])
def test_a_failure_taking_the_memory_is_remembered_and_that_server_avoided(action):
    turn = run_until(begin_turn(holding(), "plain", 1.0), action)
    failed = step_failed(turn, "timeout", "no answer", 4.0)
    assert failed.failure == Failure(turn.plan[0], "timeout", "no answer", 4.0)
    assert failed == replace(turn, phase="discovering", memory=failed.memory, plan=(), target=None,
                             since=4.0, step_since=4.0, failure=failed.failure, failed_plans=1,
                             avoid="plain")
    with pytest.raises(ValueError, match=r"^no step in progress \(holding\)$"):
        step_failed(holding(), "timeout", "no answer", 4.0)


def test_a_lost_speculation_holds_from_the_check():
    turn = run_until(begin_turn(holding("plain"), "mtp", 1.0), "check_speculation")
    state = step_failed(turn, "check", "accepts 1.00", 5.0)
    assert (state.phase, state.holder, state.since, state.step_since) == ("holding", "mtp", 5.0, 5.0)
    assert state.failure == Failure(turn.plan[0], "check", "accepts 1.00", 5.0)


def test_a_server_found_gone_beside_the_holder_may_take_the_memory_once_it_is_back_paused():
    state = finish(discovered(initial(0.0, {"plain": "held"}), {"mtp": DEAD, "plain": READY},
                              "plain", 1.0))
    assert state.admitting == "plain" and state.of("mtp") == "gone"
    back = reprobed(state, "mtp", PAUSED)
    assert back.of("mtp") == "released" and can_turn_to(back, "mtp")
    discovering = replace(state, phase="discovering")  # outside holding the probes decide
    assert reprobed(discovering, "mtp", PAUSED) is discovering
