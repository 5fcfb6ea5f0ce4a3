"""The hand-over decision of a pair taking turns (gateway.turns.decision), on plain values."""

import math

import pytest

from gateway.turns.decision import (
    NEVER,
    CarriedCost,
    Holding,
    LoadSignal,
    TurnDecision,
    TurnRules,
    carried_cost,
    decide_turn,
    wanted,
)

RULES = TurnRules(turn_cost_s=1.5, dwell_turns=10, min_dwell_s=5, to_plain_after_s=0,
                  to_mtp_after_s=4, prefill_tokens_per_s=10_000)


def test_a_fresh_pair_hands_over_to_plain_as_soon_as_the_load_reaches_the_crossover():
    below = decide_turn(Holding("mtp"), LoadSignal(31, 32, 6), RULES, now=0.0)
    at = decide_turn(Holding("mtp"), LoadSignal(32, 32, 6), RULES, now=0.0)
    assert not below.turn and below.reason == "holder_fits"
    assert at.turn and at.to == "plain" and at.reason == "load_above_crossover"


def test_inside_the_band_the_holder_keeps_the_memory_both_ways():
    for holder in ("mtp", "plain"):
        d = decide_turn(Holding(holder, since=NEVER), LoadSignal(28, 32, 6), RULES, now=100.0)
        assert not d.turn and d.reason == "holder_fits" and d.across_since is None
    assert wanted("plain", LoadSignal(26, 32, 6)) == "mtp"


def test_the_way_back_waits_until_the_load_has_stayed_low_for_the_confirmation():
    memory = Holding("plain", since=0.0)
    first = decide_turn(memory, LoadSignal(4, 32, 6), RULES, now=100.0)
    assert not first.turn and first.reason == "confirming" and first.across_since == 100.0
    memory = Holding("plain", since=0.0, across_since=first.across_since)
    assert not decide_turn(memory, LoadSignal(4, 32, 6), RULES, now=103.9).turn
    later = decide_turn(memory, LoadSignal(4, 32, 6), RULES, now=104.0)
    assert later.turn and later.to == "mtp" and later.reason == "load_below_crossover"


def test_a_load_that_comes_back_resets_the_confirmation():
    memory = Holding("plain", since=0.0, across_since=100.0)
    back = decide_turn(memory, LoadSignal(40, 32, 6), RULES, now=102.0)
    assert not back.turn and back.across_since is None


def test_the_holder_keeps_the_memory_for_its_dwell_of_ten_turns():
    memory = Holding("plain", since=50.0, across_since=50.0)
    assert decide_turn(memory, LoadSignal(1, 32, 6), RULES, now=50.0 + 14.9).reason == "dwell"
    assert decide_turn(memory, LoadSignal(1, 32, 6), RULES, now=50.0 + 15.0).turn


def test_a_dearer_turn_and_a_warm_prefix_cache_make_the_holder_hold_longer():
    memory = Holding("mtp", since=0.0)
    load = LoadSignal(64, 32, 6)
    assert decide_turn(memory, load, RULES, now=16.0).turn
    # 50k cached tokens at 10k tok/s add 5 s to a turn: dwell 10 x 6.5 s
    assert decide_turn(memory, load, RULES, now=16.0, cached_tokens=50_000).reason == "dwell"
    assert decide_turn(memory, load, RULES, now=65.0, cached_tokens=50_000).turn
    assert decide_turn(memory, load, RULES, now=64.9, continued_tokens=50_000).reason == "dwell"
    slow = TurnRules(turn_cost_s=15.0)
    assert decide_turn(memory, load, slow, now=149.0).reason == "dwell"
    assert decide_turn(memory, load, slow, now=150.0).turn


def test_turn_cost_counts_the_tokens_computed_again():
    assert RULES.turn_cost() == 1.5
    assert RULES.turn_cost(cached_tokens=10_000, continued_tokens=5_000) == pytest.approx(3.0)
    assert TurnRules(turn_cost_s=0.1, min_dwell_s=5).dwell() == 5


def test_bad_rules_are_refused():
    with pytest.raises(ValueError):
        TurnRules(turn_cost_s=-1)
    with pytest.raises(ValueError):
        TurnRules(prefill_tokens_per_s=0)
    assert NEVER == -math.inf


def test_each_decision_not_to_turn_is_the_whole_answer():
    """What the caller keeps: no hand-over, no target, the reason, and when the load crossed
    (kept through the confirmation and the dwell, so the dwell's end needs no new one)."""
    load_low = LoadSignal(1, 32, 6)
    assert decide_turn(Holding("mtp"), load_low, RULES, now=1.0) == TurnDecision(
        False, None, "holder_fits", None)
    assert decide_turn(Holding("plain", since=0.0), load_low, RULES, now=100.0) == TurnDecision(
        False, None, "confirming", 100.0)
    memory = Holding("plain", since=50.0, across_since=51.0)
    assert decide_turn(memory, load_low, RULES, now=60.0) == TurnDecision(False, None, "dwell", 51.0)
    assert decide_turn(memory, load_low, RULES, now=65.0) == TurnDecision(
        True, "mtp", "load_below_crossover", None)


def test_the_dwell_of_a_turn_that_recomputes_nothing_is_ten_turns_of_its_own_cost():
    assert RULES.dwell() == 15.0
    assert RULES.dwell(cached_tokens=10_000) == pytest.approx(25.0)


def test_any_positive_prefill_rate_is_a_rule_and_the_refusal_says_what_is_wrong():
    assert TurnRules(prefill_tokens_per_s=0.5).turn_cost(cached_tokens=1) == pytest.approx(3.5)
    with pytest.raises(ValueError, match="^turn rules take non-negative times and a positive prefill rate$"):
        TurnRules(to_mtp_after_s=-0.1)


def test_with_a_store_a_turn_costs_what_the_incoming_server_lacks_prefilled_and_the_rest_loaded():
    contexts = {"a": 60_000, "b": 40_000, "c": 1_000}
    stored = {"a": 50_000, "c": 5_000}  # "b" is new to the incoming server; "c" shrank (compacted)
    cost = carried_cost(contexts, stored, load_s=lambda tokens: tokens / 1_000_000)
    assert cost == CarriedCost(prefill_tokens=10_000 + 40_000 + 0, load_s=pytest.approx(0.051))
    assert carried_cost(contexts, {}, load_s=lambda tokens: 1.0) == CarriedCost(101_000, 0.0)


def test_the_load_seconds_count_in_the_turns_cost_and_its_dwell():
    assert RULES.turn_cost(10_000, 0, load_s=2.0) == pytest.approx(1.5 + 1.0 + 2.0)
    memory = Holding("mtp", since=0.0)
    high = LoadSignal(40, 32, 6)
    # dwell: 10 x (1.5 + 1.0) = 25 s without the load, 10 x 4.5 = 45 s with it
    assert decide_turn(memory, high, RULES, now=30.0, cached_tokens=10_000).turn
    held = decide_turn(memory, high, RULES, now=30.0, cached_tokens=10_000, load_s=2.0)
    assert not held.turn and held.reason == "dwell"
    assert decide_turn(memory, high, RULES, now=45.0, cached_tokens=10_000, load_s=2.0).turn


def test_a_store_that_holds_the_sessions_contexts_makes_the_turn_cheaper_than_re_prefilling_them():
    contexts = {f"s{i}": 80_000 for i in range(32)}
    without = carried_cost(contexts, {}, load_s=lambda t: 0.0)
    with_store = carried_cost(contexts, {s: 79_000 for s in contexts}, load_s=lambda t: t * 12_288 / 3e9)
    assert (RULES.turn_cost(with_store.prefill_tokens, 0, with_store.load_s)
            < RULES.turn_cost(without.prefill_tokens, 0, without.load_s) / 5)
