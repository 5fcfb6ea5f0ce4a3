"""`memory: auto`, the default, live: the gateway reads both servers' /server_info and takes
turns where both run with the memory saver, splits otherwise; it waits for a server that does
not answer yet, and never admits to a pair whose shape is undecided. Against the simulated pair
in both shapes, a server that does not report the field, the simulated vLLM pair with and without
sleep mode and dev mode, and the task alone (a split pair whose servers come back with the memory
saver)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import Backend, Routing, build_settings
from gateway.routing.backend import BackendState
from gateway.routing.pair import PairState
from gateway.sim.faults import Faults
from gateway.sim.server import SimOptions, start_sim_pair
from gateway.sim.vllm.app import VllmOptions
from gateway.turns.auto import AutoShape
from gateway.turns.shape import ShapeChoice
from gateway.upstream.engine.probe import SaverReport
from tests.conftest import LiveGateway
from tests.live import serve_app, wait_until
from tests.scripted import ScriptedBackend

ADMIN = {"authorization": "Bearer admin"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@contextlib.asynccontextmanager
async def auto_gateway(urls: dict[str, str], **sections: Any) -> AsyncIterator[LiveGateway]:
    """A gateway with the default `memory` (nothing said: auto) in front of `urls`."""
    settings = build_settings({"backends": {name: {"url": url} for name, url in urls.items()},
                               "monitor": {"interval_s": 0.05}, "auth": {"admin_key": "admin"},
                               "turns": {"check_memory": False}, "log": {"access": False},
                               **sections})
    assert settings.memory_of(settings.fleet()[0]) == "auto"
    app = create_app(settings, registry=CollectorRegistry())
    async with serve_app(app) as url:
        yield LiveGateway(app, url)


async def admin_state(gateway: LiveGateway) -> Any:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=5) as client:
        return (await client.get("/admin/state", headers=ADMIN)).json()["pairs"][0]


def shape(gateway: LiveGateway) -> str | None:
    return gateway.runtime.turns.shape_of("default").shape


@pytest.mark.timeout(30)
@pytest.mark.parametrize("memory, expected", [("turns", "turns"), ("split", "split")])
async def test_auto_takes_the_shape_the_simulated_servers_can(memory, expected):
    async with start_sim_pair(SimOptions(speed=200, memory=memory)) as pair, \
            auto_gateway(pair.urls) as gateway, httpx.AsyncClient(base_url=gateway.url) as client:
        answer = await client.post("/v1/chat/completions", json=CHAT, timeout=10)
        assert answer.status_code == 200
        state = await admin_state(gateway)
        assert state["memory_shape"]["setting"] == "auto"
        assert state["memory_shape"]["shape"] == expected == shape(gateway)
        if expected == "turns":  # the turns pair settled on MTP, which holds (plain is parked)
            assert answer.headers["x-gateway-backend"] == "mtp"
            assert "both servers run with --enable-memory-saver" in state["memory_shape"]["reason"]
            assert state["memory"]["holder"] == "mtp"
        else:
            assert "runs without --enable-memory-saver" in state["memory_shape"]["reason"]
            assert state["memory"] == {"phase": "split"}
            assert gateway.pool.pairs["default"].turns is None


@pytest.mark.timeout(30)
async def test_a_server_that_does_not_report_the_field_makes_the_pair_split():
    backends = {role: ScriptedBackend(role) for role in ("mtp", "plain")}
    async with serve_app(backends["mtp"].app) as mtp, serve_app(backends["plain"].app) as plain, \
            auto_gateway({"mtp": mtp, "plain": plain}) as gateway, \
            httpx.AsyncClient(base_url=gateway.url) as client:
        answer = await client.post("/v1/chat/completions", json=CHAT, timeout=10)
        assert answer.status_code == 200
        state = await admin_state(gateway)
        assert state["memory_shape"] == {
            "setting": "auto", "shape": "split",
            "reason": "auto: mtp does not say enable_memory_saver in /server_info; "
                      "plain does not say enable_memory_saver in /server_info"}


@pytest.mark.timeout(30)
async def test_a_server_not_answering_yet_is_waited_for_and_no_request_goes_anywhere_meanwhile():
    options = SimOptions(speed=200, memory="turns", faults={"mtp": Faults(refuse_connections=True)})
    async with start_sim_pair(options) as pair, \
            auto_gateway(pair.urls, turns={"wait_max_s": 20, "check_memory": False}) as gateway, \
            httpx.AsyncClient(base_url=gateway.url) as client:
        # plain (parked, paused) answers with the memory saver on; mtp does not answer
        await wait_until(lambda: gateway.runtime.turns.auto["default"].reports["plain"] == "on")
        state = await admin_state(gateway)
        assert state["memory"]["phase"] == "deciding" and state["memory_shape"]["shape"] is None
        assert "waiting for mtp to answer /server_info" in state["memory_shape"]["reason"]
        waiting = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, timeout=25))
        await wait_until(lambda: gateway.runtime.turns.waiting.waiting == 1)
        # not sent to the parked plain server, where it would wait for the next turn
        assert pair.servers["plain"].live.engine.num_running == 0
        assert gateway.runtime.pool.concurrency == 0
        await pair.servers["mtp"].clear_faults()  # it comes up: the pair is decided, and turns
        answer = await waiting
        assert answer.status_code == 200 and answer.headers["x-gateway-backend"] == "mtp"
        assert shape(gateway) == "turns"


@pytest.mark.timeout(30)
async def test_while_neither_server_answers_a_request_is_refused_at_once():
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens
    async with auto_gateway({"mtp": closed, "plain": closed}) as gateway, \
            httpx.AsyncClient(base_url=gateway.url) as client:
        answer = await client.post("/v1/chat/completions", json=CHAT, timeout=5)
        assert answer.status_code == 503 and "error" in answer.json()
        assert gateway.runtime.turns.waiting.waiting == 0  # nothing to wait for
        assert shape(gateway) is None


# --- a vLLM pair: sleep mode and dev mode, read from dev mode's /server_info -------------------

VLLM_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}  # the served model


@pytest.mark.timeout(30)
@pytest.mark.parametrize("memory, dev_mode, sleep_mode, expected, reason", [
    # compose.vllm-turns.yaml's servers: plain asleep, MTP awake
    ("turns", True, None, "turns", "both servers run with --enable-sleep-mode in dev mode"),
    # both resident, both able to sleep: the gateway settles them (one sleeps) and takes turns
    ("split", True, True, "turns", "both servers run with --enable-sleep-mode in dev mode"),
    # dev mode without sleep mode: /sleep would free nothing
    ("split", True, False, "split", "mtp runs without --enable-sleep-mode; "
                                    "plain runs without --enable-sleep-mode"),
    # compose.vllm.yaml's servers: no dev mode, so no /server_info, /sleep or /wake_up
    ("split", False, None, "split", "mtp serves no /server_info"),
    ("split", False, True, "split", "plain serves no /server_info"),
])
async def test_auto_on_a_vllm_pair_takes_turns_only_with_sleep_mode_and_dev_mode(
        memory, dev_mode, sleep_mode, expected, reason):
    options = SimOptions(speed=200, memory=memory, engine="vllm",
                         vllm=VllmOptions(dev_mode=dev_mode, enable_sleep_mode=sleep_mode))
    async with start_sim_pair(options) as pair, auto_gateway(pair.urls, engine="vllm") as gateway, \
            httpx.AsyncClient(base_url=gateway.url) as client:
        answer = await client.post("/v1/chat/completions", json=VLLM_CHAT, timeout=10)
        assert answer.status_code == 200
        state = await admin_state(gateway)
        assert state["memory_shape"]["shape"] == expected == shape(gateway)
        assert reason in state["memory_shape"]["reason"]
        if expected == "turns":  # one server awake, the other asleep, whatever the start
            assert answer.headers["x-gateway-backend"] == state["memory"]["holder"] == "mtp"
            asleep = {role: (await client.get(url + "/is_sleeping")).json()["is_sleeping"]
                      for role, url in pair.urls.items()}
            assert asleep == {"mtp": False, "plain": True}
        else:
            assert state["memory"] == {"phase": "split"}


# --- the task alone: a split pair whose servers come back with the memory saver ---------------

class Turns:
    """What take_turns installs, counted; its run() returns at once."""

    def __init__(self) -> None:
        self.taken = 0

    def __call__(self) -> Turns:
        self.taken += 1
        return self

    async def run(self) -> None:
        return None


class Ticks:
    """The task's interval, counted: each call is one more round of its loop."""

    def __init__(self) -> None:
        self.rounds = 0

    def __call__(self) -> float:
        self.rounds += 1
        return 0.001

    async def passed(self, rounds: int) -> None:
        """Until the task has been round its loop `rounds` more times."""
        start = self.rounds
        await wait_until(lambda: self.rounds >= start + rounds)


def split_pair() -> tuple[PairState, dict[str, SaverReport], Turns, list[ShapeChoice], Ticks,
                          AutoShape]:
    backends = {role: BackendState(role, "default", role, Backend(url=f"http://{role}"))
                for role in ("mtp", "plain")}
    pair = PairState("default", Routing(), backends)  # type: ignore[arg-type]
    reports: dict[str, SaverReport] = {"mtp": "on", "plain": "off"}

    async def read(role: str) -> SaverReport:
        return reports[role]

    turns, decided, ticks = Turns(), [], Ticks()
    auto = AutoShape(pair, read, turns, decided.append, ticks)
    pair.turns = auto
    return pair, reports, turns, decided, ticks, auto


@pytest.mark.timeout(10)
async def test_a_split_pair_turns_when_its_servers_come_back_with_the_saver_and_nothing_runs():
    pair, reports, turns, decided, ticks, auto = split_pair()
    assert all(b.parked for b in pair.backends.values())  # undecided: neither admitted to
    task = asyncio.create_task(auto.run())
    try:
        await wait_until(lambda: len(decided) == 1)
        assert decided[0].shape == "split" and pair.turns is None
        assert not any(b.parked for b in pair.backends.values())
        reports["plain"] = "on"  # restarted with the memory saver, but not seen down: split
        await ticks.passed(2)
        assert turns.taken == 0
        plain = pair.backends["plain"]
        plain.up = False  # the monitor saw it go ...
        await ticks.passed(2)
        plain.inflight = 1  # ... and come back while a request runs on the pair: not yet
        plain.up = True
        await ticks.passed(3)
        assert turns.taken == 0 and pair.turns is None
        plain.inflight = 0  # nothing in flight: its settling may release a server now
        await wait_until(lambda: turns.taken == 1)
        await task
        assert [choice.shape for choice in decided] == ["split", "turns"]
    finally:
        task.cancel()
