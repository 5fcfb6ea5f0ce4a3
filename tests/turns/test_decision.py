"""The hand-over decision of a pair taking turns (gateway.turns.decision), on plain values."""

import math

import pytest

from gateway.turns.decision import (
    NEVER,
    Across,
    CarriedCost,
    Holding,
    LoadSignal,
    TurnDecision,
    TurnRules,
    carried_cost,
    decide_turn,
    wanted,
)

# payback_turns=0: the confirmation and the dwell alone (the payback has its own tests below)
RULES = TurnRules(turn_cost_s=1.5, dwell_turns=10, min_dwell_s=5, to_plain_after_s=0,
                  to_mtp_after_s=4, prefill_tokens_per_s=10_000, payback_turns=0)
PAYING = TurnRules(turn_cost_s=1.5, dwell_turns=0, min_dwell_s=0, to_plain_after_s=0, to_mtp_after_s=0,
                   prefill_tokens_per_s=16_000)


def test_a_fresh_pair_hands_over_to_plain_as_soon_as_the_load_reaches_the_crossover():
    below = decide_turn(Holding("mtp"), LoadSignal(31, 32, 6), RULES, now=0.0)
    at = decide_turn(Holding("mtp"), LoadSignal(32, 32, 6), RULES, now=0.0)
    assert not below.turn and below.reason == "holder_fits"
    assert at.turn and at.to == "plain" and at.reason == "load_above_crossover"


def test_inside_the_band_the_holder_keeps_the_memory_both_ways():
    for holder in ("mtp", "plain"):
        d = decide_turn(Holding(holder, since=NEVER), LoadSignal(28, 32, 6), RULES, now=100.0)
        assert not d.turn and d.reason == "holder_fits" and d.across is None
    assert wanted("plain", LoadSignal(26, 32, 6)) == "mtp"


def test_the_way_back_waits_until_the_load_has_stayed_low_for_the_confirmation():
    memory = Holding("plain", since=0.0)
    first = decide_turn(memory, LoadSignal(4, 32, 6), RULES, now=100.0)
    assert not first.turn and first.reason == "confirming"
    assert first.across is not None and first.across.since == 100.0
    memory = Holding("plain", since=0.0, across=first.across)
    assert not decide_turn(memory, LoadSignal(4, 32, 6), RULES, now=103.9).turn
    later = decide_turn(memory, LoadSignal(4, 32, 6), RULES, now=104.0)
    assert later.turn and later.to == "mtp" and later.reason == "load_below_crossover"


def test_a_load_that_comes_back_resets_the_confirmation():
    memory = Holding("plain", since=0.0, across=Across(since=100.0, at=100.0))
    back = decide_turn(memory, LoadSignal(40, 32, 6), RULES, now=102.0)
    assert not back.turn and back.across is None


def test_the_holder_keeps_the_memory_for_its_dwell_of_ten_turns():
    memory = Holding("plain", since=50.0, across=Across(since=50.0, at=50.0))
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
    slow = TurnRules(turn_cost_s=15.0, payback_turns=0)
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
    """What the caller keeps: no hand-over, no target, the reason, and since when the load
    crossed and what the holder forgoes (kept through the confirmation and the dwell, so the
    dwell's end needs no new crossing)."""
    load_low = LoadSignal(1, 32, 6)
    gain = RULES.gain("mtp", load_low)
    assert decide_turn(Holding("mtp"), load_low, RULES, now=1.0) == TurnDecision(
        False, None, "holder_fits", None)
    assert decide_turn(Holding("plain", since=0.0), load_low, RULES, now=100.0) == TurnDecision(
        False, None, "confirming", Across(since=100.0, at=100.0, forgone_s=0.0, gain=gain))
    memory = Holding("plain", since=50.0, across=Across(since=51.0, at=51.0, gain=gain))
    assert decide_turn(memory, load_low, RULES, now=60.0) == TurnDecision(
        False, None, "dwell", Across(since=51.0, at=60.0, forgone_s=pytest.approx(9 * gain), gain=gain))
    assert decide_turn(memory, load_low, RULES, now=65.0) == TurnDecision(
        True, "mtp", "load_below_crossover", None)


def test_the_dwell_of_a_turn_that_recomputes_nothing_is_ten_turns_of_its_own_cost():
    assert RULES.dwell() == 15.0
    assert RULES.dwell(cached_tokens=10_000) == pytest.approx(25.0)


def test_any_positive_prefill_rate_is_a_rule_and_the_refusal_says_what_is_wrong():
    assert TurnRules(prefill_tokens_per_s=0.5).turn_cost(cached_tokens=1) == pytest.approx(3.5)
    refusal = "^turn rules take non-negative times and a positive prefill rate and gain$"
    with pytest.raises(ValueError, match=refusal):
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


def test_a_turn_that_throws_away_no_warm_context_comes_as_soon_as_the_load_crosses():
    """Short prompts, or sessions whose contexts are not cached yet (a cold start): nothing to
    repay. The turn's own seconds and the streams it continues are the dwell's business."""
    load = LoadSignal(64, 32, 6)
    now = decide_turn(Holding("mtp"), load, PAYING, now=10.0, continued_tokens=500_000)
    assert now.turn and now.to == "plain" and now.reason == "load_above_crossover"


def test_a_turn_waits_until_the_holder_has_forgone_the_sessions_contexts_it_would_throw_away():
    """64 sessions at work against a crossover of 32: plain would add 0.5 x 33/32 of the
    machine's output; 48k tokens of warm contexts cost 3 s to prefill again on plain, so the
    turn comes after 3 / 0.516 = 5.8 s on MTP."""
    load = LoadSignal(64, 32, 6)
    gain = PAYING.gain("plain", load)
    assert gain == pytest.approx(0.5 * 33 / 32) and PAYING.price(cached_tokens=48_000) == pytest.approx(3.0)
    first = decide_turn(Holding("mtp"), load, PAYING, now=10.0, cached_tokens=48_000)
    assert not first.turn and first.reason == "paying_back"
    assert first.across is not None and first.across.repaid_at(3.0) == pytest.approx(10.0 + 3.0 / gain)
    early = decide_turn(Holding("mtp", across=first.across), load, PAYING, now=15.7, cached_tokens=48_000)
    assert not early.turn and early.reason == "paying_back"
    due = decide_turn(Holding("mtp", across=early.across), load, PAYING, now=15.9, cached_tokens=48_000)
    assert due.turn and due.to == "plain" and due.reason == "load_above_crossover"


def test_a_turn_that_throws_away_agent_sessions_contexts_waits_until_the_load_has_stayed_to_repay_it():
    """The agent day's mid-day turn: 48 sessions at work against a crossover of 48 and 868k
    tokens of their contexts to prefill again (54 s at 16k tokens/s): plain would add
    0.5 x 1/48 of the output, so the load must stay there for ~1.5 hours; at 64 sessions ~5 min."""
    price = PAYING.price(cached_tokens=868_000)
    assert price == pytest.approx(54.25)
    at_48 = decide_turn(Holding("mtp"), LoadSignal(48, 48, 6), PAYING, now=0.0, cached_tokens=868_000)
    assert at_48.reason == "paying_back" and at_48.across is not None
    assert at_48.across.repaid_at(price) == pytest.approx(price / (0.5 / 48))
    memory = Holding("mtp", across=Across(since=0.0, at=0.0, gain=PAYING.gain("plain", LoadSignal(64, 48))))
    held = decide_turn(memory, LoadSignal(64, 48, 6), PAYING, now=300.0, cached_tokens=868_000)
    assert not held.turn and held.reason == "paying_back"
    assert decide_turn(memory, LoadSignal(64, 48, 6), PAYING, now=307.0, cached_tokens=868_000).turn
    # the load went back under the crossover before then: nothing is owed any more
    gone = decide_turn(Holding("mtp", across=held.across), LoadSignal(30, 48, 6), PAYING, now=301.0)
    assert not gone.turn and gone.reason == "holder_fits" and gone.across is None


def test_what_the_holder_forgoes_accrues_at_the_gain_of_the_load_as_it_stood():
    low, high = LoadSignal(33, 32, 6), LoadSignal(64, 32, 6)
    first = decide_turn(Holding("mtp"), low, PAYING, now=0.0, cached_tokens=1_000_000)
    assert first.across is not None and first.across.gain == pytest.approx(0.5 * 2 / 32)
    second = decide_turn(Holding("mtp", across=first.across), high, PAYING, now=8.0, cached_tokens=1_000_000)
    assert second.across is not None and second.across.since == 0.0
    assert second.across.forgone_s == pytest.approx(8 * 0.5 * 2 / 32)  # not 8 x the new gain
    assert second.across.gain == pytest.approx(0.5 * 33 / 32)


def test_a_stored_context_costs_its_load_seconds_in_the_price_and_payback_scales_it():
    assert PAYING.price(cached_tokens=16_000, load_s=2.0) == pytest.approx(3.0)
    double = TurnRules(prefill_tokens_per_s=16_000, payback_turns=2)
    assert double.price(cached_tokens=16_000) == pytest.approx(2.0)
    assert TurnRules(payback_turns=0).price(cached_tokens=10**9) == 0.0


def test_the_gain_grows_with_the_distance_from_the_crossover_both_ways_and_is_at_most_the_machine():
    assert PAYING.gain("mtp", LoadSignal(0, 32, 6)) == pytest.approx(0.5)
    assert PAYING.gain("mtp", LoadSignal(24, 32, 6)) == pytest.approx(0.5 * 8 / 32)
    assert PAYING.gain("plain", LoadSignal(128, 32, 6)) == 1.0
    assert PAYING.gain("plain", LoadSignal(5, 1, 0)) == 1.0
    never = Across(since=0.0, at=0.0, forgone_s=0.0, gain=0.0)
    assert never.repaid_at(1.0) == math.inf and never.repaid_at(0.0) == 0.0


def test_no_payback_turns_as_soon_as_the_load_crosses_and_a_bad_gain_is_refused():
    at_once = TurnRules(turn_cost_s=1.5, min_dwell_s=0, dwell_turns=0, payback_turns=0)
    assert decide_turn(Holding("mtp"), LoadSignal(32, 32, 6), at_once, now=0.0).turn
    with pytest.raises(ValueError):
        TurnRules(gain_per_crossover=0)
    with pytest.raises(ValueError):
        TurnRules(payback_turns=-1)
