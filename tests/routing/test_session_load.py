"""Agentic sessions (issue 12): where a session's next turn goes, and the `sessions` load signal.

Plain values in, decisions out (gateway/relay/inbound.py, gateway/routing/policy.py), and the pool's count
of the sessions at work (gateway/routing/pool.py). Figures: lab/results/bench/routing-sessions.md.
"""

from __future__ import annotations

from gateway.config import Backend, Routing
from gateway.relay.inbound import prompt_tokens_from_bytes
from gateway.routing.policy import BackendView, RequestFacts, Snapshot, decide
from gateway.routing.pool import Ask, Lease, Outcome, PairSpec, Pool


def view(load: int, cap: int | None = 24, healthy: bool = True) -> BackendView:
    return BackendView(healthy=healthy, inflight=load, effective_cap=cap)


def test_the_prompt_is_estimated_at_four_bytes_a_token() -> None:
    assert prompt_tokens_from_bytes(40_000) == 10_000
    assert prompt_tokens_from_bytes(0) == 0


def snap(mode: str, mtp: int, plain: int, at_work: int | None = None,
         session_requests: int | None = None) -> Snapshot:
    return Snapshot(mode, 0.0, {"mtp": view(mtp), "plain": view(plain, cap=28)},  # type: ignore[arg-type]
                    sessions_at_work=at_work,
                    session_requests=mtp + plain if session_requests is None else session_requests)


ABOVE = snap("plain", 20, 20)  # 40 in flight: plain mode, above the crossover
BASE = Routing(crossover=24, hysteresis=6, min_dwell_s=5.0, adaptive_crossover=False,
               adapt_to_accept_length=False, load_signal="requests")


def test_a_session_above_the_crossover_goes_where_the_mode_says() -> None:
    facts = RequestFacts(session_backend="mtp", prompt_tokens=8000)
    decision = decide(ABOVE, facts, BASE, now=10.0)
    assert (decision.backend, decision.reason) == ("plain", "above_crossover")


def test_the_sessions_signal_flips_on_sessions_not_requests() -> None:
    sessions = BASE.model_copy(update={"load_signal": "sessions", "session_crossover": 20})
    burst = snap("mtp", 30, 0, at_work=10)  # 30 requests from 10 sessions' sub-agents
    assert decide(burst, RequestFacts(), BASE, 1.0).mode == "plain"
    assert decide(burst, RequestFacts(), sessions, 1.0).mode == "mtp"
    assert decide(snap("mtp", 10, 0, at_work=19), RequestFacts(), sessions, 1.0).mode == "mtp"
    assert decide(snap("mtp", 10, 0, at_work=20), RequestFacts(), sessions, 1.0).mode == "plain"


def test_the_sessions_band_is_the_hysteresis_in_sessions() -> None:
    # session_crossover 20, hysteresis 6: back to MTP at 14 sessions, whatever the crossover
    sessions = BASE.model_copy(update={"load_signal": "sessions", "session_crossover": 20})
    for routing in (sessions, sessions.model_copy(update={"crossover": 200})):
        assert decide(snap("plain", 0, 10, at_work=15), RequestFacts(), routing, 9.0).mode == "plain"
        assert decide(snap("plain", 0, 10, at_work=14), RequestFacts(), routing, 9.0).mode == "mtp"


def test_requests_without_a_session_count_as_requests() -> None:
    sessions = BASE.model_copy(update={"load_signal": "sessions", "session_crossover": 20})
    chat = snap("mtp", 24, 0, at_work=0, session_requests=0)  # no sessions: as before
    assert decide(chat, RequestFacts(), sessions, 1.0).mode == "plain"
    # 10 sessions (2 requests) and another replica's 10 requests, seen in /v1/loads: 20
    mixed = snap("mtp", 12, 0, at_work=10, session_requests=2)
    assert decide(mixed, RequestFacts(), sessions, 1.0).mode == "plain"
    fewer = snap("mtp", 11, 0, at_work=10, session_requests=2)
    assert decide(fewer, RequestFacts(), sessions.model_copy(update={"crossover": 200}),
                  1.0).mode == "mtp"
    assert decide(mixed, RequestFacts(), sessions.model_copy(update={"crossover": 200}),
                  1.0).mode == "plain"  # whatever the crossover in force


def sessions_pool(idle_s: float = 6.0) -> Pool:
    routing = BASE.model_copy(update={"load_signal": "sessions", "session_idle_s": idle_s})
    return Pool([PairSpec("p", Backend(url="http://m"), Backend(url="http://p"), routing)], now=0.0)


def at_work(pool: Pool, now: float) -> tuple[int | None, int]:
    snapshot = pool.snapshot(pool.pairs["p"], now)
    return snapshot.sessions_at_work, snapshot.session_requests


def admit(pool: Pool, now: float, session: str | None) -> Lease:
    lease = pool.admit(Ask(session=session), now)
    assert isinstance(lease, Lease)
    return lease


def test_the_pool_counts_a_burst_of_one_session_once() -> None:
    pool = sessions_pool()
    leases = [admit(pool, 1.0, "a") for _ in range(3)] + [admit(pool, 1.0, None)]
    assert pool.concurrency == 4
    assert at_work(pool, 1.0) == (1, 3)  # session a, with 3 requests; one without a session
    for lease in leases:
        lease.end(Outcome.SUCCESS, 2.0)
    assert at_work(pool, 2.0) == (1, 0)  # a thinks between two turns: still at work


def test_an_idle_session_stops_counting_after_session_idle_s() -> None:
    pool = sessions_pool(idle_s=6.0)
    admit(pool, 1.0, "a").end(Outcome.SUCCESS, 2.0)
    admit(pool, 3.0, "b").end(Outcome.SUCCESS, 5.0)
    assert at_work(pool, 8.0) == (2, 0)
    assert at_work(pool, 8.5) == (1, 0)  # a ended 6.5 s ago
    admit(pool, 9.0, "a")  # a new turn: at work again
    assert at_work(pool, 20.0) == (1, 1)


def test_idle_sessions_are_forgotten_without_the_sessions_signal() -> None:
    pool = Pool([PairSpec("p", Backend(url="http://m"), Backend(url="http://p"), BASE)], now=0.0)
    for k in range(100):
        admit(pool, float(k * 10), f"s{k}").end(Outcome.SUCCESS, float(k * 10 + 1))
    assert len(pool.pairs["p"].sessions.idle_since) == 1  # memory stays bounded


def test_by_default_sub_agent_bursts_do_not_flip_the_mode() -> None:
    """36 requests in flight from 12 sessions (3 sub-agents each) stay on MTP: 12 sessions at
    work are 17 requests' worth of load against the crossover of 31. A request count would
    flip the pair to plain and move every session's next turn away from its prefix."""
    pool = Pool([PairSpec("p", Backend(url="http://m"), Backend(url="http://p"), Routing())],
                now=0.0)
    leases = [admit(pool, 1.0, f"s{k}") for k in range(12) for _ in range(3)]
    assert {lease.backend.role for lease in leases} == {"mtp"}
    assert pool.pairs["p"].mode == "mtp"
    assert admit(pool, 1.0, None).backend.role == "mtp"  # one request more: still below


def test_the_low_load_rule_counts_sessions_too() -> None:
    """Plain below `plain_below`: four sessions with two requests in flight between bursts are
    not a low load (the request count would send their turns to plain and back to MTP with
    each burst, moving their prefixes each time)."""
    sessions = BASE.model_copy(update={"load_signal": "sessions"})
    quiet = Snapshot("mtp", 0.0, {"mtp": view(2), "plain": view(0, cap=28)},  # type: ignore[arg-type]
                     plain_below=3, sessions_at_work=4, session_requests=2)
    assert decide(quiet, RequestFacts(), sessions, 1.0).backend == "mtp"
    assert decide(quiet, RequestFacts(), BASE, 1.0).backend == "plain"  # the request count
    alone = Snapshot("mtp", 0.0, {"mtp": view(2), "plain": view(0, cap=28)},  # type: ignore[arg-type]
                     plain_below=3, sessions_at_work=2, session_requests=2)
    assert decide(alone, RequestFacts(), sessions, 1.0).backend == "plain"


def test_traffic_of_other_replicas_falls_back_to_the_request_count() -> None:
    """Another replica's requests (in /v1/loads) carry no session this gateway can count: its
    two sessions and 15 unseen requests would read 17 of 20 sessions, while 25 requests in
    flight are past the crossover of 24."""
    sessions = BASE.model_copy(update={"load_signal": "sessions", "session_crossover": 20})
    shared = Snapshot("mtp", 0.0, {  # type: ignore[arg-type]
        "mtp": BackendView(inflight=10, effective_cap=24, reported_load=25),
        "plain": BackendView(inflight=0, effective_cap=28)},
        sessions_at_work=2, session_requests=10)
    assert decide(shared, RequestFacts(), sessions, 1.0).mode == "plain"


def test_the_sessions_the_mode_follows_are_on_metrics() -> None:
    """An operator sees what the `sessions` signal compares: the sessions at work per pair and
    the crossover in sessions (the mode alone would not say why it did not flip)."""
    import time

    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import PoolCollector

    pool = sessions_pool()
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))
    now = time.monotonic()  # the collector reads the sessions at scrape time
    for session in ("a", "a", "b", None):
        admit(pool, now, session)
    text = generate_latest(registry).decode()
    assert "gateway_sessions_at_work 2.0" in text  # a (2 requests) and b; none for no session
    assert "gateway_session_crossover 22.0" in text
