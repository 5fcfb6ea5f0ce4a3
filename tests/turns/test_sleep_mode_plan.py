"""A vLLM turns pair's state (gateway/turns/state.py `HANDOVERS["vllm"]`, discovery.py): its
turns and settlings in sleep mode's calls, and what /is_sleeping settles. Pure: plain values."""

from __future__ import annotations

import pytest

from gateway.turns.discovery import discovered, resolve
from gateway.turns.state import (
    MEMORIES,
    PairMemory,
    Step,
    begin_turn,
    initial,
    sending,
    step_done,
    step_failed,
    turn_plan,
)
from gateway.upstream.engine.probe import Probe

AWAKE = Probe(alive=True, ready=True, scheduler_answers=True, memory_saver=True, asleep=False)
ASLEEP = Probe(alive=True, ready=False, scheduler_answers=True, memory_saver=True, asleep=True)
IN_A_CALL = Probe(alive=True, scheduler_answers=False)  # /health 200, /is_sleeping unanswered
SGLANG_CALLS = {"pause", "release", "resume", "continue", "keep_caches", "running_streams"}


def holding(role: str = "mtp") -> PairMemory:
    other = "plain" if role == "mtp" else "mtp"
    state = discovered(initial(0.0, engine="vllm"), {role: AWAKE, other: ASLEEP}, "mtp", 0.0)
    while state.phase == "settling":
        state = step_done(state, 0.0)
    assert state.phase == "holding" and state.holder == role
    return state


def test_a_turn_is_one_sleep_and_one_wake_after_the_streams_finished():
    assert [str(step) for step in turn_plan("mtp", "plain", "vllm")] == [
        "stop_admitting(mtp)", "move_unstarted(mtp)", "finish_streams(mtp)", "sleep(mtp)",
        "check_memory(mtp)", "wake_up(plain)", "check_ready(plain)"]
    assert [str(step) for step in turn_plan("plain", "mtp", "vllm")][-3:] == [
        "wake_up(mtp)", "check_ready(mtp)", "check_speculation(mtp)"]


def test_a_turn_walks_the_memory_over_never_both_held():
    state = begin_turn(holding("mtp"), "plain", 1.0)
    assert state.plan == turn_plan("mtp", "plain", "vllm")
    seen = []
    while state.phase == "handing":
        state = step_done(sending(state), 2.0)
        seen.append(dict(state.memory))
        assert list(state.memory).count(("mtp", "held")) + list(state.memory).count(("plain", "held")) <= 1
    assert state.holder == "plain" and state.of("mtp") == "released"
    assert {"mtp": "released", "plain": "released"} in seen  # asleep both, between the two


def test_a_sleep_or_a_wake_in_flight_is_in_doubt():
    state = begin_turn(holding("mtp"), "plain", 1.0)
    while state.step != Step("sleep", "mtp"):
        state = step_done(state, 1.0)
    assert sending(state).of("mtp") == "releasing"
    while state.step != Step("wake_up", "plain"):
        state = step_done(state, 1.0)
    assert sending(state).of("plain") == "resuming"


def test_a_wake_answered_500_leaves_the_server_asleep_and_the_other_preferred():
    """v1/engine/core.py:1848-1851: the wake failed; the executor is still asleep."""
    state = begin_turn(holding("mtp"), "plain", 1.0)
    while state.step != Step("wake_up", "plain"):
        state = step_done(state, 1.0)
    failed = step_failed(sending(state), "error", "Call to wake_up method failed", 2.0)
    assert failed.phase == "discovering" and failed.of("plain") == "released"
    assert failed.avoid == "plain"
    settled = discovered(failed, {"mtp": ASLEEP, "plain": ASLEEP}, "plain", 3.0)
    assert settled.target == "mtp" and settled.engine == "vllm"
    assert [str(s) for s in settled.plan] == [
        "check_memory(mtp)", "wake_up(mtp)", "check_ready(mtp)", "check_speculation(mtp)",
        "move_unstarted(plain)", "end_streams(plain)"]


@pytest.mark.parametrize("memory", MEMORIES)
def test_is_sleeping_answered_is_the_fact(memory):
    """/is_sleeping is answered by the engine core after any sleep or wake sent before it: what
    it says is what the server holds, whatever was known."""
    assert resolve(memory, AWAKE) == "held"
    assert resolve(memory, ASLEEP) == "released"


def test_is_sleeping_unanswered_keeps_a_call_in_doubt():
    assert resolve("releasing", IN_A_CALL) == "releasing"
    assert resolve("resuming", IN_A_CALL) == "hung"


def test_a_sleep_that_timed_out_but_never_happened_leaves_the_source_holding():
    state = begin_turn(holding("mtp"), "plain", 1.0)
    while state.step != Step("sleep", "mtp"):
        state = step_done(state, 1.0)
    failed = step_failed(sending(state), "timeout", "no answer", 2.0)
    assert failed.of("mtp") == "releasing"
    settled = discovered(failed, {"mtp": AWAKE, "plain": ASLEEP}, "plain", 3.0)
    assert settled.phase == "settling" and settled.target == "mtp"
    assert {s.action for s in settled.plan} <= {"move_unstarted", "end_streams"}


def test_both_awake_at_start_the_unwanted_one_sleeps():
    state = discovered(initial(0.0, engine="vllm"), {"mtp": AWAKE, "plain": AWAKE}, "mtp", 1.0)
    assert [str(s) for s in state.plan] == [
        "sleep(plain)", "check_ready(mtp)", "move_unstarted(plain)", "end_streams(plain)"]


def test_no_sglang_call_is_ever_planned_for_a_vllm_pair():
    plans = [turn_plan(s, t, "vllm") for s, t in (("mtp", "plain"), ("plain", "mtp"))]
    for probes in ({"mtp": AWAKE, "plain": AWAKE}, {"mtp": ASLEEP, "plain": ASLEEP}):
        plans.append(discovered(initial(0.0, {"mtp": "released", "plain": "released"}, "vllm"),
                                probes, "mtp", 1.0).plan)
    assert not {step.action for plan in plans for step in plan} & SGLANG_CALLS


def test_a_server_without_dev_mode_serves_but_never_turns():
    no_dev_mode = Probe(alive=True, ready=True, scheduler_answers=True, memory_saver=False,
                        asleep=False)
    state = discovered(initial(0.0, engine="vllm"), {"mtp": AWAKE, "plain": no_dev_mode}, "mtp", 1.0)
    assert "plain runs without VLLM_SERVER_DEV_MODE=1" in state.cannot_turn
