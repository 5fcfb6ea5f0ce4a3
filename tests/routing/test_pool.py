"""The pool: one owner per backend's state, pairs, the replica load view, and the lease's end.

Pure state driven with explicit times: no sockets, no sleeps."""

from __future__ import annotations

import pytest

from gateway.config import Backend, Routing
from gateway.routing.backend import BackendState, CircuitRules
from gateway.routing.pairs import PairChoice, PairView, choose_pair
from gateway.routing.pool import Ask, Failure, Lease, Outcome, PairSpec, Pool, blame

ROUTING = Routing(crossover=24, hysteresis=6, min_dwell_s=5.0, load_signal="requests")
FIVE_XX = Failure("status_5xx", answered=True)
CONNECT = Failure("connect")


def pool(pairs: int = 1, *, failures_to_open: int = 3, open_s: float = 10.0,
         routing: Routing = ROUTING, **kwargs) -> Pool:
    specs = [PairSpec(f"p{k}", Backend(url=f"http://mtp{k}"), Backend(url=f"http://plain{k}"),
                      routing) for k in range(pairs)]
    return Pool(specs, now=0.0, circuit=CircuitRules(failures_to_open, open_s), **kwargs)


def admit(p: Pool, now: float = 1.0, **ask) -> Lease:
    lease = p.admit(Ask(**ask), now)
    assert isinstance(lease, Lease), lease
    return lease


def total_inflight(p: Pool) -> int:
    return sum(b.inflight + b.not_started for b in p.backends.values())


# --- names -----------------------------------------------------------------------------------


def test_one_pair_keeps_todays_backend_names():
    assert list(pool().backends) == ["mtp", "plain"]
    assert list(pool(2).backends) == ["p0/mtp", "p0/plain", "p1/mtp", "p1/plain"]


# --- the circuit, decided at the lease's end -----------------------------------------------------


def fail(p: Pool, now: float, failure: Failure = CONNECT, *, after_first_byte: bool = False):
    lease = admit(p, now)
    if after_first_byte:
        lease.first_byte(1.0)
    return lease.end(Outcome.BACKEND_FAILURE, now, failure)


def test_streams_that_die_after_their_first_byte_open_the_circuit():
    p = pool(failures_to_open=3)
    for _ in range(3):
        fail(p, 1.0, Failure("broken"), after_first_byte=True)
    assert not p.backends["mtp"].accepting(1.0)
    assert admit(p, 1.0).backend.name == "plain"  # taken out: the next request fails over


def test_a_first_byte_is_not_a_success():
    """Before, the first byte reset the failure count, so such a server never opened."""
    p = pool(failures_to_open=2)
    fail(p, 1.0, Failure("broken"), after_first_byte=True)
    lease = admit(p, 1.0)
    lease.first_byte(1.0)  # a good start ...
    lease.end(Outcome.BACKEND_FAILURE, 1.0, Failure("broken"))  # ... broken all the same
    assert p.backends["mtp"].circuit.is_open(1.0)


@pytest.mark.parametrize("outcome", [Outcome.GATEWAY_ERROR, Outcome.CLIENT_GONE])
def test_the_gateways_own_error_and_a_client_leaving_judge_no_backend(outcome):
    p = pool(failures_to_open=2)
    fail(p, 1.0)
    for _ in range(5):
        lease = admit(p, 1.0)
        lease.first_byte(1.0)
        assert lease.end(outcome, 1.0) == []
    mtp = p.backends["mtp"]
    assert mtp.circuit.failures == 1 and mtp.accepting(1.0)


def test_success_resets_the_count_of_failures_in_a_row():
    p = pool(failures_to_open=2)
    fail(p, 1.0)
    admit(p, 1.0).end(Outcome.SUCCESS, 1.0)
    fail(p, 1.0)
    assert p.backends["mtp"].accepting(1.0)


def test_half_open_lets_exactly_one_trial_and_its_success_closes():
    p = pool(failures_to_open=1, open_s=10.0)
    fail(p, 1.0)
    mtp = p.backends["mtp"]
    assert not mtp.accepting(10.9)
    trial = admit(p, 11.0)
    assert trial.backend is mtp and trial.attempts[0].trial
    assert admit(p, 11.0).backend.name == "plain"  # the others keep away while it runs
    trial.end(Outcome.SUCCESS, 12.0)
    assert mtp.accepting(12.0) and admit(p, 12.0).backend is mtp


def test_a_failed_trial_opens_the_circuit_again():
    p = pool(failures_to_open=1, open_s=10.0)
    fail(p, 1.0)
    fail(p, 11.0)
    assert not p.backends["mtp"].accepting(20.9)
    assert p.backends["mtp"].accepting(21.0)


def test_a_trial_the_client_abandons_frees_the_next():
    p = pool(failures_to_open=1, open_s=10.0)
    fail(p, 1.0)
    admit(p, 11.0).end(Outcome.CLIENT_GONE, 11.5)
    assert admit(p, 12.0).backend.name == "mtp"


# --- retries and blame ---------------------------------------------------------------------------


def test_blame_excuses_a_5xx_only_when_another_server_gave_one_too():
    assert blame([FIVE_XX, FIVE_XX]) == [False, False]
    assert blame([FIVE_XX]) == [True]
    assert blame([CONNECT, FIVE_XX]) == [True, True]
    assert blame([FIVE_XX, CONNECT]) == [True, True]


def test_a_retry_decides_again_without_the_failed_server():
    p = pool()
    lease = admit(p)
    assert lease.backend.name == "mtp"
    moved = lease.retry_elsewhere(CONNECT, 1.0)
    assert moved.backend is p.backends["plain"] and lease.reason == "failover"
    assert (p.backends["mtp"].inflight, p.backends["plain"].inflight) == (0, 1)
    verdicts = lease.end(Outcome.SUCCESS, 1.0)
    assert [(v.backend.name, v.blamed) for v in verdicts] == [("mtp", True)]
    assert p.backends["plain"].circuit.failures == 0 and total_inflight(p) == 0


def test_a_5xx_from_both_servers_counts_against_neither():
    p = pool(failures_to_open=1)
    lease = admit(p)
    lease.retry_elsewhere(FIVE_XX, 1.0)
    verdicts = lease.end(Outcome.BACKEND_FAILURE, 1.0, FIVE_XX)
    assert [v.blamed for v in verdicts] == [False, False]
    assert all(b.accepting(1.0) for b in p.backends.values())


def test_no_retry_when_every_other_server_is_out():
    p = pool()
    p.backends["plain"].up = False
    lease = admit(p)
    assert lease.retry_elsewhere(CONNECT, 1.0) is None
    assert lease.backend.name == "mtp" and len(lease.attempts) == 1


def test_no_retry_after_the_first_byte():
    lease = admit(pool())
    lease.first_byte(1.0)
    assert lease.retry_elsewhere(CONNECT, 1.0) is None


def test_a_failed_trial_stays_held_until_its_retry_ends():
    """The trial's verdict waits for the retry (a 5xx may be excused): meanwhile no second
    trial may go to the server that just failed it."""
    p = pool(failures_to_open=1, open_s=10.0)
    fail(p, 1.0)
    lease = admit(p, 11.0)
    lease.retry_elsewhere(FIVE_XX, 11.0)
    assert admit(p, 11.0).backend.name == "plain"
    lease.end(Outcome.SUCCESS, 11.5)  # the 5xx stands alone: blamed, the circuit opens again
    assert not p.backends["mtp"].accepting(11.5)


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_end_returns_the_count_to_zero_once(outcome):
    p = pool(2)
    leases = [admit(p, 1.0) for _ in range(40)]
    for i, lease in enumerate(leases):
        if i % 3 == 0:
            lease.first_byte(1.0)
        if i % 4 == 0:
            lease.retry_elsewhere(CONNECT, 1.0)
        lease.end(outcome, 2.0, CONNECT)
        lease.end(outcome, 2.0, CONNECT)  # a second end changes nothing
    assert total_inflight(p) == 0
    assert sum(b.served for b in p.backends.values()) == 40


# --- pairs -----------------------------------------------------------------------------------------


def test_choose_pair_takes_the_least_loaded_usable_pair():
    views = [PairView("a", 10, True), PairView("b", 3, True), PairView("c", 0, False)]
    assert choose_pair(views, None, 8).pair == "b"
    assert choose_pair([PairView("a", 0, False)], None, 8).reason == "no_pair"


def test_a_session_stays_on_its_pair_within_the_slack():
    views = [PairView("a", 10, True), PairView("b", 3, True)]
    assert choose_pair(views, "a", 8) == PairChoice("a", "session_affinity")
    assert choose_pair(views, "a", 5) == PairChoice("b", "least_loaded")  # the queue costs more
    assert choose_pair([PairView("a", 0, False), PairView("b", 9, True)], "a", 8).pair == "b"


def test_new_requests_spread_over_pairs():
    p = pool(2)
    placed = [admit(p).backend.pair for _ in range(10)]
    assert placed.count("p0") == placed.count("p1") == 5


def test_a_session_follows_its_prefix_to_its_pair():
    p = pool(2)
    first = admit(p, session="s1")
    first.end(Outcome.SUCCESS, 1.0)
    for _ in range(3):  # p0 and p1 are now 2 and 1: s1's pair is not the least loaded
        admit(p)
    again = admit(p, session="s1")
    assert again.backend is first.backend
    assert again.placement.pair_choice.reason == "session_affinity"


def test_each_pair_changes_mode_on_its_own_load():
    p = pool(2, affinity_slack=100)
    p.sessions.put("busy", "p0/mtp")
    for _ in range(ROUTING.crossover + 1):  # one session's requests pile onto p0
        admit(p, session="busy")
    assert (p.pairs["p0"].mode, p.pairs["p1"].mode) == ("plain", "mtp")
    assert admit(p).backend.name == "p1/mtp"


# --- the replica load view -----------------------------------------------------------------------


def test_the_reported_load_counts_other_replicas_and_our_requests_since_the_reading():
    mtp = BackendState("mtp", "p", "mtp", Backend(url="http://x"))
    mtp.inflight = 4
    mtp.record_loads(running=10, waiting=2, now=100.0)  # ours 4, someone else's 8
    assert mtp.reported_load(100.0, 3.0) == 12
    mtp.inflight = 7  # 3 started here since
    assert mtp.reported_load(101.0, 3.0) == 15
    mtp.inflight = 2  # 5 of ours ended since
    assert mtp.reported_load(102.0, 3.0) == 10
    assert mtp.reported_load(103.5, 3.0) is None  # too old: fail open, own counts only


def test_replicas_see_each_others_load_and_switch_on_it():
    """Two pools in front of one pair: each sees the other's requests through /v1/loads."""
    a, b = pool(use_backend_loads=True), pool(use_backend_loads=True)
    for _ in range(ROUTING.crossover - 3):
        admit(a)
    for backend in b.backends.values():  # b reads what the servers have: a's requests
        backend.record_loads(a.backends[backend.name].inflight, 0, now=1.0)
    assert [admit(b, 1.2).backend.name for _ in range(4)] == ["mtp"] * 3 + ["plain"]
    assert b.pairs["p0"].mode == "plain"
    assert [admit(a, 1.3).backend.name for _ in range(3)] == ["mtp"] * 3  # a alone sees 21..23


# --- the edges of placing and counting ---------------------------------------------------------

SESSIONS = Routing(crossover=24, hysteresis=6, load_signal="sessions", session_idle_s=6.0)


def sessions_at_work(p: Pool, now: float) -> tuple[int | None, int]:
    snapshot = p.snapshot(p.pairs["p0"], now)
    return snapshot.sessions_at_work, snapshot.session_requests


def test_a_session_back_within_session_idle_s_counts_once():
    p = pool(routing=SESSIONS)
    admit(p, 1.0, session="a").end(Outcome.SUCCESS, 2.0)
    lease = admit(p, 3.0, session="a")  # its next turn, 1 s later
    assert sessions_at_work(p, 3.0) == (1, 1)
    lease.end(Outcome.SUCCESS, 4.0)
    assert sessions_at_work(p, 10.0) == (1, 0)  # idle exactly session_idle_s: still at work
    assert sessions_at_work(p, 10.01) == (0, 0)


def test_a_session_with_two_requests_in_flight_is_idle_only_after_both():
    p = pool(routing=SESSIONS)
    first, second = admit(p, 1.0, session="a"), admit(p, 1.0, session="a")
    first.end(Outcome.SUCCESS, 2.0)
    assert sessions_at_work(p, 20.0) == (1, 1)  # still in flight: never idle
    second.end(Outcome.SUCCESS, 21.0)
    assert sessions_at_work(p, 27.0) == (1, 0) and sessions_at_work(p, 27.5) == (0, 0)


def test_requests_without_a_session_are_not_sessions():
    p = pool(routing=SESSIONS)
    lease = admit(p, 1.0)
    assert sessions_at_work(p, 1.0) == (0, 0)
    lease.end(Outcome.SUCCESS, 2.0)
    assert sessions_at_work(p, 2.0) == (0, 0)


def test_sessions_are_not_counted_under_the_requests_signal():
    p = pool()  # load_signal: requests
    admit(p, 1.0, session="a")
    assert sessions_at_work(p, 1.0) == (None, 1)


def test_place_honours_a_client_pin():
    p = pool()
    lease = admit(p, 1.0, pin="plain")
    assert (lease.backend.name, lease.reason) == ("plain", "pinned")
    placement = p.place(Ask(pin="plain"), 1.0)
    assert placement.backend is p.backends["plain"] and placement.decision.reason == "pinned"


def test_a_holder_serves_what_it_stores_while_it_accepts():
    p = pool(failures_to_open=1)
    assert admit(p, 1.0, holder="plain").backend.name == "plain"
    assert p.place(Ask(holder="plain"), 1.0, exclude=["plain"]).backend is p.backends["mtp"]
    p.backends["plain"].up = False
    assert p.place(Ask(holder="plain"), 1.0).backend is p.backends["mtp"]
    assert p.place(Ask(holder="nowhere"), 1.0).backend is p.backends["mtp"]


def test_a_session_is_remembered_where_its_request_ended():
    p = pool()
    lease = admit(p, 1.0, session="a")
    lease.retry_elsewhere(CONNECT, 1.0)
    lease.end(Outcome.SUCCESS, 2.0)
    assert p.sessions.get("a") == "plain"
    assert p.sessions.get(None) is None and p.sessions.get("b") is None


def test_session_memory_forgets_the_least_recently_used():
    p = pool(max_sessions=2)
    for name in ("a", "b"):
        admit(p, 1.0, session=name).end(Outcome.SUCCESS, 1.0)
    p.sessions.get("a")  # a used again: b is the oldest
    admit(p, 1.0, session="c").end(Outcome.SUCCESS, 1.0)
    assert (p.sessions.get("a"), p.sessions.get("b"), p.sessions.get("c")) == ("mtp", None, "mtp")
    assert len(p.sessions) == 2
    none = pool(max_sessions=0)
    admit(none, 1.0, session="a").end(Outcome.SUCCESS, 1.0)
    assert len(none.sessions) == 0


def test_no_backend_leaves_the_mode_as_it_was():
    p = pool(2)
    for backend in p.backends.values():
        backend.up = False
    placement = p.admit(Ask(), 5.0)
    assert not isinstance(placement, Lease) and placement.backend is None
    assert (placement.decision.reason, placement.decision.mode) == ("no_backend", "mtp")
    assert placement.pair_choice.pair is None and total_inflight(p) == 0


def test_an_excluded_or_refusing_server_is_unhealthy_in_the_view():
    p = pool()
    mtp = p.backends["mtp"]
    assert p.view(mtp, 1.0).healthy and not p.view(mtp, 1.0, exclude=["mtp"]).healthy
    mtp.record_loads(running=9, waiting=0, now=1.0)
    assert p.view(mtp, 1.0).reported_load is None  # use_backend_loads is off
    with_loads = pool(use_backend_loads=True, loads_max_age_s=2.0)
    own = with_loads.backends["mtp"]
    own.record_loads(running=9, waiting=1, now=1.0)
    assert with_loads.view(own, 3.0).reported_load == 10
    assert with_loads.view(own, 3.5).reported_load is None


def test_a_pool_needs_pairs_with_distinct_names():
    spec = PairSpec("a", Backend(url="http://m"), Backend(url="http://p"), ROUTING)
    for pairs in ([], [spec, spec]):
        with pytest.raises(ValueError, match="distinct names"):
            Pool(pairs, now=0.0)


def test_a_new_routing_section_reaches_every_pair_and_the_session_memory():
    from gateway.config import build_settings

    p = pool(2)
    settings = build_settings({"pairs": [
        {"name": f"p{k}", "mtp": {"url": f"http://mtp{k}"}, "plain": {"url": f"http://plain{k}"},
         "routing": {"crossover": 40 + k}} for k in range(2)],
        "routing": {"max_sessions": 5, "pair_affinity_slack": 3}})
    p.apply_routing(settings)
    assert [pair.routing.crossover for pair in p.pairs.values()] == [40, 41]
    assert (p.sessions.capacity, p.affinity_slack) == (5, 3)


def test_the_pool_is_built_from_the_settings_it_is_given():
    from gateway.config import build_settings
    from gateway.routing.backend import ProbeRules

    settings = build_settings({
        "backends": {"mtp": {"url": "http://m", "api_key": "k"}, "plain": {"url": "http://p"}},
        "monitor": {"fall": 4, "rise": 3, "circuit_failures": 7, "circuit_open_s": 12.5,
                    "use_backend_loads": True, "backend_loads_max_age_s": 1.5},
        "routing": {"pair_affinity_slack": 2, "max_sessions": 9, "crossover": 20}})
    p = Pool.from_settings(settings, now=4.0)
    mtp = p.backends["mtp"]
    assert (mtp.circuit_rules, mtp.probe_rules) == (CircuitRules(7, 12.5), ProbeRules(4, 3))
    assert (mtp.target.url, mtp.target.api_key, p.backends["plain"].target.url) == (
        "http://m", "k", "http://p")
    assert (p.use_backend_loads, p.loads_max_age_s, p.affinity_slack, p.sessions.capacity) == (
        True, 1.5, 2, 9)
    assert (p.pairs["default"].routing.crossover, p.pairs["default"].mode_since) == (20, 4.0)


def test_a_holder_placement_says_so():
    p = pool(2)
    placement = p.place(Ask(holder="p1/plain"), 1.0)
    assert placement.pair_choice == PairChoice("p1", "holder")
    assert (placement.backend.name, placement.decision.reason) == ("p1/plain", "pinned")


def test_inside_the_band_a_session_stays_on_the_server_that_holds_its_prefix():
    routing = Routing(crossover=24, hysteresis=6, load_signal="requests", session_affinity=True)
    p = pool(routing=routing)
    admit(p, 1.0, session="a", pin="plain").end(Outcome.SUCCESS, 1.0)  # a's prefix: plain
    busy = [admit(p, 1.0) for _ in range(20)]  # 20 in flight, inside the band (18, 24)
    assert {lease.backend.name for lease in busy} == {"mtp"}
    assert (admit(p, 1.0, session="a").backend.name, p.place(Ask(session="a"), 1.0).decision.reason) \
        == ("plain", "session_affinity")
    assert p.place(Ask(session="b"), 1.0).backend.name == "mtp"  # no prefix anywhere: the mode


def test_a_retry_leaves_out_a_pair_whose_servers_all_failed():
    p = pool(2)
    placement = p.place(Ask(), 1.0, exclude=["p0/mtp", "p0/plain"])
    assert placement.pair_choice.pair == "p1" and placement.backend.pair == "p1"


def test_the_view_carries_the_cap_and_no_backend_keeps_when_the_mode_began():
    p = pool()
    p.backends["mtp"].record_server_info(8, None)
    assert p.view(p.backends["mtp"], 1.0).effective_cap == 8
    busy = pool()
    busy.pairs["p0"].mode_since = 0.5
    for backend in busy.backends.values():
        backend.up = False
    placement = busy.place(Ask(), 2.0)
    assert (placement.decision.mode, placement.decision.mode_since) == ("mtp", 0.5)
