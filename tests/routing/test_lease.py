"""gateway.routing.lease: one admitted request's claim on a backend, at its edges: what a move, a
retry and a continuation leave counted where, what its one end judges, and when a finished
stream is a sample of its server's speed.

Pure state driven with explicit times: no sockets, no sleeps."""

from __future__ import annotations

import pytest

from gateway.config import Backend, Routing
from gateway.routing.backend import CircuitRules
from gateway.routing.crossover import MIN_TOKENS, SETTLE_S
from gateway.routing.pool import Ask, Failure, Lease, Outcome, PairSpec, Pool

ROUTING = Routing(crossover=4, hysteresis=1, min_dwell_s=0, load_signal="requests")
CONNECT = Failure("connect")
FIVE_XX = Failure("status_5xx", answered=True)


def pool(pairs: int = 1, routing: Routing = ROUTING, **kwargs) -> Pool:
    if pairs == 1:
        specs = [PairSpec("default", Backend(url="http://mtp"), Backend(url="http://plain"),
                          routing)]
    else:
        specs = [PairSpec(f"p{k}", Backend(url=f"http://mtp{k}"),
                          Backend(url=f"http://plain{k}"), routing) for k in range(pairs)]
    return Pool(specs, now=0.0, **kwargs)


def admit(p: Pool, now: float = 1.0, **ask) -> Lease:
    lease = p.admit(Ask(**ask), now)
    assert isinstance(lease, Lease), lease
    return lease


def counts(p: Pool) -> dict[str, tuple[int, int, int]]:
    """Per backend: in flight, of them not started, served."""
    return {name: (b.inflight, b.not_started, b.served) for name, b in p.backends.items()}


def take_down(p: Pool, name: str) -> None:
    for _ in range(3):
        p.backends[name].probe_failed()


# --- the first byte ----------------------------------------------------------------------------


def test_a_first_byte_after_the_end_changes_nothing() -> None:
    p = pool()
    lease = admit(p)
    lease.end(Outcome.CLIENT_GONE, 2.0)
    lease.first_byte(3.0)
    assert not lease.started
    assert counts(p)["mtp"] == (0, 0, 1)


# --- a planned move at the flip ----------------------------------------------------------------


def test_a_move_says_where_it_came_from_and_counts_for_its_pair() -> None:
    p = pool()
    first, second = admit(p), admit(p)
    plain = p.backends["plain"]
    first.move_to(plain, 1.0)
    assert (first.backend, first.moved_from, first.reason) == (plain, p.backends["mtp"], "moved")
    assert p.pairs["default"].moved == 1
    second.move_to(plain, 1.0)
    assert p.pairs["default"].moved == 2
    first.end(Outcome.SUCCESS, 2.0)
    second.end(Outcome.SUCCESS, 2.0)
    assert counts(p) == {"mtp": (0, 0, 0), "plain": (0, 0, 2)}  # served where they ended


def test_a_moved_stream_is_no_sample_of_either_server() -> None:
    """A stream moved at the flip ran on two servers: a sample of neither (from test_adaptive.py)."""
    learning = pool(routing=Routing(adaptive_crossover=True))
    lease = learning.admit(Ask(), now=0.0)
    lease.first_byte(0.0)
    lease.move_to(learning.backends["plain"], 5.0)
    lease.output_tokens = 500
    lease.end(Outcome.SUCCESS, 10.0)
    assert learning.pairs["default"].estimator.samples == 0


def test_a_move_to_the_server_it_is_on_or_after_the_end_does_nothing() -> None:
    p = pool()
    lease = admit(p)
    lease.move_to(p.backends["mtp"], 1.0)
    assert (lease.moved_from, lease.reason, p.pairs["default"].moved) == (None, "below_crossover", 0)
    assert counts(p)["mtp"] == (1, 1, 0)
    lease.end(Outcome.SUCCESS, 2.0)
    lease.move_to(p.backends["plain"], 3.0)
    assert counts(p) == {"mtp": (0, 0, 1), "plain": (0, 0, 0)}
    assert p.pairs["default"].moved == 0


def test_a_running_stream_moved_is_not_counted_as_unstarted_there() -> None:
    p = pool()
    running, waiting = admit(p), admit(p)
    running.first_byte(1.0)
    running.move_to(p.backends["plain"], 1.0)
    waiting.move_to(p.backends["plain"], 1.0)
    assert counts(p)["plain"] == (2, 1, 0)


def test_a_moved_trial_frees_the_trial_and_is_judged_on_its_new_server() -> None:
    p = pool(circuit=CircuitRules(failures_to_open=1, open_s=10.0))
    admit(p, 1.0).end(Outcome.BACKEND_FAILURE, 1.0, CONNECT)  # opens mtp's circuit
    trial = admit(p, 12.0)  # half-open: this one is mtp's trial
    assert trial.backend.name == "mtp" and not p.backends["mtp"].accepting(12.0)
    trial.move_to(p.backends["plain"], 12.0)
    assert p.backends["mtp"].accepting(12.0)  # no verdict on it: the next may be the trial
    verdicts = trial.end(Outcome.BACKEND_FAILURE, 13.0, CONNECT)
    assert [(v.backend.name, v.blamed) for v in verdicts] == [("plain", True)]


# --- a retry before the first byte -------------------------------------------------------------


def at_the_crossover_on_both_pairs(p: Pool, now: float) -> list[Lease]:
    """4 requests on each pair's MTP server, p0's plain server down, the servers' own load
    readings (this replica's requests alone) taken at `now`."""
    take_down(p, "p0/plain")
    leases = [admit(p, now) for _ in range(8)]
    for backend in p.backends.values():
        backend.record_loads(backend.inflight, 0, now)
    return leases


def test_a_retry_returns_the_moves_its_decision_causes() -> None:
    """A failover onto a pair at its crossover flips it: the caller gets the moves, planned
    from the load as the pool sees it at the retry."""
    p = pool(2, use_backend_loads=True)
    leases = at_the_crossover_on_both_pairs(p, 1.0)
    failing = next(lease for lease in leases if lease.backend.name == "p0/mtp")
    placement = failing.retry_elsewhere(CONNECT, 1.0)
    assert placement is not None and placement.backend is p.backends["p1/plain"]
    assert placement.flip is not None and placement.flip.moves.not_started == 4
    assert placement.flip.source is p.backends["p1/mtp"]


def test_a_retried_request_ended_without_a_first_byte_is_no_speed_sample() -> None:
    p = pool()
    lease = admit(p)
    assert lease.retry_elsewhere(CONNECT, 1.0) is not None
    lease.output_tokens = 100
    lease.end(Outcome.SUCCESS, 5.0)
    assert p.pairs["default"].estimator.samples == 0
    assert counts(p) == {"mtp": (0, 0, 0), "plain": (0, 0, 1)}


# --- a continuation after the first byte -------------------------------------------------------


def test_a_broken_stream_continues_elsewhere_counted_as_started() -> None:
    p = pool()
    lease = admit(p)
    lease.first_byte(1.0)
    placement = lease.continue_elsewhere(Failure("stream_error"), 2.0)
    assert placement is not None and placement.backend is p.backends["plain"]
    assert lease.backend is p.backends["plain"] and lease.started and lease.reason == "failover"
    assert counts(p) == {"mtp": (0, 0, 0), "plain": (1, 0, 0)}
    verdicts = lease.end(Outcome.SUCCESS, 3.0)
    # the failure stays with the first attempt, judged at the end
    assert [(v.backend.name, v.failure.kind, v.blamed) for v in verdicts] == [
        ("mtp", "stream_error", True)]
    assert p.backends["mtp"].circuit.failures == 1
    assert counts(p) == {"mtp": (0, 0, 0), "plain": (0, 0, 1)}


def test_a_continuation_leaves_out_every_server_that_failed_it() -> None:
    p = pool()
    lease = admit(p)
    lease.first_byte(1.0)
    assert lease.continue_elsewhere(Failure("stream_error"), 2.0) is not None
    assert lease.continue_elsewhere(Failure("stream_error"), 2.5) is None  # mtp failed it too
    assert lease.backend is p.backends["plain"]
    assert counts(p)["plain"] == (1, 0, 0)
    verdicts = lease.end(Outcome.BACKEND_FAILURE, 3.0, Failure("stream_error"))
    assert [v.backend.name for v in verdicts] == ["mtp", "plain"]


def test_no_continuation_when_nothing_else_takes_it_or_it_ended() -> None:
    p = pool()
    take_down(p, "plain")
    lease = admit(p)
    lease.first_byte(1.0)
    assert lease.continue_elsewhere(Failure("stream_error"), 2.0) is None
    assert lease.backend is p.backends["mtp"] and counts(p)["mtp"] == (1, 0, 0)
    assert lease.attempts[-1].failure is None  # the failure is the end's to say
    lease.end(Outcome.SUCCESS, 3.0)
    p.backends["plain"].set_parked(True)  # parking a server brings it back up
    p.backends["plain"].set_parked(False)
    assert lease.continue_elsewhere(Failure("stream_error"), 4.0) is None


def test_a_continuation_returns_the_moves_its_decision_causes() -> None:
    p = pool(2, use_backend_loads=True)
    leases = at_the_crossover_on_both_pairs(p, 1.0)
    broken = next(lease for lease in leases if lease.backend.name == "p0/mtp")
    broken.first_byte(1.0)
    placement = broken.continue_elsewhere(Failure("stream_error"), 1.0)
    assert placement is not None and placement.backend is p.backends["p1/plain"]
    assert placement.flip is not None and placement.flip.moves.not_started == 4
    assert counts(p)["p1/plain"] == (1, 0, 0)


def test_a_stream_continued_before_its_first_byte_is_counted_unstarted_where_it_went() -> None:
    p = pool()
    lease = admit(p)
    assert lease.continue_elsewhere(Failure("stream_error"), 2.0) is not None
    assert counts(p) == {"mtp": (0, 0, 0), "plain": (1, 1, 0)}
    lease.first_byte(2.5)
    assert counts(p)["plain"] == (1, 0, 0)


def test_a_continued_stream_is_no_speed_sample_of_either_server() -> None:
    p = pool()
    lease = admit(p)
    lease.first_byte(1.0)
    lease.continue_elsewhere(Failure("stream_error"), 2.0)
    lease.output_tokens = 100
    lease.end(Outcome.SUCCESS, 5.0)
    assert p.pairs["default"].estimator.samples == 0


# --- the one end -------------------------------------------------------------------------------


def test_a_backend_failure_without_its_failure_is_judged_unknown() -> None:
    p = pool()
    verdicts = admit(p).end(Outcome.BACKEND_FAILURE, 2.0)
    assert [(v.backend.name, v.failure.kind, v.blamed, v.opened) for v in verdicts] == [
        ("mtp", "unknown", True, False)]


def test_a_verdict_says_what_failed_and_whether_it_opened_the_circuit() -> None:
    p = pool(circuit=CircuitRules(failures_to_open=1, open_s=10.0))
    verdicts = admit(p).end(Outcome.BACKEND_FAILURE, 2.0, CONNECT)
    assert [(v.backend.name, v.failure, v.blamed, v.opened) for v in verdicts] == [
        ("mtp", CONNECT, True, True)]


def test_a_5xx_both_servers_gave_is_blamed_on_neither_and_opens_nothing() -> None:
    p = pool(circuit=CircuitRules(failures_to_open=1, open_s=10.0))
    lease = admit(p)
    lease.retry_elsewhere(FIVE_XX, 1.0)
    verdicts = lease.end(Outcome.BACKEND_FAILURE, 2.0, FIVE_XX)
    assert [(v.backend.name, v.failure, v.blamed, v.opened) for v in verdicts] == [
        ("mtp", FIVE_XX, False, False), ("plain", FIVE_XX, False, False)]
    assert all(b.accepting(2.0) for b in p.backends.values())


def test_a_second_end_judges_nothing() -> None:
    p = pool()
    lease = admit(p)
    assert lease.end(Outcome.BACKEND_FAILURE, 2.0, CONNECT)
    assert lease.end(Outcome.BACKEND_FAILURE, 2.0, CONNECT) == []
    assert p.backends["mtp"].circuit.failures == 1 and counts(p)["mtp"] == (0, 0, 1)


# --- a finished stream as a speed sample -------------------------------------------------------


def streamed(p: Pool, first_byte_at: float, end_at: float, tokens: int = 4 * MIN_TOKENS) -> Lease:
    lease = admit(p, first_byte_at)
    lease.first_byte(first_byte_at)
    lease.output_tokens = tokens
    lease.end(Outcome.SUCCESS, end_at)
    return lease


def test_a_stream_alone_on_its_server_is_a_sample_of_its_rate_after_the_first_token() -> None:
    p = pool()
    for start in (20.0, 30.0, 40.0):
        streamed(p, start, start + 2.0, tokens=101)
    estimator = p.pairs["default"].estimator
    assert estimator.samples == 3
    assert estimator.mtp.aggregate(1) == pytest.approx(50.0)  # 100 tokens after the first in 2 s
    assert estimator.plain.aggregate(1) is None


def test_a_short_stream_is_a_sample_too() -> None:
    p = pool()
    streamed(p, 20.0, 20.5)
    assert p.pairs["default"].estimator.samples == 1


def test_streams_side_by_side_are_samples_at_their_mean_load() -> None:
    p = pool()
    for start in (20.0, 30.0, 40.0):
        leases = [admit(p, start) for _ in range(2)]
        for lease in leases:
            lease.first_byte(start)
            lease.output_tokens = 4 * MIN_TOKENS
        leases[0].end(Outcome.SUCCESS, start + 2.0)  # 2 running all its life
        leases[1].end(Outcome.SUCCESS, start + 4.0)  # 2 for 2 s, then alone: 1.5 on average
    mtp = p.pairs["default"].estimator.mtp
    assert mtp.measured(2) and not mtp.measured(3) and not mtp.measured(4)


def test_the_accept_length_is_tokens_per_chunk_after_the_first() -> None:
    p = pool()
    for start in (20.0, 30.0, 40.0):
        lease = admit(p, start)
        lease.first_byte(start)
        lease.output_tokens, lease.output_chunks = 4 * MIN_TOKENS + 1, 2 * MIN_TOKENS + 1
        lease.end(Outcome.SUCCESS, start + 2.0)
    pair = p.pairs["default"]
    assert pair.estimator.accept_length == pytest.approx(2.0)
    assert pair.learning_state()["accept_length"] == pytest.approx(2.0)


def test_a_stream_that_ends_at_its_first_byte_is_no_sample() -> None:
    p = pool()
    streamed(p, 20.0, 20.0)
    assert p.pairs["default"].estimator.samples == 0


@pytest.mark.parametrize(("after_change", "samples"), [(SETTLE_S - 0.5, 0), (SETTLE_S, 1)])
def test_a_stream_begun_while_a_mode_change_settles_is_no_sample(after_change: float,
                                                                  samples: int) -> None:
    p = pool(routing=Routing(crossover=4, hysteresis=1, min_dwell_s=100.0))
    pair = p.pairs["default"]
    leases = [admit(p, 1.0) for _ in range(5)]  # the fifth flips the pair to plain, to stay
    assert pair.mode == "plain" and pair.changed_at == 1.0
    for lease in leases:
        lease.end(Outcome.CLIENT_GONE, 1.0)
    lease = streamed(p, 1.0 + after_change, 1.0 + after_change + 2.0)
    assert pair.changed_at == 1.0
    assert pair.estimator.samples == samples
