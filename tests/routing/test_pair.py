"""gateway.routing.pair: one pair's mode, routing and learned crossover, as the dashboard, /admin
and the pool's decisions read them."""

from __future__ import annotations

from gateway.config import Backend, Routing, Settings
from gateway.routing.backend import BackendState
from gateway.routing.crossover import MIN_SAMPLES, MIN_TOKENS
from gateway.routing.pair import PairState, pair_specs


def pair(routing: Routing) -> PairState:
    backends = {role: BackendState(role, "default", role, Backend(url=f"http://{role}"))
                for role in ("mtp", "plain")}
    return PairState("default", routing, backends)  # type: ignore[arg-type]


def teach(state: PairState, role: str, running: int, tokens_per_s: float) -> None:
    """MIN_SAMPLES streams alone on `role` at `running` streams, each at `tokens_per_s`."""
    for _ in range(MIN_SAMPLES):
        state.estimator.observe(role, MIN_TOKENS * 10, MIN_TOKENS * 10 / tokens_per_s, running, 0.0)


def test_what_the_streams_taught_is_read_at_each_servers_cap() -> None:
    """Past a server's running cap it runs no more streams: its throughput is read at the cap."""
    state = pair(Routing(crossover=24, adaptive_crossover=True, crossover_bounds=(16, 64)))
    teach(state, "mtp", 8, 50.0)
    teach(state, "mtp", 32, 30.0)
    teach(state, "plain", 8, 40.0)
    teach(state, "plain", 32, 35.0)
    state.backends["mtp"].effective_cap = 8
    learned = state.learning_state()
    crossover = state.crossover
    assert 8 < crossover < 32
    assert learned["throughput"] == {
        "mtp": state.estimator.mtp.aggregate(8),  # capped
        "plain": state.estimator.plain.aggregate(crossover)}
    assert learned["throughput"]["mtp"] == 8 * 50.0
    assert learned["samples"] == 4 * MIN_SAMPLES
    assert learned["plain_below"] == state.plain_below
    assert learned["accept_length"] is None  # no chunks were counted


def test_without_learning_there_is_no_advice_and_no_plain_below() -> None:
    state = pair(Routing(crossover=24, adaptive_crossover=False))
    teach(state, "mtp", 8, 50.0)
    assert state.advice is None and state.learned_crossover is None and state.plain_below == 0
    learned = state.learning_state()
    assert learned["crossover"] is None and learned["plain_below"] is None
    assert learned["samples"] == MIN_SAMPLES  # what was seen is still said


def test_the_accept_length_is_the_recent_streams_when_learning_else_the_monitors() -> None:
    learning = pair(Routing(adaptive_crossover=True))
    learning.backends["mtp"].accept_length = 1.5
    assert learning.accept_length == 1.5  # nothing learned yet: the monitor's
    for _ in range(3):
        learning.estimator.observe("mtp", 4 * MIN_TOKENS, 1.0, 1.0, 0.0, chunks=2 * MIN_TOKENS)
    assert learning.accept_length == 2.0
    fixed = pair(Routing(adaptive_crossover=False))
    fixed.backends["mtp"].accept_length = 1.5
    fixed.estimator.observe("mtp", 4 * MIN_TOKENS, 1.0, 1.0, 0.0, chunks=2 * MIN_TOKENS)
    assert fixed.accept_length == 1.5


def test_the_crossover_in_force_follows_the_accept_length_until_one_is_learned() -> None:
    state = pair(Routing(crossover=24, reference_accept_length=2.0, adaptive_crossover=False))
    state.backends["mtp"].accept_length = 1.5
    assert state.crossover == 18
    assert state.concurrency == 0
    state.backends["mtp"].inflight, state.backends["plain"].inflight = 3, 2
    assert state.concurrency == 5


def test_each_configured_pair_gets_its_own_routing() -> None:
    settings = Settings.model_validate({
        "pairs": [{"name": "a", "mtp": {"url": "http://a-mtp"}, "plain": {"url": "http://a-plain"},
                   "routing": {"crossover": 10}},
                  {"name": "b", "mtp": {"url": "http://b-mtp"}, "plain": {"url": "http://b-plain"}}],
        "routing": {"crossover": 30}})
    specs = pair_specs(settings)
    assert [(s.name, s.mtp.url, s.plain.url, s.routing.crossover) for s in specs] == [
        ("a", "http://a-mtp", "http://a-plain", 10), ("b", "http://b-mtp", "http://b-plain", 30)]
