"""In-flight leases: counted at admission, released exactly once, moved on retry."""

from __future__ import annotations

from gateway.config import Routing
from gateway.load import Lease, Router, SessionMap
from gateway.policy import RequestFacts


def test_admission_counts_and_release_is_idempotent() -> None:
    router = Router(Routing())
    leases = [router.admit(RequestFacts(), now=1.0) for _ in range(3)]
    assert all(isinstance(lease, Lease) for lease in leases)
    assert router.inflight == {"mtp": 3, "plain": 0}
    for lease in leases:
        lease.release()
        lease.release()
    assert router.inflight == {"mtp": 0, "plain": 0}
    assert router.served == {"mtp": 3, "plain": 0}


def test_concurrent_admissions_see_each_other_and_flip_the_mode() -> None:
    router = Router(Routing(crossover=4, hysteresis=1, min_dwell_s=0))
    backends = [router.admit(RequestFacts(), now=1.0).backend for _ in range(6)]
    assert backends == ["mtp"] * 4 + ["plain"] * 2
    assert router.mode == "plain"


def test_move_to_keeps_the_total() -> None:
    router = Router(Routing())
    lease = router.admit(RequestFacts(), now=1.0)
    lease.move_to("plain")
    assert router.inflight == {"mtp": 0, "plain": 1}
    lease.release()
    assert router.inflight == {"mtp": 0, "plain": 0}


def test_no_backend_admits_nothing() -> None:
    router = Router(Routing())
    for health in router.health.values():
        health.up = False
    decision = router.admit(RequestFacts(), now=1.0)
    assert not isinstance(decision, Lease) and decision.reason == "no_backend"
    assert router.concurrency == 0


def test_stale_backend_loads_are_ignored() -> None:
    router = Router(Routing(), use_backend_loads=True, loads_max_age_s=3.0)
    router.health["mtp"].reported_running, router.health["mtp"].reported_at = 30, 100.0
    assert router.snapshot(now=101.0).concurrency == 30
    assert router.snapshot(now=104.5).concurrency == 0


def test_sessions_forget_the_least_recently_used() -> None:
    sessions = SessionMap(capacity=2)
    sessions.put("a", "mtp")
    sessions.put("b", "plain")
    assert sessions.get("a") == "mtp"  # a is now the most recent
    sessions.put("c", "plain")
    assert (sessions.get("a"), sessions.get("b"), sessions.get("c")) == ("mtp", None, "plain")


def test_unstarted_requests_are_counted_until_their_first_byte() -> None:
    router = Router(Routing())
    first, second = router.admit(RequestFacts(), now=1.0), router.admit(RequestFacts(), now=1.0)
    assert router.snapshot(1.0).backends["mtp"].not_started == 2
    first.mark_started()
    first.mark_started()
    assert router.snapshot(1.0).backends["mtp"].not_started == 1
    second.move_to("plain")
    assert router.not_started == {"mtp": 0, "plain": 1}
    first.release()
    second.release()
    assert router.not_started == {"mtp": 0, "plain": 0} and router.concurrency == 0


def test_the_flip_to_plain_hands_out_the_burst_once() -> None:
    router = Router(Routing(crossover=4, hysteresis=1, min_dwell_s=0))
    leases = [router.admit(RequestFacts(), now=1.0) for _ in range(5)]
    leases[0].mark_started()
    moves = router.take_moves(now=1.0)
    assert (moves.not_started, moves.running) == (3, 0)  # the 4 on mtp, less the started one
    assert not router.take_moves(now=1.0)
