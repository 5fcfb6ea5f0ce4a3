"""The pool with turns pairs (PairState.turns): only the server holding the memory is admitted
to, whatever the load wants; while none admits the request waits for the turn (reason
memory_turn), unless another pair can take it; a turns pair makes no flip moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import Backend, Role, Routing
from gateway.routing.pool import Ask, Lease, PairSpec, Pool

ROUTING = Routing(crossover=4, hysteresis=2, min_dwell_s=0, load_signal="requests",
                  adaptive_crossover=False)


@dataclass
class Gate:
    admitting: Role | None
    waiting_for_turn: bool = False

    def describe(self) -> dict[str, Any]:
        return {}


def turns_pool(*gates: Gate) -> Pool:
    specs = [PairSpec(f"p{k}", Backend(url=f"http://mtp{k}"), Backend(url=f"http://plain{k}"),
                      ROUTING) for k in range(len(gates))]
    pool = Pool(specs, now=0.0)
    for gate, pair in zip(gates, pool.pairs.values(), strict=True):
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
