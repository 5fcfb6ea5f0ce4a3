"""The pool with turns pairs (PairState.turns): only the server holding the memory is admitted
to, whatever the load wants; while none admits the request waits for the turn (reason
memory_turn), or, the holder being up, for its circuit (reason holder_circuit), unless another
pair can take it; a turns pair makes no flip moves."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.config import Backend, Role, Routing
from gateway.routing.backend import CircuitRules
from gateway.routing.pool import Ask, Failure, Lease, Outcome, PairSpec, Placement, Pool
from gateway.turns.waiting import WaitingRoom
from tests.live import wait_until

ROUTING = Routing(crossover=4, hysteresis=2, min_dwell_s=0, load_signal="requests",
                  adaptive_crossover=False)


@dataclass
class Gate:
    admitting: Role | None
    waiting_for_turn: bool = False

    def describe(self) -> dict[str, Any]:
        return {}


def turns_pool(*gates: Gate, split: int = 0) -> Pool:
    """A pair per gate (pN), then `split` pairs without one (splitN)."""
    specs = [PairSpec(f"p{k}", Backend(url=f"http://mtp{k}"), Backend(url=f"http://plain{k}"),
                      ROUTING) for k in range(len(gates))]
    specs += [PairSpec(f"split{k}", Backend(url=f"http://smtp{k}"), Backend(url=f"http://splain{k}"),
                       ROUTING) for k in range(split)]
    pool = Pool(specs, now=0.0, circuit=CircuitRules(failures_to_open=2, open_s=10.0))
    for gate, pair in zip(gates, list(pool.pairs.values())[:len(gates)], strict=True):
        pair.turns = gate
        for role, backend in pair.backends.items():
            backend.set_parked(role != gate.admitting)  # as the driver does
    return pool


def test_the_holder_serves_whatever_the_load_wants():
    pool = turns_pool(Gate("mtp"))
    leases = [pool.admit(Ask(), 1.0) for _ in range(6)]  # past the crossover: plain wanted
    assert all(isinstance(lease, Lease) and lease.backend.role == "mtp" for lease in leases)
    assert pool.single is not None and pool.single.mode == "plain"
    assert leases[-1].reason == "memory_holder"  # not a failover: plain is parked, not failed
    assert all(lease.flip is None for lease in leases)  # no flip moves in a turns pair: a turn moves them


def test_while_no_server_admits_the_request_waits_for_the_turn():
    pool = turns_pool(Gate(None, waiting_for_turn=True))
    placed = pool.admit(Ask(), 1.0)
    assert not isinstance(placed, Lease) and placed.decision.reason == "memory_turn"


def test_a_stuck_pair_refuses_with_no_backend():
    pool = turns_pool(Gate(None, waiting_for_turn=False))
    placed = pool.admit(Ask(), 1.0)
    assert not isinstance(placed, Lease) and placed.decision.reason == "no_backend"


def test_another_pair_takes_the_requests_of_a_pair_in_a_turn():
    pool = turns_pool(Gate(None, waiting_for_turn=True), Gate("plain"))
    lease = pool.admit(Ask(), 1.0)
    assert isinstance(lease, Lease) and lease.backend.name == "p1/plain"


# --- the holder's circuit ---------------------------------------------------------------------


def open_circuit(pool: Pool, name: str, now: float) -> None:
    backend = pool.backends[name]
    while not backend.circuit_failure(now):
        pass


def nowhere(pool: Pool, now: float) -> Placement:
    placed = pool.admit(Ask(), now)
    assert not isinstance(placed, Lease), placed.backend.name
    return placed


def test_while_the_holders_circuit_is_open_the_request_waits_for_it_until_its_trial_may_go():
    pool = turns_pool(Gate("mtp"))
    open_circuit(pool, "mtp", 1.0)  # open until 11.0
    placed = nowhere(pool, 4.0)
    assert placed.decision.reason == "holder_circuit"
    assert placed.look_again_s == pytest.approx(7.0)  # nothing else will say when
    trial = pool.admit(Ask(), 11.0)  # half-open: the first request is the trial
    assert isinstance(trial, Lease) and trial.attempts[0].trial
    behind = nowhere(pool, 11.5)  # the others wait for its end: it says when
    assert behind.decision.reason == "holder_circuit" and behind.look_again_s is None
    trial.end(Outcome.SUCCESS, 12.0)
    assert trial.circuit_changed
    assert isinstance(pool.admit(Ask(), 12.0), Lease)


def test_a_trial_that_fails_opens_the_circuit_again_and_says_so():
    pool = turns_pool(Gate("plain"))
    open_circuit(pool, "plain", 1.0)
    trial = pool.admit(Ask(), 11.0)
    assert isinstance(trial, Lease)
    trial.end(Outcome.BACKEND_FAILURE, 12.0, Failure("connect"))
    assert trial.circuit_changed
    assert nowhere(pool, 12.0).look_again_s == pytest.approx(10.0)


def test_a_trial_whose_client_left_lets_the_next_request_be_the_trial():
    pool = turns_pool(Gate("mtp"))
    open_circuit(pool, "mtp", 1.0)
    trial = pool.admit(Ask(), 11.0)
    assert isinstance(trial, Lease)
    trial.end(Outcome.CLIENT_GONE, 11.5)
    assert trial.circuit_changed
    after = pool.admit(Ask(), 11.5)
    assert isinstance(after, Lease) and after.attempts[0].trial


def test_a_request_admitted_before_the_circuit_opened_closes_it_by_its_success():
    pool = turns_pool(Gate("mtp"))
    earlier = pool.admit(Ask(), 0.5)
    assert isinstance(earlier, Lease)
    open_circuit(pool, "mtp", 1.0)
    earlier.end(Outcome.SUCCESS, 2.0)
    assert earlier.circuit_changed  # the arrivals waiting on the circuit may go now
    assert isinstance(pool.admit(Ask(), 2.0), Lease)


def test_an_ordinary_end_changes_no_circuit():
    pool = turns_pool(Gate("mtp"))
    lease = pool.admit(Ask(), 1.0)
    assert isinstance(lease, Lease)
    lease.end(Outcome.SUCCESS, 2.0)
    assert not lease.circuit_changed


def test_a_holder_that_is_down_is_lost_not_waited_for():
    pool = turns_pool(Gate("mtp"))
    open_circuit(pool, "mtp", 1.0)
    for _ in range(3):
        pool.backends["mtp"].probe_failed()
    assert nowhere(pool, 2.0).decision.reason == "no_backend"  # the driver settles the pair


def test_a_split_pair_with_every_circuit_open_refuses_as_before():
    pool = turns_pool(split=1)
    for name in ("mtp", "plain"):
        open_circuit(pool, name, 1.0)  # one pair: its servers' own names
    placed = nowhere(pool, 2.0)
    assert placed.decision.reason == "no_backend" and placed.look_again_s is None


def test_another_pair_takes_the_requests_of_a_pair_whose_holder_has_its_circuit_open():
    pool = turns_pool(Gate("mtp"), split=1)
    open_circuit(pool, "p0/mtp", 1.0)
    lease = pool.admit(Ask(), 2.0)
    assert isinstance(lease, Lease) and lease.backend.pair == "split0"


def test_a_turn_under_way_elsewhere_is_waited_for_with_the_earliest_circuit_looked_at():
    pool = turns_pool(Gate(None, waiting_for_turn=True), Gate("plain"))
    open_circuit(pool, "p1/plain", 1.0)
    placed = nowhere(pool, 3.0)
    assert placed.decision.reason == "memory_turn" and placed.look_again_s == pytest.approx(8.0)


# --- the slow start after the holder's circuit closes -----------------------------------------


def closed_by_an_earlier_success(pool: Pool, name: str) -> None:
    """A request admitted before the circuit opened ends well after: that closes the circuit
    (any success does), while a fault that breaks streams only may still hold."""
    earlier = pool.admit(Ask(), 0.5)
    assert isinstance(earlier, Lease) and earlier.backend.name == name
    open_circuit(pool, name, 1.0)
    earlier.end(Outcome.SUCCESS, 2.0)
    assert earlier.circuit_changed and pool.backends[name].circuit.open_until is None


def admitted(pool: Pool, now: float) -> list[Lease]:
    """Admit until the pool says wait; the leases admitted."""
    leases = []
    while isinstance(lease := pool.admit(Ask(), now), Lease):
        leases.append(lease)
        assert len(leases) <= 200, "nothing held the requests back"
    assert lease.decision.reason == "holder_circuit" and lease.look_again_s is None  # an end says
    return leases


def test_after_the_holders_circuit_closes_one_request_goes_then_twice_as_many_per_success():
    pool = turns_pool(Gate("mtp"))
    closed_by_an_earlier_success(pool, "mtp")
    first = admitted(pool, 2.0)
    assert len(first) == 1  # not every waiter at once into a fault that may still hold
    first[0].end(Outcome.SUCCESS, 3.0)
    assert first[0].circuit_changed  # a place is free: the waiting room looks again
    second = admitted(pool, 3.0)
    assert len(second) == 2
    second[0].end(Outcome.SUCCESS, 4.0)  # 4 now, one of them in flight
    assert len(admitted(pool, 4.0)) == 3


def test_a_failure_in_the_slow_start_puts_it_back_to_one_request_at_a_time():
    pool = turns_pool(Gate("mtp"))
    closed_by_an_earlier_success(pool, "mtp")
    admitted(pool, 2.0)[0].end(Outcome.SUCCESS, 3.0)
    failing, other = admitted(pool, 3.0)
    failing.end(Outcome.BACKEND_FAILURE, 4.0, Failure("stream_broken", answered=False))
    assert failing.circuit_changed and pool.backends["mtp"].circuit.open_until is None  # 1 of 5
    assert admitted(pool, 4.0) == []  # back to 1, and `other` is still in flight
    other.end(Outcome.SUCCESS, 5.0)
    assert len(admitted(pool, 5.0)) == 2


def test_a_request_whose_client_left_in_the_slow_start_frees_its_place_only():
    pool = turns_pool(Gate("mtp"))
    closed_by_an_earlier_success(pool, "mtp")
    (gone,) = admitted(pool, 2.0)
    gone.end(Outcome.CLIENT_GONE, 3.0)
    assert gone.circuit_changed and len(admitted(pool, 3.0)) == 1  # not doubled


def test_the_slow_start_ends_after_successes_and_the_holder_admits_freely():
    pool = turns_pool(Gate("mtp"))
    closed_by_an_earlier_success(pool, "mtp")
    rounds = []
    for now in (2.0, 3.0, 4.0):
        leases = admitted(pool, now)
        rounds.append(len(leases))
        for lease in leases:
            lease.end(Outcome.SUCCESS, now)
    assert rounds == [1, 2, 8]  # each success doubles the window: 1; 2; 4, 8; then 16 ... 2048
    assert pool.backends["mtp"].slow_start is None  # past 64: over
    for _ in range(100):
        assert isinstance(pool.admit(Ask(), 5.0), Lease)


def test_the_trials_success_also_starts_slow():
    pool = turns_pool(Gate("mtp"))
    open_circuit(pool, "mtp", 1.0)
    trial = pool.admit(Ask(), 11.0)
    assert isinstance(trial, Lease) and trial.attempts[0].trial
    trial.end(Outcome.SUCCESS, 12.0)
    assert len(admitted(pool, 12.0)) == 1


def test_the_circuit_opening_again_ends_the_slow_start_its_trial_goes_first():
    pool = turns_pool(Gate("mtp"))
    closed_by_an_earlier_success(pool, "mtp")
    (ramped,) = admitted(pool, 2.0)
    open_circuit(pool, "mtp", 3.0)  # other failures meanwhile: open until 13.0
    assert pool.backends["mtp"].slow_start is None
    ramped.end(Outcome.SUCCESS, 4.0)  # closes it (any success does): a new slow start
    assert len(admitted(pool, 4.0)) == 1


@pytest.mark.timeout(10)
async def test_the_waiters_go_one_at_a_time_after_the_close_each_freed_place_letting_more_go():
    pool = turns_pool(Gate("mtp"))
    room = WaitingRoom(max_requests=8, max_s=5.0, retry_after_s=1, circuit_max_s=5.0)
    earlier = pool.admit(Ask(), 0.5)
    assert isinstance(earlier, Lease)
    open_circuit(pool, "mtp", 1.0)
    waiters = [asyncio.create_task(room.admit(lambda: pool.admit(Ask(), 2.0))) for _ in range(3)]
    await wait_until(lambda: room.waiting == 3, timeout=5)

    def changed(lease: Lease) -> None:  # as the endpoint does at a lease's end
        assert lease.circuit_changed
        room.changed()

    earlier.end(Outcome.SUCCESS, 2.0)
    changed(earlier)  # the circuit closed: one goes, two wait on
    await wait_until(lambda: room.waiting == 2 and sum(w.done() for w in waiters) == 1, timeout=5)
    (first,) = [w.result() for w in waiters if w.done()]
    assert isinstance(first, Lease)
    first.end(Outcome.SUCCESS, 3.0)
    changed(first)  # its success: two may be in flight
    leases = await asyncio.gather(*waiters)
    assert all(isinstance(lease, Lease) for lease in leases) and room.waiting == 0


def test_a_split_pairs_circuit_closing_lets_every_request_go_as_before():
    pool = turns_pool(split=1)
    mtp = pool.backends["mtp"]
    earlier = pool.admit(Ask(), 0.5)
    assert isinstance(earlier, Lease) and earlier.backend is mtp
    open_circuit(pool, "mtp", 1.0)
    earlier.end(Outcome.SUCCESS, 2.0)
    assert mtp.circuit.open_until is None and mtp.slow_start is None
    for _ in range(10):
        mtp.admit(2.0, object())
    assert mtp.accepting(2.0)
