"""In-flight leases: counted at admission, released exactly once, moved on retry."""

from __future__ import annotations

from gateway.config import Backend, Routing
from gateway.routing.pool import Ask, Lease, Outcome, PairSpec, Pool, SessionMap


def one_pair(routing: Routing | None = None, **kwargs) -> Pool:
    spec = PairSpec("default", Backend(url="http://mtp"), Backend(url="http://plain"),
                    routing or Routing())
    return Pool([spec], now=0.0, **kwargs)


def inflight(pool: Pool) -> dict[str, int]:
    return {name: b.inflight for name, b in pool.backends.items()}


def not_started(pool: Pool) -> dict[str, int]:
    return {name: b.not_started for name, b in pool.backends.items()}


def test_admission_counts_and_release_is_idempotent() -> None:
    pool = one_pair()
    leases = [pool.admit(Ask(), now=1.0) for _ in range(3)]
    assert all(isinstance(lease, Lease) for lease in leases)
    assert inflight(pool) == {"mtp": 3, "plain": 0}
    for lease in leases:
        lease.end(Outcome.SUCCESS, 2.0)
        lease.end(Outcome.SUCCESS, 2.0)
    assert inflight(pool) == {"mtp": 0, "plain": 0}
    assert {name: b.served for name, b in pool.backends.items()} == {"mtp": 3, "plain": 0}


def test_concurrent_admissions_see_each_other_and_flip_the_mode() -> None:
    pool = one_pair(Routing(crossover=4, hysteresis=1, min_dwell_s=0))
    backends = [pool.admit(Ask(), now=1.0).backend.name for _ in range(6)]
    assert backends == ["mtp"] * 4 + ["plain"] * 2
    assert pool.pairs["default"].mode == "plain"


def test_move_to_keeps_the_total() -> None:
    pool = one_pair()
    lease = pool.admit(Ask(), now=1.0)
    lease.move_to(pool.backends["plain"], 1.0)
    assert inflight(pool) == {"mtp": 0, "plain": 1}
    lease.end(Outcome.SUCCESS, 2.0)
    assert inflight(pool) == {"mtp": 0, "plain": 0}


def test_no_backend_admits_nothing() -> None:
    pool = one_pair()
    for backend in pool.backends.values():
        for _ in range(3):
            backend.probe_failed()
    placement = pool.admit(Ask(), now=1.0)
    assert not isinstance(placement, Lease) and placement.decision.reason == "no_backend"
    assert pool.concurrency == 0


def test_stale_backend_loads_are_ignored() -> None:
    pool = one_pair(use_backend_loads=True, loads_max_age_s=3.0)
    pool.backends["mtp"].record_loads(30, 0, now=100.0)
    pair = pool.pairs["default"]
    assert pool.snapshot(pair, now=101.0).concurrency == 30
    assert pool.snapshot(pair, now=104.5).concurrency == 0


def test_sessions_forget_the_least_recently_used() -> None:
    sessions = SessionMap(capacity=2)
    sessions.put("a", "mtp")
    sessions.put("b", "plain")
    assert sessions.get("a") == "mtp"  # a is now the most recent
    sessions.put("c", "plain")
    assert (sessions.get("a"), sessions.get("b"), sessions.get("c")) == ("mtp", None, "plain")


def test_unstarted_requests_are_counted_until_their_first_byte() -> None:
    pool = one_pair()
    first, second = pool.admit(Ask(), now=1.0), pool.admit(Ask(), now=1.0)
    assert pool.snapshot(pool.pairs["default"], 1.0).backends["mtp"].not_started == 2
    first.first_byte(1.0)
    first.first_byte(1.0)
    assert pool.snapshot(pool.pairs["default"], 1.0).backends["mtp"].not_started == 1
    second.move_to(pool.backends["plain"], 1.0)
    assert not_started(pool) == {"mtp": 0, "plain": 1}
    first.end(Outcome.SUCCESS, 2.0)
    second.end(Outcome.SUCCESS, 2.0)
    assert not_started(pool) == {"mtp": 0, "plain": 0} and pool.concurrency == 0


def test_the_flip_to_plain_hands_out_the_burst_once() -> None:
    pool = one_pair(Routing(crossover=4, hysteresis=1, min_dwell_s=0))
    leases = [pool.admit(Ask(), now=1.0) for _ in range(4)]
    leases[0].first_byte(1.0)
    flipping = pool.admit(Ask(), now=1.0)
    assert [lease.flip for lease in leases] == [None] * 4  # the fifth flipped the pair
    moves = flipping.flip.moves
    assert (moves.not_started, moves.running) == (3, 0)  # the 4 on mtp, less the started one
    assert pool.admit(Ask(), now=1.0).flip is None
