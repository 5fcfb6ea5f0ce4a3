"""One backend's state (gateway/routing/backend.py): its counts, its circuit, its probes, its readings.

Plain values and explicit times: the circuit's open period ends when a decision looks at it
after `open_until`, so no clock is needed here.
"""

from __future__ import annotations

import pytest

from gateway.config import Backend
from gateway.routing.backend import BackendState, CircuitRules, ProbeRules


def backend(failures_to_open: int = 3, open_s: float = 10.0, fall: int = 3,
            rise: int = 2) -> BackendState:
    return BackendState("mtp", "p", "mtp", Backend(url="http://x"),
                        circuit_rules=CircuitRules(failures_to_open, open_s),
                        probe_rules=ProbeRules(fall, rise))


def opened(at: float = 0.0) -> BackendState:
    state = backend()
    for _ in range(3):
        state.circuit_failure(at)
    return state


# --- the counts a lease keeps -----------------------------------------------------------------

def test_a_request_is_counted_in_and_out_once() -> None:
    state, a, b = backend(), object(), object()
    assert state.admit(0.0, a) is False  # a closed circuit: no trial
    assert (state.inflight, state.not_started) == (1, 1)
    state.first_byte(a)
    state.first_byte(a)  # a second first byte changes nothing
    assert (state.inflight, state.not_started) == (1, 0)
    state.leave(1.0, a, finished=True)
    assert (state.inflight, state.not_started, state.served) == (0, 0, 1)
    state.admit(2.0, b)
    state.leave(3.0, b, finished=True)
    assert state.served == 2


def test_which_requests_have_not_started_is_kept_by_request_in_arrival_order() -> None:
    state, a, b, c = backend(), object(), object(), object()
    for request in (a, b, c):
        state.admit(0.0, request)
    state.first_byte(b)
    assert list(state.unstarted) == [a, c] and state.not_started == 2
    state.leave(1.0, b, finished=False)  # started: the others stay unstarted
    state.leave(1.0, a, finished=False)
    assert list(state.unstarted) == [c] and state.inflight == 1


def test_a_request_that_leaves_before_its_first_byte_is_not_served() -> None:
    state, a = backend(), object()
    state.admit(0.0, a)
    state.leave(1.0, a, finished=False)
    assert (state.inflight, state.not_started, state.served) == (0, 0, 0)


def test_a_stream_moved_here_has_started_already() -> None:
    state, a = backend(), object()
    state.admit(0.0, a, started=True)
    assert (state.inflight, state.not_started) == (1, 0)
    state.leave(1.0, a, finished=False)
    assert (state.inflight, state.not_started, state.served) == (0, 0, 0)


def test_the_running_area_counts_streams_up_to_the_cap() -> None:
    state = backend()
    state.effective_cap = 2
    assert state.area(0.0) == 0.0
    requests = [object() for _ in range(3)]
    for request in requests:
        state.admit(0.0, request)
    assert (state.inflight, state.not_started) == (3, 3)
    assert state.area(1.0) == 2.0  # three in flight, two running
    state.effective_cap = None
    assert state.area(2.0) == 5.0  # cap unknown: all three
    assert state.area(1.5) == 5.0  # a time before the last one changes nothing
    state.leave(3.0, requests[0], finished=False)
    assert state.area(4.0) == 5.0 + 3.0 + 2.0


# --- the circuit ------------------------------------------------------------------------------

def test_failures_in_a_row_open_the_circuit_for_open_s() -> None:
    state = backend()
    assert state.circuit_failure(0.0) is False
    assert state.circuit_failure(0.0) is False
    assert state.accepting(0.0)
    assert state.circuit_failure(1.0) is True
    assert not state.accepting(1.0) and not state.accepting(10.99)
    assert state.accepting(11.0)  # open_s after the failure that opened it: half-open


def test_a_success_starts_the_count_again() -> None:
    state = backend()
    state.circuit_failure(0.0)
    state.circuit_failure(0.0)
    state.circuit_success()
    assert state.circuit_failure(0.0) is False and state.circuit_failure(0.0) is False
    assert state.accepting(0.0)


def test_a_failure_while_open_neither_reopens_nor_extends_it() -> None:
    state = opened(at=0.0)
    assert state.circuit_failure(5.0) is False  # an older request's failure
    assert state.accepting(10.0)


def test_half_open_lets_exactly_one_trial_go() -> None:
    state = opened(at=0.0)
    assert state.admit(10.0, object()) is True
    assert not state.accepting(10.0)
    # A stream moved here meanwhile is no second trial.
    assert state.admit(10.5, object(), started=True) is False
    state.end_trial()  # the trial ended with no verdict (its client left)
    assert state.circuit.trial_in_flight is False and state.accepting(11.0)


def test_an_older_request_ending_during_the_trial_gives_no_verdict_on_it() -> None:
    """A request admitted before the circuit opened is still in flight during the trial: it
    is not the trial (admit said so), so only the trial's own end frees the next one."""
    state, older = backend(), object()
    assert state.admit(0.0, older) is False
    for _ in range(3):
        state.circuit_failure(0.0)
    assert state.admit(10.0, object()) is True  # the trial
    state.leave(10.5, older, finished=False)  # the older one ends, no verdict
    assert not state.accepting(10.5)


def test_the_trials_success_closes_the_circuit() -> None:
    state = opened(at=0.0)
    state.admit(10.0, object())
    state.circuit_success()
    assert state.accepting(10.0) and state.admit(10.0, object()) is False
    assert (state.circuit.failures, state.circuit.open_until) == (0, None)


def test_the_trials_failure_opens_it_again_at_once() -> None:
    state = opened(at=0.0)
    state.admit(10.0, object())
    assert state.circuit_failure(12.0) is True
    assert state.circuit.trial_in_flight is False
    assert not state.accepting(21.99) and state.accepting(22.0)
    assert state.admit(22.0, object()) is True  # the next trial


# --- probes -----------------------------------------------------------------------------------

def test_fall_failed_probes_in_a_row_take_it_down() -> None:
    state = backend(fall=3)
    assert [state.probe_failed() for _ in range(2)] == [False, False]
    assert state.probe_ok() is False  # a good one breaks the streak
    assert [state.probe_failed() for _ in range(3)] == [False, False, True]
    assert state.up is False and state.accepting(0.0) is False
    assert state.probe_failed() is False  # already down: no second transition


def test_rise_good_probes_in_a_row_bring_it_back() -> None:
    state = backend(fall=1, rise=2)
    assert state.probe_failed() is True
    assert state.probe_ok() is False and not state.up
    assert state.probe_failed() is False  # the streak starts again
    assert [state.probe_ok() for _ in range(2)] == [False, True]
    assert state.up and state.accepting(0.0)
    assert state.probe_ok() is False  # already up


def test_a_parked_server_comes_back_up_with_clean_streaks() -> None:
    """A turns pair's driver parks the server without the memory (its failed probes say
    nothing of its health) and unparks it once it saw it ready."""
    state = backend(fall=1)
    state.set_parked(True)
    state.probe_failed()  # paused: the monitor may still have seen it fail
    assert state.parked and state.up is False
    state.set_parked(True)  # parked again: nothing changes
    assert state.up is False
    state.set_parked(False)
    assert (state.parked, state.up, state.good_probes, state.bad_probes) == (False, True, 0, 0)
    state.probe_failed()
    state.set_parked(False)  # not parked: unparking again resets nothing
    assert (state.up, state.bad_probes) == (False, 1)


# --- readings ---------------------------------------------------------------------------------

def test_the_reported_load_moves_with_our_own_requests_since() -> None:
    state = backend()
    assert state.reported_load(0.0, max_age_s=2.0) is None  # no reading yet
    requests = [object() for _ in range(3)]
    state.admit(0.0, requests[0])
    state.admit(0.0, requests[1])
    state.record_loads(running=5, waiting=3, now=1.0)  # counted our two
    state.admit(1.5, requests[2])
    assert state.reported_load(1.5, max_age_s=2.0) == 9
    assert state.reported_load(3.0, max_age_s=2.0) == 9  # exactly max_age_s old: still used
    assert state.reported_load(3.01, max_age_s=2.0) is None
    for request in requests:
        state.leave(2.0, request, finished=False)
    state.record_loads(running=0, waiting=0, now=2.0)
    state.admit(2.0, object())
    assert state.reported_load(2.0, max_age_s=2.0) == 1


def test_the_reported_load_is_never_negative() -> None:
    state = backend()
    requests = [object() for _ in range(4)]
    for request in requests:
        state.admit(0.0, request)
    state.record_loads(running=1, waiting=0, now=0.0)  # the backend lost track of three
    for request in requests:
        state.leave(0.5, request, finished=False)
    assert state.reported_load(0.5, max_age_s=2.0) == 0


def test_server_info_and_missing_endpoints() -> None:
    state = backend()
    state.record_server_info(24, 1.7)
    assert (state.effective_cap, state.accept_length) == (24, 1.7)
    assert state.record_missing(frozenset({"/v1/loads"})) is True
    assert state.record_missing(frozenset({"/v1/loads"})) is False
    assert state.missing_endpoints == {"/v1/loads"}
    assert state.record_missing(frozenset()) is True


@pytest.mark.parametrize("open_s", [0.5, 30.0])
def test_the_open_period_is_open_s(open_s: float) -> None:
    state = backend(open_s=open_s)
    for _ in range(3):
        state.circuit_failure(100.0)
    assert state.circuit.open_until == 100.0 + open_s
