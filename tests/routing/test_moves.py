"""gateway.routing.policy.choose_moves: which unstarted requests a flip moves, the one rule the relay
and the bench share."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.routing.policy import choose_moves

ARRIVALS = st.lists(st.integers(), unique=True, max_size=30)


@given(ARRIVALS, st.integers(min_value=-5, max_value=40))
def test_the_newest_requests_move_in_arrival_order(unstarted: list[int], count: int) -> None:
    moved = choose_moves(unstarted, count)
    expected = max(0, min(count, len(unstarted)))
    assert len(moved) == expected
    # the newest ones: a suffix of the arrivals, so their order is kept
    assert moved == unstarted[len(unstarted) - expected:]


def test_the_oldest_stay_where_they_may_be_prefilling() -> None:
    assert choose_moves(["a", "b", "c", "d"], 2) == ["c", "d"]
    assert choose_moves(["a", "b"], 5) == ["a", "b"]
    assert choose_moves(["a", "b", "c"], 1) == ["c"]


def test_nothing_moves_when_none_is_asked_for() -> None:
    assert choose_moves(["a", "b"], 0) == []
    assert choose_moves(["a", "b"], -1) == []
    assert choose_moves([], 3) == []


def test_the_callers_sequence_is_left_as_it_was() -> None:
    unstarted = ["a", "b", "c"]
    moved = choose_moves(unstarted, 3)
    moved.pop()
    assert unstarted == ["a", "b", "c"]
