"""Discovery (gateway/turns/discovery.py): what the facts and fresh probes make safe when
nothing holds surely. The walks through turns and failures that end in discovery are in
test_state.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.turns.discovery import SETTLE_ATTEMPTS, discovered, rediscover, resolve
from gateway.turns.state import MEMORIES, Memory, Step, initial
from gateway.upstream.engine.probe import Probe

PAUSED = Probe(alive=True, ready=False, scheduler_answers=True)
DEAD = Probe(alive=False)


def test_both_paused_without_a_journal_is_stuck_unless_nvml_says_free():
    state = discovered(initial(0.0), {"mtp": PAUSED, "plain": PAUSED}, "mtp", 1.0)
    assert state.phase == "stuck" and "cannot tell" in state.why
    free = discovered(initial(0.0), {"mtp": PAUSED, "plain": PAUSED}, "mtp", 1.0,
                      memory_free=True)
    assert free.target == "mtp" and free.plan[1] == Step("resume", "mtp")


def test_both_gone_is_stuck():
    state = discovered(initial(0.0), {"mtp": DEAD, "plain": DEAD}, "mtp", 1.0)
    assert state.phase == "stuck" and "no server can take" in state.why


READY = Probe(alive=True, ready=True, scheduler_answers=True)
IN_A_CALL = Probe(alive=True, ready=False, scheduler_answers=False)  # its scheduler busy


@pytest.mark.parametrize(("memory", "probe", "found"), [
    *[(memory, DEAD, "gone") for memory in MEMORIES],  # a dead process holds nothing
    ("releasing", PAUSED, "released"), ("releasing", IN_A_CALL, "releasing"),
    ("resuming", PAUSED, "held"), ("resuming", READY, "held"), ("resuming", IN_A_CALL, "hung"),
    ("unknown", READY, "held"), ("gone", READY, "held"), ("hung", READY, "held"),
    ("gone", PAUSED, "unknown"), ("hung", PAUSED, "unknown"), ("gone", IN_A_CALL, "unknown"),
    ("unknown", PAUSED, "unknown"), ("held", IN_A_CALL, "held"), ("released", PAUSED, "released"),
])
def test_what_a_probe_tells_of_one_servers_memory(memory: Memory, probe: Probe, found: Memory):
    assert resolve(memory, probe) == found


def test_a_holder_ready_beside_a_dead_server_holds_at_once():
    before = replace(initial(0.0, {"mtp": "held"}), why="earlier", failed_plans=2, avoid="plain",
                     cannot_turn="earlier")
    state = discovered(before, {"mtp": READY, "plain": DEAD}, "plain", 3.0)
    assert state == replace(before, phase="holding", memory=(("mtp", "held"), ("plain", "gone")),
                            plan=(), target="mtp", since=3.0, step_since=3.0, failed_plans=0,
                            why="", avoid=None, cannot_turn="")


def test_a_settling_says_its_whole_plan_and_clears_what_stuck_it():
    stuck = replace(initial(0.0), phase="stuck", why="earlier")
    state = discovered(stuck, {"mtp": PAUSED, "plain": READY}, "mtp", 2.0)
    assert state == replace(stuck, phase="settling", memory=(("mtp", "released"), ("plain", "held")),
                            plan=(Step("move_unstarted", "mtp"), Step("end_streams", "mtp")),
                            target="plain", since=2.0, step_since=2.0, why="")


def test_a_resumed_mtp_is_checked_for_its_speculation_a_resumed_plain_is_not():
    facts = {"mtp": "released", "plain": "released"}
    to_mtp = discovered(initial(0.0, facts), {"mtp": PAUSED, "plain": DEAD}, "mtp", 1.0)
    assert to_mtp.plan == (Step("check_memory", "mtp"), Step("resume", "mtp"),
                           Step("continue", "mtp"), Step("check_ready", "mtp"),
                           Step("check_speculation", "mtp"))
    to_plain = discovered(initial(0.0, facts), {"mtp": DEAD, "plain": PAUSED}, "mtp", 1.0)
    assert to_plain.plan == (Step("check_memory", "plain"), Step("resume", "plain"),
                             Step("continue", "plain"), Step("check_ready", "plain"))


def test_a_server_that_failed_to_take_the_memory_is_tried_last():
    avoided = replace(initial(0.0, {"mtp": "released", "plain": "released"}), avoid="mtp")
    state = discovered(avoided, {"mtp": PAUSED, "plain": PAUSED}, "mtp", 1.0)
    assert state.target == "plain" and state.plan[1] == Step("resume", "plain")


def test_too_many_failed_plans_leave_the_pair_stuck_with_no_plan():
    tired = replace(initial(0.0, {"mtp": "held"}), failed_plans=SETTLE_ATTEMPTS, target="mtp",
                    plan=(Step("continue", "mtp"),))
    state = discovered(tired, {"mtp": READY, "plain": PAUSED}, "mtp", 1.0)
    assert (state.phase, state.plan, state.target) == ("stuck", (), None)
    assert state.why == f"{SETTLE_ATTEMPTS} settling plans failed in a row"


def test_why_a_pair_is_stuck_names_each_server():
    doubt = discovered(initial(0.0), {"mtp": PAUSED, "plain": PAUSED}, "mtp", 1.0)
    assert (doubt.plan, doubt.target) == ((), None)
    assert doubt.why == ("cannot tell whether mtp (unknown), plain (unknown) holds the memory: "
                         "resuming the other could hang it, so the pair waits (a journal, "
                         "turns.state_file, or NVML tells)")
    gone = discovered(replace(initial(0.0), target="mtp", plan=(Step("continue", "mtp"),)),
                      {"mtp": DEAD, "plain": DEAD}, "mtp", 1.0)
    assert (gone.plan, gone.target, gone.why) == ((), None,
                                                  "no server can take the memory (mtp gone, plain gone)")


def test_servers_without_the_memory_saver_are_named():
    without = Probe(alive=True, ready=True, scheduler_answers=True, memory_saver=False)
    state = discovered(initial(0.0, {"plain": "released"}), {"mtp": without, "plain": without},
                       "mtp", 1.0)
    assert state.cannot_turn == ("mtp, plain runs without --enable-memory-saver: a turns pair "
                                 "needs it on both servers")


def test_rediscovery_is_from_stuck_only_with_a_fresh_count():
    stuck = replace(initial(0.0), phase="stuck", failed_plans=SETTLE_ATTEMPTS, why="earlier")
    assert rediscover(stuck, 7.0) == replace(stuck, phase="discovering", failed_plans=0, since=7.0,
                                             step_since=7.0)
    with pytest.raises(ValueError, match="^rediscovery from discovering$"):
        rediscover(initial(0.0), 1.0)
    with pytest.raises(ValueError, match="^discovery from stuck$|^discovery from holding$"):
        discovered(replace(stuck, phase="holding"), {"mtp": READY, "plain": PAUSED}, "mtp", 1.0)
