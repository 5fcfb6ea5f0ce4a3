"""The pool with turns pairs (PairState.turns): only the server holding the memory is admitted
to, whatever the load wants; while none admits the request waits for the turn (reason
memory_turn), or, the holder being up, for its circuit (reason holder_circuit), unless another
pair can take it; a turns pair makes no flip moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from gateway.config import Backend, Role, Routing
from gateway.routing.backend import CircuitRules
from gateway.routing.pool import Ask, Failure, Lease, Outcome, PairSpec, Placement, Pool

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
