"""Each server's HiCache in the simulator (gateway/sim/hicache.py): what a turns pair relies on to
find its sessions' prefixes again on its next turn, in virtual time."""

import pytest

from gateway.sim.engine import CACHE_BLOCK_TOKENS, Request
from gateway.sim.hicache import (
    PAGE_TOKENS,
    PREFETCH_THRESHOLD_TOKENS,
    HiCache,
    L3Store,
    NamespaceConflict,
    store_spec,
)
from gateway.sim.memory import QWEN35_122B
from gateway.sim.profile import packaged_timings
from gateway.sim.virtual import VirtualSim

PROMPT = tuple(range(1000, 1000 + 40 * PAGE_TOKENS))  # 2,560 tokens, 40 whole pages


def profiles():
    timings = packaged_timings()
    return {"mtp": timings["mtp"], "plain": timings["plain"]}


def spec(role="plain", namespace=None, **sizes):
    return store_spec(role == "mtp", namespace=namespace or role, gpus=4, **sizes)


def sim_with_store(**sizes):
    return VirtualSim(profiles(), log_requests=True, hicache={"plain": spec(**sizes)})


def serve(sim, rid, prompt=PROMPT, backend="plain"):
    """Send one request, run until it ends; returns (first token time, its log entry)."""
    times = {}
    sim.submit(backend, Request(rid, prompt, 4), on_first_token=lambda t: times.setdefault("first", t))
    sim.run()
    (entry,) = [e for e in sim.request_log if e.rid == rid]
    return times["first"], entry


def turn_away_and_back(sim, backend="plain", wait_s=60.0):
    """Let ``wait_s`` pass (writes drain), release, and resume."""
    sim.run(until=sim.now + wait_s)
    sim.park(backend, flush_cache=True)
    sim.unpark(backend)


def test_the_model_gives_the_bytes_a_page_and_a_mamba_state_take_in_the_store():
    plain, mtp = spec("plain"), spec("mtp")
    assert plain.bytes_per_token == QWEN35_122B.kv_bytes_per_token(4, draft=False) * 4 == 49_152
    assert mtp.bytes_per_token == QWEN35_122B.kv_bytes_per_token(4, draft=True) * 4 == 53_248
    assert plain.mamba_state_bytes == QWEN35_122B.mamba_bytes_per_request(4) * 4
    assert 150e6 < plain.mamba_state_bytes < 160e6
    assert PAGE_TOKENS == CACHE_BLOCK_TOKENS  # one page size for the device tree and the store


def test_a_server_finds_after_its_release_the_prefixes_it_wrote_before_it():
    sim = sim_with_store()
    serve(sim, "a")
    turn_away_and_back(sim)
    _, entry = serve(sim, "b")
    assert entry.cached_tokens == len(PROMPT) - 1  # every page, less the last token computed
    assert sim.engines["plain"].stats.loaded_tokens == len(PROMPT) - 1

    without = VirtualSim(profiles(), log_requests=True)
    serve(without, "a")
    turn_away_and_back(without)
    assert serve(without, "b")[1].cached_tokens == 0


def test_writes_not_in_the_store_at_the_release_are_lost():
    sim = sim_with_store()
    serve(sim, "a")
    cache = sim.hicache["plain"]
    assert cache.drained_at(sim.now) > sim.now  # the write of its pages and state takes time
    sim.park("plain", flush_cache=True)  # released at once: nothing reached L3
    sim.unpark("plain")
    assert cache.dropped_tokens == len(PROMPT)
    assert serve(sim, "b")[1].cached_tokens == 0


def test_a_request_waits_for_its_load_then_prefills_only_the_tail():
    sim = sim_with_store()
    serve(sim, "a")
    turn_away_and_back(sim)
    tail = tuple(range(5000, 5000 + 8192))
    sent = sim.now
    first, entry = serve(sim, "b", PROMPT + tail)
    cache = sim.hicache["plain"]
    load = cache.spec.load_s(len(PROMPT))
    assert entry.cached_tokens == len(PROMPT)
    assert first - sent >= load  # it waited for its read
    profile = sim.engines["plain"].profile
    cold = VirtualSim(profiles())
    t = {}
    cold.submit("plain", Request("c", PROMPT + tail, 4), on_first_token=lambda x: t.setdefault("first", x))
    cold.run()
    assert first - sent < t["first"]  # loading beats prefilling it
    assert first - sent == pytest.approx(load + profile.prefill_step_s(len(tail)) * 1.01, rel=0.01)


def test_a_hit_stops_at_the_deepest_page_whose_node_has_a_mamba_state():
    engine_keys = VirtualSim(profiles()).engines["plain"].block_keys
    cache = HiCache(spec(), L3Store(spec()), engine_keys)
    cache.written(PROMPT, 0.0)
    later = 1e6
    assert cache.stored(PROMPT, later)[0] == len(PROMPT)
    # the first half's pages are stored, but its node has no state: a prompt that diverges after
    # them starts from nothing
    half = PROMPT[: len(PROMPT) // 2] + tuple(range(9000, 9000 + 10 * PAGE_TOKENS))
    assert cache.stored(half, later)[0] == 0
    cache.written(PROMPT[: len(PROMPT) // 2], later)  # a node there (a request that ended there)
    assert cache.stored(half, later + 1e6)[0] == len(PROMPT) // 2


def test_below_the_prefetch_threshold_a_request_does_not_wait_for_the_store():
    sim = sim_with_store()
    short = PROMPT[: PREFETCH_THRESHOLD_TOKENS - PAGE_TOKENS]
    serve(sim, "a", short)
    turn_away_and_back(sim)
    assert serve(sim, "b", short)[1].cached_tokens == 0
    assert sim.hicache["plain"].loaded_tokens == 0


def test_the_store_evicts_the_least_recently_used_at_its_cap():
    one = spec()
    room = 3 * (len(PROMPT) * one.bytes_per_token + one.mamba_state_bytes)
    sim = sim_with_store(capacity_bytes=room)
    prompts = [tuple(range(k * 100_000, k * 100_000 + len(PROMPT))) for k in range(4)]
    for k, prompt in enumerate(prompts):
        serve(sim, f"w{k}", prompt)
        sim.run(until=sim.now + 60.0)
    turn_away_and_back(sim)
    # newest first: a miss's own write-through would evict what is read after it
    hits = {k: serve(sim, f"r{k}", prompts[k])[1].cached_tokens for k in (3, 2, 1, 0)}
    assert hits == {3: len(PROMPT) - 1, 2: len(PROMPT) - 1, 1: len(PROMPT) - 1, 0: 0}


def test_a_release_empties_the_host_tier_but_keeps_the_store():
    sim = sim_with_store()
    serve(sim, "a")
    sim.run(until=sim.now + 60.0)
    cache = sim.hicache["plain"]
    cache.settle(sim.now)  # the writes done by now are in L3
    assert cache.host.used > 0 and cache.store.tier.used > 0
    stored = cache.store.tier.used
    sim.park("plain", flush_cache=True)
    assert cache.host.used == 0 and cache.store.tier.used == stored


def test_each_server_keeps_its_own_store_and_one_namespace_for_both_is_refused():
    sim = VirtualSim(profiles(), log_requests=True, hicache={"mtp": spec("mtp"), "plain": spec("plain")})
    serve(sim, "a", backend="mtp")
    sim.run(until=sim.now + 60.0)
    sim.park("mtp", flush_cache=True)
    assert serve(sim, "b", backend="plain")[1].cached_tokens == 0  # MTP's pages are not plain's
    with pytest.raises(NamespaceConflict, match="13 layers against 12"):
        VirtualSim(profiles(), hicache={"mtp": spec("mtp", "pair"), "plain": spec("plain", "pair")})
    # the same page format may share one (two plain servers)
    VirtualSim({"a": profiles()["plain"], "b": profiles()["plain"]},
               hicache={"a": spec("plain", "pair"), "b": spec("plain", "pair")})


def test_a_parked_server_starts_a_load_only_once_it_is_resumed():
    sim = sim_with_store()
    serve(sim, "a")
    sim.run(until=sim.now + 60.0)
    sim.park("plain", flush_cache=True)
    t = {}
    sim.submit("plain", Request("b", PROMPT, 4), on_first_token=lambda x: t.setdefault("first", x))
    sim.run(until=sim.now + 30.0)
    resumed = sim.now
    sim.unpark("plain")
    sim.run()
    assert t["first"] >= resumed + sim.hicache["plain"].spec.load_s(len(PROMPT) - PAGE_TOKENS)


def test_write_through_costs_each_prefill_step_a_named_share():
    with_store, without = sim_with_store(), VirtualSim(profiles(), log_requests=True)
    first_with, _ = serve(with_store, "a")
    first_without, _ = serve(without, "a")
    assert first_with == pytest.approx(first_without * 1.01)


def test_only_the_trees_new_leaf_is_written_so_an_evicted_prefix_stays_lost():
    one = spec()
    room = len(PROMPT) * one.bytes_per_token + one.mamba_state_bytes
    engine_keys = VirtualSim(profiles()).engines["plain"].block_keys
    cache = HiCache(spec(capacity_bytes=room), L3Store(spec(capacity_bytes=room)), engine_keys)
    other = tuple(range(500_000, 500_000 + len(PROMPT)))
    cache.written(PROMPT, 0.0)
    cache.written(other, 10.0)  # evicts PROMPT's pages from L3
    tail = PROMPT + tuple(range(900_000, 900_000 + 4 * PAGE_TOKENS))
    cache.written(tail, 20.0, reused=len(PROMPT))  # the device still had PROMPT: only the tail is new
    cache.release(100.0)  # the host tier goes: L3 alone remains
    assert cache.stored(tail, 100.0)[0] == 0
    cache.written(tail, 100.0, reused=0)  # prefilled whole again: every page is new to the tree
    assert cache.stored(tail, 200.0)[0] == len(tail)
