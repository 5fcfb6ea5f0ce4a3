"""Discovery (gateway/turns/discovery.py): what the facts and fresh probes make safe when
nothing holds surely. The walks through turns and failures that end in discovery are in
test_state.py."""

from __future__ import annotations

from gateway.engine.probe import Probe
from gateway.turns.discovery import discovered
from gateway.turns.state import Step, initial

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
