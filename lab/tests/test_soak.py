"""The soak's turns checks (lab/scripts/soak.py --memory turns): when a server may be taken down
without the simulated device's ledger lying, the watch on the ledger, and the verdict on every
turn begun. The soak itself is not run here (ten minutes of wall clock, not deterministic)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gateway.sim.saver import ALL_TAGS
from gateway.sim.server import SimOptions, start_sim_pair

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = load_soak()


@pytest.mark.timeout(30)
async def test_only_a_released_server_whose_partner_has_not_begun_a_release_may_go_down():
    async with start_sim_pair(SimOptions(speed=50, memory="turns")) as pair:
        mtp, plain = pair.servers["mtp"].saver, pair.servers["plain"].saver
        assert soak.holds_nothing(pair, "plain") and not soak.holds_nothing(pair, "mtp")
        await mtp.pause("retract")
        release = asyncio.create_task(mtp.release(ALL_TAGS))
        while not mtp.state.released:
            await asyncio.sleep(0.001)
        # MTP's release has begun: plain's resume may be on its way, so plain no longer counts
        # as holding nothing (taking it down now could leave it holding on the ledger)
        assert not soak.holds_nothing(pair, "plain") and not soak.holds_nothing(pair, "mtp")
        await release
        await plain.resume(ALL_TAGS)
        assert soak.holds_nothing(pair, "mtp") and not soak.holds_nothing(pair, "plain")


@pytest.mark.timeout(30)
async def test_the_overlap_watch_sees_both_servers_holding():
    async with start_sim_pair(SimOptions(speed=50, memory="turns")) as pair:
        overlap = soak.Overlap(pair)
        device = pair.servers["plain"].saver.device
        device.hold("plain", "weights", 1.0)
        assert overlap.most == 2


def report(log: str, metrics: str) -> dict[str, bool]:
    memory = {"phase": "holding", "holder": "plain", "memory": {"mtp": "released", "plain": "held"}}
    journal = {"phase": "holding", "memory": {"mtp": "released", "plain": "held"}}
    sim = {"mtp": {"status": "serving"}, "plain": {"status": "serving"}}
    _, checks = soak.turns_report(soak.Tally(), memory, journal, 1, sim, log, metrics, 2)
    return checks


def test_a_turn_begun_without_an_outcome_fails_the_soak():
    log = ("pair default: handing the memory mtp -> plain\npair default: memory handed to plain\n"
           "pair default: handing the memory plain -> mtp\npair default: memory handed to mtp\n")
    done = 'gateway_memory_turns_total{outcome="%s",pair="default"} %s\n'
    both = report(log, done % ("done", "1.0") + done % ("failed", "1.0"))
    one = report(log, done % ("done", "1.0"))
    assert all(both.values())
    assert [name for name, ok in one.items() if not ok] == [
        "every turn begun ended in an outcome (2 begun, 1 ended)"]
