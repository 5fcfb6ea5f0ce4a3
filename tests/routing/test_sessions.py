"""Sessions at work (gateway.routing.sessions): reading them changes nothing; writes forget the idle."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.config import Routing
from gateway.metrics import PoolCollector
from gateway.routing.pool import Ask, Outcome
from gateway.routing.sessions import SessionActivity
from tests.test_load import one_pair


def test_reading_sessions_at_work_forgets_nothing_and_writes_do() -> None:
    sessions = SessionActivity()
    sessions.begin("a", 0.0, 6.0)
    sessions.end("a", 1.0, 6.0)
    sessions.begin("b", 2.0, 6.0)
    sessions.end("b", 5.0, 6.0)
    assert sessions.at_work(8.0, 6.0) == 1  # a idle 7 s: gone; b idle 3 s: at work
    assert sessions.at_work(8.0, 6.0) == 1
    assert list(sessions.idle_since) == ["a", "b"]  # a read forgot nothing
    sessions.begin("c", 8.0, 6.0)  # a write forgets
    assert list(sessions.idle_since) == ["b"] and sessions.at_work(8.0, 6.0) == 2


def test_a_snapshot_and_a_metrics_scrape_leave_the_pool_as_it_was() -> None:
    pool = one_pair(Routing(load_signal="sessions", session_idle_s=6.0))
    pair = pool.pairs["default"]
    for session, ends in (("a", 1.0), ("b", 5.0)):
        lease = pool.admit(Ask(session=session), now=0.0)
        lease.end(Outcome.SUCCESS, ends)
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))
    assert pool.snapshot(pair, 8.0).sessions_at_work == 1  # a idle 7 s: gone; b idle 3 s
    # The scrape reads at the monotonic clock, long after both ended: none at work.
    assert "gateway_sessions_at_work 0.0" in generate_latest(registry).decode()
    assert list(pair.sessions.idle_since) == ["a", "b"]  # neither read forgot them


def test_a_turn_throws_away_the_last_prompt_of_the_sessions_at_work_only() -> None:
    pool = one_pair(Routing(session_idle_s=6.0))
    sessions = pool.pairs["default"].sessions
    gone = pool.admit(Ask(session="gone", prompt_tokens=9000), now=0.0)
    gone.end(Outcome.SUCCESS, 0.0)
    pool.admit(Ask(session="a", prompt_tokens=1000), now=1.0).end(Outcome.SUCCESS, 1.0)
    pool.admit(Ask(session="a", prompt_tokens=2000), now=5.0).end(Outcome.SUCCESS, 5.0)
    pool.admit(Ask(session="a", prompt_tokens=6000), now=9.0)  # in flight, its longer prompt
    pool.admit(Ask(session="b", prompt_tokens=4000), now=9.0).end(Outcome.SUCCESS, 9.0)
    pool.admit(Ask(prompt_tokens=50_000), now=9.0)  # a one-off prompt is never hit again
    # at 10 s "gone" has been idle 10 s: no longer at work
    assert sessions.reusable_context(now=10.0, idle_s=6.0) == 10_000
    assert sessions.reusable_context(now=16.0, idle_s=6.0) == 6_000  # b idle 7 s
    # a session back after more than idle_s counts again once a request of it has ended
    pool.admit(Ask(session="b", prompt_tokens=5000), now=16.0)
    assert sessions.reusable_context(now=16.0, idle_s=6.0) == 6_000
    assert SessionActivity().reusable_context(now=10.0, idle_s=6.0) == 0


def test_a_session_idle_exactly_idle_s_is_still_at_work_and_an_unsized_one_counts_nothing() -> None:
    # the same edge as at_work: idle for exactly session_idle_s, its next turn still extends it
    sessions = SessionActivity()
    sessions.begin("a", 0.0, 6.0, prompt_tokens=3000)
    sessions.end("a", 4.0, 6.0)
    sessions.begin("unsized", 4.0, 6.0)  # a request whose size nobody estimated
    assert sessions.at_work(10.0, 6.0) == 2
    assert sessions.reusable_context(now=10.0, idle_s=6.0) == 3000
    assert sessions.reusable_context(now=10.5, idle_s=6.0) == 0


def test_a_session_whose_first_request_is_still_in_flight_has_no_cached_context_to_lose() -> None:
    """A cold start: 64 new sessions each with a 20k-token prompt in flight and none ended yet.
    A turn now loses no cache (their streams are continued, counted as such), so it is not
    held back to repay one; once a request of a session ends, its context counts."""
    sessions = SessionActivity()
    for k in range(64):
        sessions.begin(f"s{k}", 0.0, 6.0, prompt_tokens=20_000)
    assert sessions.at_work(1.0, 6.0) == 64 and sessions.reusable_context(now=1.0, idle_s=6.0) == 0
    sessions.end("s0", 2.0, 6.0)
    sessions.begin("s0", 3.0, 6.0, prompt_tokens=21_000)
    assert sessions.reusable_context(now=3.0, idle_s=6.0) == 21_000


def test_a_forgotten_session_leaves_no_prompt_behind() -> None:
    sessions = SessionActivity()
    sessions.begin("a", 0.0, 6.0, prompt_tokens=5000)
    sessions.end("a", 0.0, 6.0)
    sessions.begin("b", 7.0, 6.0, prompt_tokens=100)  # a write forgets a, idle 7 s
    assert sessions.last_prompt == {"b": 100} and sessions.served == set()


def test_the_end_of_a_session_never_begun_changes_nothing() -> None:
    sessions = SessionActivity()
    sessions.end("x", 1.0, 6.0)
    sessions.end(None, 1.0, 6.0)
    assert (sessions.requests, sessions.at_work(1.0, 6.0)) == (0, 0)


def test_a_write_forgets_only_sessions_idle_longer_than_idle_s() -> None:
    sessions = SessionActivity()
    sessions.begin("a", 0.0, 6.0)
    sessions.end("a", 0.0, 6.0)
    sessions.begin("b", 6.0, 6.0)  # a idle exactly 6 s: still at work, as a read counts it
    assert sessions.at_work(6.0, 6.0) == 2 and list(sessions.idle_since) == ["a"]


def test_the_session_map_keeps_as_many_as_its_capacity() -> None:
    from gateway.routing.sessions import SessionMap

    one = SessionMap(1)
    one.put("a", "mtp")
    assert one.get("a") == "mtp"
    one.put(None, "plain")  # no key: nothing remembered, nothing forgotten
    assert len(one) == 1 and one.get("a") == "mtp"
    one.put("b", "plain")
    assert (one.get("a"), one.get("b"), len(one)) == (None, "plain", 1)
