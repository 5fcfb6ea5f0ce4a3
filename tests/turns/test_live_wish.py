"""The live controller's hand-over wish (gateway/turns/wiring.LoadWish) counts what a turn throws
away, as the virtual bench's controller does: the prefix cache of the sessions at work and the
running streams the incoming server must prefill again. A pair with a warm agentic cache or
long streams running holds the memory longer before it turns. Clocks are passed in."""

from __future__ import annotations

from typing import Any, cast

from gateway.config import Turns
from gateway.relay.exchange import Exchange
from gateway.relay.in_flight import InFlight
from gateway.routing.lease import Outcome
from gateway.routing.pool import Ask, Lease, Pool
from gateway.turns.state import PairMemory
from gateway.turns.wiring import LoadWish
from tests.turns.test_pool_gate import Gate, turns_pool

MTP_HOLDS = PairMemory("holding", (("mtp", "held"), ("plain", "released")))
SETTLED_AT = 1.0  # the last turn ended; it cost 1.5 s: a cold pair's dwell is 10 x 1.5 = 15 s


def _wish(pool: Pool, streams: InFlight) -> LoadWish:
    wish = LoadWish(pool, pool.pairs["p0"], Turns(payback_turns=0), lambda: 0, streams)
    wish.settled("mtp", SETTLED_AT, turn_s=1.5)
    return wish


def _busy_pool(session_prompts: int = 0) -> Pool:
    """Six requests on MTP, past the crossover of 4: the load wants plain. Each in a session
    with a prompt of `session_prompts` tokens whose earlier request ended (its context is
    cached), or (0) none in a session."""
    pool = turns_pool(Gate("mtp"))
    for k in range(6):
        ask = Ask(session=f"s{k}", prompt_tokens=session_prompts) if session_prompts else Ask()
        if session_prompts:
            earlier = pool.admit(ask, SETTLED_AT)
            assert isinstance(earlier, Lease)
            earlier.end(Outcome.SUCCESS, SETTLED_AT)
        assert isinstance(pool.admit(ask, SETTLED_AT), Lease)
    return pool


def _no_streams() -> InFlight:
    return InFlight(cast(Any, None), cast(Any, None))


def test_a_warm_session_cache_holds_the_memory_longer_before_a_turn() -> None:
    cold = _wish(_busy_pool(), _no_streams())
    assert cold.turn_to(MTP_HOLDS, now=20.0) == "plain"  # past its 15 s dwell
    # 6 x 40k tokens at 16k tokens/s: a turn costs 1.5 + 15 s, the dwell 165 s
    warm = _wish(_busy_pool(session_prompts=40_000), _no_streams())
    assert warm.turn_to(MTP_HOLDS, now=20.0) is None
    assert warm.turn_to(MTP_HOLDS, now=SETTLED_AT + 166.0) == "plain"


def test_long_running_streams_hold_the_memory_longer_before_a_turn() -> None:
    pool = _busy_pool()
    mtp = pool.pairs["p0"].backends["mtp"]
    mtp.record_server_info(None, accept_length=2.5)
    lease = pool.admit(Ask(prompt_tokens=100_000), SETTLED_AT)
    assert isinstance(lease, Lease)
    stream = Exchange(cast(Any, None), [], lease, SETTLED_AT, cast(Any, None))
    stream.recent.extend([b"data: {}\n\n"] * 1000)  # 1000 pieces of 2.5 tokens each
    streams = _no_streams()
    streams.running[mtp] = {stream: None}
    wish = _wish(pool, streams)
    assert wish.continued_tokens("mtp") == 102_500
    # a turn re-prefills 102.5k tokens at 16k tokens/s: it costs 1.5 + 6.4 s, the dwell 79 s
    assert wish.turn_to(MTP_HOLDS, now=20.0) is None
    assert wish.turn_to(MTP_HOLDS, now=SETTLED_AT + 80.0) == "plain"
    streams.running[mtp] = {}  # it ended: the cold dwell again
    assert _wish(pool, streams).turn_to(MTP_HOLDS, now=20.0) == "plain"


def test_with_each_servers_store_a_turn_into_the_server_that_served_the_sessions_costs_their_load() -> None:
    """Plain handed the memory to MTP with six 40k-token sessions at work: with `kv_store`
    plain's store holds them, and a turn back to plain loads them (6 x 40k at 230k tokens/s:
    1.04 s) instead of prefilling them (15 s at 16k tokens/s)."""
    dwell = {}
    for kv_store in (False, True):
        pool = _busy_pool(session_prompts=40_000)
        wish = LoadWish(pool, pool.pairs["p0"], Turns(kv_store=kv_store), lambda: 0, _no_streams())
        wish.settled("mtp", SETTLED_AT, turn_s=1.5)  # a turn into MTP: plain served them
        dwell[kv_store] = next(t for t in range(2, 200) if wish.turn_to(MTP_HOLDS, now=SETTLED_AT + t))
    assert dwell[False] == 165  # 10 x (1.5 + 240k / 16k) = 165 s
    assert dwell[True] == 26  # 10 x (1.5 + 240k / 230k) = 25.4 s
    # a server whose store never held them costs what no store costs
    pool = _busy_pool(session_prompts=40_000)
    wish = LoadWish(pool, pool.pairs["p0"], Turns(kv_store=True), lambda: 0, _no_streams())
    wish.settled("plain", SETTLED_AT, turn_s=1.5)  # the other way: MTP's store holds them
    wish.settled("mtp", SETTLED_AT, turn_s=None)  # a settling, not a turn: plain's store unchanged
    assert wish.turn_to(MTP_HOLDS, now=SETTLED_AT + 100) is None


def test_the_live_wish_waits_until_the_holder_has_forgone_the_warm_contexts_a_turn_would_lose() -> None:
    """The payback rule live (turns.payback_turns, gain_per_crossover), with no dwell: six warm
    40k-token sessions at work past the crossover; a turn throws away 240k tokens (15 s of
    prefill at 16k tokens/s). The wish accrues what MTP forgoes from its first look on, and
    turns once that repays them: 15 s / (0.5 x 3/4) = 40 s; sessions with nothing cached yet
    (a cold start) turn at the first look."""
    pool = _busy_pool(session_prompts=40_000)
    wish = LoadWish(pool, pool.pairs["p0"], Turns(dwell_turns=0), lambda: 0, _no_streams())
    assert wish.load(SETTLED_AT).level == 6 and wish.load(SETTLED_AT).crossover == 4
    assert wish.turn_to(MTP_HOLDS, now=10.0) is None  # the first look: the load stands across
    assert wish.turn_to(MTP_HOLDS, now=49.9) is None
    assert wish.turn_to(MTP_HOLDS, now=50.1) == "plain"
    cold = _busy_pool()
    for k in range(6):  # six sessions whose first requests are in flight: nothing cached
        assert isinstance(cold.admit(Ask(session=f"new{k}", prompt_tokens=40_000), SETTLED_AT), Lease)
    fresh = LoadWish(cold, cold.pairs["p0"], Turns(dwell_turns=0), lambda: 0, _no_streams())
    assert fresh.turn_to(MTP_HOLDS, now=10.0) == "plain"
