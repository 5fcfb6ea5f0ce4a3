"""The journal (gateway/turns/journal.py): what of a pair's memory state survives a restart.
Restarts mid-turn are walked in test_state.py."""

from __future__ import annotations

import logging
from pathlib import Path

from gateway.turns.discovery import discovered
from gateway.turns.journal import Journal, from_journal, journal
from gateway.turns.state import PairMemory, begin_turn, initial, sending, step_done
from gateway.upstream.engine.probe import Probe

READY = Probe(alive=True, ready=True, scheduler_answers=True)
PAUSED = Probe(alive=True, ready=False, scheduler_answers=True)


def releasing() -> PairMemory:
    """mtp holding, then a turn to plain up to its release, sent and not yet answered."""
    state = discovered(initial(0.0, {"mtp": "held", "plain": "released"}),
                       {"mtp": READY, "plain": PAUSED}, "mtp", 0.0)
    while state.phase == "settling":
        state = step_done(state, 0.0)
    state = begin_turn(state, "plain", 1.0)
    while state.step is not None and state.step.action != "release":
        state = step_done(state, 1.0)
    return sending(state)


def test_the_journal_says_each_servers_memory_and_the_step_in_doubt():
    assert journal(releasing()) == {"memory": {"mtp": "releasing", "plain": "released"},
                                    "phase": "handing", "step": "release(mtp)"}
    assert journal(initial(0.0))["step"] is None


def test_a_restart_reads_the_memory_back_and_discovers_from_it():
    restarted = from_journal(journal(releasing()), 10.0)
    assert restarted == initial(10.0, {"mtp": "releasing", "plain": "released"})
    assert (restarted.phase, restarted.since, restarted.step_since) == ("discovering", 10.0, 10.0)


def test_the_next_gateway_reads_what_this_one_wrote(tmp_path: Path):
    path = tmp_path / "turns.json"
    written = Journal(path)
    written.write("a", releasing())
    written.write("b", initial(0.0, {"mtp": "held", "plain": "released"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["turns.json"]  # replaced whole
    read = Journal(str(path))
    assert read.read("a") == journal(releasing())
    assert from_journal(read.read("b"), 5.0).of("mtp") == "held"
    assert read.read("c") is None


def test_without_a_file_the_journal_is_kept_in_memory_only(tmp_path: Path):
    for path in (None, ""):
        kept = Journal(path)
        assert kept.path is None and kept.read("a") is None
        kept.write("a", releasing())
        assert kept.read("a") == journal(releasing())
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_journal_is_nothing_known_and_said(tmp_path: Path, caplog):
    path = tmp_path / "turns.json"
    for text in ("{not json", "[1, 2]"):
        path.write_text(text, encoding="utf-8")
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="mtp_gateway.turns"):
            assert Journal(path).read("a") is None
        assert [r.getMessage() for r in caplog.records] == [
            f"turns journal {path} unreadable: starting with nothing known"]


def test_a_bad_journal_is_nothing_known():
    for data in (None, [], {"memory": {"mtp": "banana"}}, {"memory": 3}):
        assert dict(from_journal(data, 0.0).memory) == {"mtp": "unknown", "plain": "unknown"}
    assert from_journal({"memory": {"mtp": "hung"}}, 0.0).of("mtp") == "unknown"
