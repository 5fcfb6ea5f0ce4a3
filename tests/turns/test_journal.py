"""The journal (gateway/turns/journal.py): what of a pair's memory state survives a restart.
Restarts mid-turn are walked in test_state.py."""

from __future__ import annotations

from gateway.turns.journal import from_journal


def test_a_bad_journal_is_nothing_known():
    for data in (None, [], {"memory": {"mtp": "banana"}}, {"memory": 3}):
        assert dict(from_journal(data, 0.0).memory) == {"mtp": "unknown", "plain": "unknown"}
    assert from_journal({"memory": {"mtp": "hung"}}, 0.0).of("mtp") == "unknown"
