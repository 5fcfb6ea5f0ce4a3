"""A turns pair, live on loopback, against a fake of SGLang's memory saver (tests/turns/
fake_pair.py): a turn each way, and each step failing or timing out. Whatever happens, the
pair ends serving on one server, never both hold the memory, no fake server dies of the
gateway's calls, every stream ends whole or with an error in its API's shape, and in-flight
returns to 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import build_settings
from tests.live import serve_app, wait_until
from tests.turns.fake_pair import Device, FakeServer, fake_pair

CROSSOVER = 3
ROUTING = {"crossover": CROSSOVER, "hysteresis": 2, "min_dwell_s": 0.3, "load_signal": "requests",
           "adaptive_crossover": False, "adapt_to_accept_length": False}
TURNS = {"finish_within_s": 5, "call_timeout_s": 1, "release_timeout_s": 1,
         "resume_timeout_s": 1, "ready_within_s": 2, "wait_max_s": 20, "stuck_retry_s": 0.2,
         "check_memory": False, "dwell_turns": 0, "to_mtp_after_s": 0.3,
         "payback_turns": 0}


@contextlib.asynccontextmanager
async def gateway(urls: dict[str, str], *, monitor: dict[str, Any] | None = None,
                  stock_uvicorn: bool = False, **turns: Any) -> AsyncIterator[tuple[Any, str]]:
    settings = build_settings({
        "backends": {role: {"url": url} for role, url in urls.items()}, "memory": "turns",
        "routing": ROUTING, "turns": {**TURNS, **turns},
        "monitor": {"interval_s": 0.05, **(monitor or {})},
        # the fake serves no continuation (no /tokenize, no splice-able answer): running
        # streams finish first here; the hand-off at a turn is tested on the simulator
        "handoff": {"at_turn": False}, "log": {"access": False}})
    app = create_app(settings, registry=CollectorRegistry())
    async with serve_app(app, stock_uvicorn=stock_uvicorn) as url:
        yield app.state.runtime, url


def driver(runtime: Any) -> Any:
    return runtime.turns.drivers["default"]


async def holding(runtime: Any, role: str, timeout: float = 10) -> None:
    await wait_until(lambda: driver(runtime).state.phase == "holding"
                     and driver(runtime).state.holder == role, timeout=timeout)


async def stream(client: httpx.AsyncClient, tokens: int = 30) -> str:
    """One chat stream read to its end: 'whole', or the error it ended with."""
    body = {"model": "m", "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        text = (await response.aread()).decode()
    if response.status_code != 200:
        error = json.loads(text)["error"]  # OpenAI's shape
        if response.status_code == 503:  # a turn's: retry shortly
            assert response.headers.get("retry-after"), text
        return f"{response.status_code} {error['code']}"
    if text.rstrip().endswith("data: [DONE]") and text.count('"finish_reason": "stop"') == 1:
        assert text.count("w0 ") == 1 and f"w{tokens - 1} " in text, text  # nothing lost
        return "whole"
    match = re.search(r'data: (\{"error".*\})', text)
    assert match, f"a stream ended without an error: {text[-300:]}"
    return "error " + json.loads(match.group(1))["error"]["code"]


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
        elif wanted == "" and line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def load_then_quiet(client: httpx.AsyncClient, burst: int) -> list[str]:
    """`burst` streams at once (the load crosses the crossover), then one alone."""
    results = await asyncio.gather(*(stream(client) for _ in range(burst)))
    return [*results, await stream(client)]


def assert_safe(device: Device, servers: dict[str, FakeServer], runtime: Any) -> None:
    assert device.most_holders == 1, "both servers held the memory at once"
    assert device.deaths == [], device.deaths
    assert runtime.pool.concurrency == 0
    for server in servers.values():  # exactly once each, in SGLang's shape
        assert all(call in ("pause:retract", 'release:{"tags": null}', 'resume:{"tags": null}',
                            "continue") for call in server.calls), server.calls


@pytest.mark.timeout(40)
async def test_a_turn_each_way_keeps_every_stream_whole(caplog):
    caplog.set_level(logging.INFO, logger="mtp_gateway.turns")
    async with fake_pair("mtp") as (device, servers, urls), gateway(urls) as (runtime, url):
        await holding(runtime, "mtp")
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            first = asyncio.gather(*(stream(client) for _ in range(6)))
            await wait_until(lambda: driver(runtime).state.phase == "handing", timeout=10)
            during = asyncio.gather(*(stream(client) for _ in range(3)))  # they wait for it
            assert await first == await during + ["whole"] * 3 == ["whole"] * 6
            await holding(runtime, "plain")
            # those on mtp finished there or (unstarted) moved; those that waited: plain
            assert servers["plain"].served >= 3
            assert servers["plain"].served + servers["mtp"].served == 9
            assert servers["mtp"].calls == ["pause:retract", 'release:{"tags": null}']
            assert servers["plain"].calls == ['resume:{"tags": null}', "continue"]
            # quiet again: a request on plain flips the mode back; the memory follows
            assert await stream(client) == "whole"
            await holding(runtime, "mtp")
            assert await stream(client) == "whole"
            metrics = (await client.get("/metrics")).text
            state = (await client.get("/dashboard/state")).json()
        assert metric(metrics, "gateway_memory_turns_total", outcome="done") == 2
        assert metric(metrics, "gateway_memory_holder", backend="mtp") == 1
        assert metric(metrics, "gateway_memory_turn_step_seconds_count", step="release") == 2
        assert state["pairs"][0]["memory"]["holder"] == "mtp"
        assert state["pairs"][0]["memory"]["turns"] == 2
        assert_safe(device, servers, runtime)
    # a clean turn is the pair's normal work: said at INFO, nothing an operator's alert on
    # warnings would page for
    turns_said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "mtp_gateway.turns"]
    assert any("memory handed to plain" in message for _, message in turns_said)
    assert [m for level, m in turns_said if level >= logging.WARNING] == []


@pytest.mark.timeout(40)
async def test_a_turn_lets_the_outgoing_server_write_its_prefix_cache_before_releasing_it():
    """With HiCache, the source stays idle and unpaused until its caches are in its store: a
    release while its device-to-host copies run would kill it, and a paused server writes
    nothing more. (The quiet window is widened past the fake's copy times for a loaded box.)"""
    async with fake_pair("mtp", hicache=True) as (device, servers, urls), \
            gateway(urls, caches_quiet_s=1.0) as (runtime, url):
        await holding(runtime, "mtp")
        held: set[str] = set()  # plain may hand back before the quiet stream ends: note each holder

        async def note_holders() -> None:
            while True:
                if driver(runtime).state.phase == "holding":
                    held.add(driver(runtime).state.holder)
                await asyncio.sleep(0.005)

        noting = asyncio.create_task(note_holders())
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            assert await load_then_quiet(client, CROSSOVER + 1) == ["whole"] * (CROSSOVER + 2)
            await wait_until(lambda: "plain" in held, timeout=10)
            await holding(runtime, "mtp")
            metrics = (await client.get("/metrics")).text
        noting.cancel()
        assert sum(server.host_backups for server in servers.values()) > 0
        for server in servers.values():  # everything copied to host reached the store
            assert (server.store_backups, server.lost_backups) == (server.host_backups, 0)
        assert metric(metrics, "gateway_memory_turn_step_seconds_count", step="keep_caches") == 2
        assert_safe(device, servers, runtime)


FAILURES = [  # (server, step, fault, the holder after, the failure's kind on /metrics)
    ("mtp", "pause", "error", "mtp", "error"),
    ("mtp", "release", "error", "mtp", "error"),
    ("mtp", "release", "hang", None, "timeout"),  # stuck until it answers, then either
    ("plain", "resume", "error", "mtp", "error"),
    ("plain", "resume", "hang", "mtp", "timeout"),
    ("plain", "continue", "error", "plain", "error"),
    ("mtp", "pause", "die", "plain", "error"),
    ("plain", "resume", "die", "mtp", "error"),
]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("server,step,fault,after,kind", FAILURES,
                         ids=[f"{s}-{st}-{f}" for s, st, f, _, _ in FAILURES])
async def test_a_step_failing_leaves_the_pair_serving_on_one_server(server, step, fault, after,
                                                                    kind):
    async with fake_pair("mtp") as (device, servers, urls), gateway(urls) as (runtime, url):
        await holding(runtime, "mtp")
        servers[server].faults[step] = fault
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            burst = asyncio.gather(*(stream(client) for _ in range(5)))
            if after is None:  # the release hangs: the pair waits, then the release answers
                await wait_until(lambda: driver(runtime).state.phase == "stuck", timeout=10)
                servers[server].hang.set()
            results = await burst
            if after is None:
                await wait_until(lambda: driver(runtime).state.phase == "holding", timeout=10)
            else:
                await holding(runtime, after)
            assert await stream(client) == "whole"  # and it serves
            metrics = (await client.get("/metrics")).text
        # a server dying under a request fails it (502, or an error event), in its API's shape
        assert all(r == "whole" or r.startswith(("error", "50")) for r in results), results
        assert metric(metrics, "gateway_memory_turn_failures_total", step=step, kind=kind) == 1
        assert metric(metrics, "gateway_memory_turns_total", outcome="failed") >= 1
        assert device.most_holders == 1
        assert [d for d in device.deaths if "injected" not in d] == [], device.deaths
        assert runtime.pool.concurrency == 0
        if fault == "hang":
            servers[server].hang.set()


@pytest.mark.timeout(40)
async def test_a_gateway_restarted_mid_release_settles_from_its_journal(tmp_path: Path):
    journal = tmp_path / "turns.json"
    async with fake_pair("mtp") as (device, servers, urls):
        servers["mtp"].faults["release"] = "hang"
        async with gateway(urls, state_file=str(journal), release_timeout_s=30) as (runtime, url):
            await holding(runtime, "mtp")
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                burst = asyncio.gather(*(stream(client) for _ in range(5)),
                                       return_exceptions=True)
                await wait_until(lambda: str(driver(runtime).state.step) == "release(mtp)",
                                 timeout=10)
                assert json.loads(journal.read_text())["pairs"]["default"]["memory"] == {
                    "mtp": "releasing", "plain": "released"}
            # the gateway goes down with the release unanswered; the release then finishes
        servers["mtp"].hang.set()
        burst.cancel()
        async with gateway(urls, state_file=str(journal)) as (runtime, url):
            await holding(runtime, "mtp")  # released, then resumed: the fresh mode is MTP's
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                assert await stream(client) == "whole"
        assert servers["mtp"].calls == ["pause:retract", 'release:{"tags": null}',
                                        'resume:{"tags": null}', "continue"]
        assert servers["plain"].calls == []
        assert device.most_holders == 1 and device.deaths == []


@pytest.mark.timeout(30)
async def test_a_gateway_started_beside_a_parked_pair_finds_the_holder():
    async with fake_pair("plain") as (device, servers, urls), gateway(urls) as (runtime, url):
        await holding(runtime, "plain")
        assert servers["plain"].calls == servers["mtp"].calls == []  # nothing to change
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            assert await stream(client) == "whole"
        assert device.deaths == []


@pytest.mark.timeout(40)
async def test_a_replica_follows_the_controllers_turn_and_hands_off_its_own_streams():
    async with fake_pair("mtp") as (device, servers, urls), \
            gateway(urls) as (controller, controller_url):
        await holding(controller, "mtp")
        async with gateway(urls, controller_url=controller_url) as (replica, replica_url):
            follower = driver(replica)
            await wait_until(lambda: follower.admitting == "mtp", timeout=10)
            async with httpx.AsyncClient(base_url=replica_url, timeout=20) as via_replica, \
                    httpx.AsyncClient(base_url=controller_url, timeout=20) as via_controller:
                long_ones = [asyncio.create_task(stream(via_replica, tokens=120)) for _ in range(2)]
                await wait_until(lambda: servers["mtp"].running == 2, timeout=10)
                burst = asyncio.gather(*(stream(via_controller) for _ in range(4)))
                await wait_until(lambda: follower.phase == "handing", timeout=10)
                assert follower.admitting is None
                during = asyncio.gather(*(stream(via_replica) for _ in range(2)))
                assert await asyncio.gather(*long_ones) == ["whole"] * 2  # finished first
                assert await burst == ["whole"] * 4 and await during == ["whole"] * 2
                await holding(controller, "plain")
                await wait_until(lambda: follower.admitting == "plain", timeout=10)
                assert servers["mtp"].calls == ["pause:retract", 'release:{"tags": null}']
                assert await stream(via_replica) == "whole"
                state = (await via_replica.get("/dashboard/state")).json()
            assert state["pairs"][0]["memory"]["following"].startswith(controller_url)
            assert replica.pool.concurrency == 0
    assert device.most_holders == 1 and device.deaths == []


@pytest.mark.timeout(40)
async def test_a_replica_whose_controller_is_gone_follows_the_servers_readiness():
    async with fake_pair("plain") as (device, servers, urls):
        async with gateway(urls) as (controller, controller_url):
            await holding(controller, "plain")
        # the controller is gone: the replica admits to the one server answering /ready 200
        async with gateway(urls, controller_url=controller_url) as (replica, replica_url):
            follower = driver(replica)
            await wait_until(lambda: follower.admitting == "plain", timeout=10)
            assert follower.describe()["via"] == "readiness"
            async with httpx.AsyncClient(base_url=replica_url, timeout=20) as client:
                assert await stream(client) == "whole"
        assert servers["mtp"].calls == servers["plain"].calls == []  # a follower never calls


@pytest.mark.timeout(40)
async def test_arrivals_past_the_waiting_rooms_bounds_get_a_503_in_their_apis_shape():
    async with fake_pair("mtp") as (device, servers, urls), \
            gateway(urls, wait_max_requests=1, wait_max_s=1, release_timeout_s=30) as (runtime, url):
        await holding(runtime, "mtp")
        servers["mtp"].faults["release"] = "hang"  # a long turn
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            burst = asyncio.gather(*(stream(client) for _ in range(4)))
            await wait_until(lambda: str(driver(runtime).state.step) == "release(mtp)", timeout=10)
            body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            waited = asyncio.create_task(client.post("/v1/messages", json=body))
            await wait_until(lambda: runtime.turns.waiting.waiting == 1, timeout=5)
            full = await client.post("/v1/messages", json=body)  # the room holds one
            late = await waited  # waited turns.wait_max_s
            metrics = (await client.get("/metrics")).text
            servers["mtp"].hang.set()
            assert await burst == ["whole"] * 4
            await holding(runtime, "plain")
        for answer, why in ((full, "1 requests already wait"), (late, "waited 1 s")):
            assert answer.status_code == 503 and answer.headers["retry-after"] == "2"
            error = answer.json()
            assert error["type"] == "error", error  # Anthropic's envelope
            assert error["error"]["type"] == "overloaded_error", error
            assert why in error["error"]["message"], error
        assert metric(metrics, "gateway_rejected_total", reason="memory_turn") == 2
        assert runtime.pool.concurrency == 0 and device.deaths == []


def open_circuit(runtime: Any, role: str) -> None:
    """The holder's circuit opened, as monitor.circuit_failures failures in a row open it."""
    backend = runtime.pool.backends[role]
    while not backend.circuit_failure(time.monotonic()):
        pass


@pytest.mark.timeout(30)
async def test_arrivals_while_the_holders_circuit_is_open_wait_for_its_trial_and_are_served():
    async with fake_pair("mtp") as (device, servers, urls), \
            gateway(urls, monitor={"circuit_open_s": 0.5}) as (runtime, url):
        await holding(runtime, "mtp")
        holder, waiting = runtime.pool.backends["mtp"], runtime.turns.waiting
        open_circuit(runtime, "mtp")
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            first = asyncio.create_task(stream(client, tokens=500))  # ~2 s on the fake
            await wait_until(lambda: waiting.waiting == 1, timeout=5)  # not refused: it waits
            await wait_until(lambda: holder.circuit.trial_in_flight, timeout=5)  # half-open: the trial
            behind = asyncio.create_task(stream(client))
            await wait_until(lambda: waiting.waiting == 1, timeout=5)  # one trial at a time
            assert not behind.done()
            assert await first == "whole" and await behind == "whole"
        assert holder.circuit.open_until is None  # the trial's success closed it
        assert driver(runtime).state.holder == "mtp" and waiting.waiting == 0
        assert runtime.pool.concurrency == 0 and device.deaths == []


@pytest.mark.timeout(30)
async def test_arrivals_waiting_past_the_circuit_bound_get_a_503_in_their_apis_shape():
    async with fake_pair("mtp") as (device, servers, urls), \
            gateway(urls, wait_circuit_max_s=0.3, monitor={"circuit_open_s": 30}) as (runtime, url):
        await holding(runtime, "mtp")
        open_circuit(runtime, "mtp")
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            # One at a time: three waiting would reach the crossover, and the pair turn to plain.
            messages = await client.post("/v1/messages", json=body)
            chat = await client.post("/v1/chat/completions", json=body)
            native = await client.post("/generate", json={"text": "hi",
                                                          "sampling_params": {"max_new_tokens": 8}})
            metrics = (await client.get("/metrics")).text
        for answer in (messages, chat, native):
            assert answer.status_code == 503 and answer.headers["retry-after"] == "5", answer.text
        error = messages.json()  # Anthropic's envelope
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error", error
        assert "waited 0.3 s" in error["error"]["message"], error
        for openai_shaped in (chat.json()["error"], native.json()["error"]):  # OpenAI's (and SGLang's)
            assert openai_shaped["code"] == "no_backend_available", openai_shaped
            assert "waited 0.3 s" in openai_shaped["message"], openai_shaped
        assert metric(metrics, "gateway_rejected_total", reason="no_backend") == 3
        assert runtime.turns.waiting.waiting == 0 and runtime.pool.concurrency == 0
        assert driver(runtime).state.holder == "mtp" and servers["mtp"].served == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stock_uvicorn", [False, True], ids=["gateway_protocol", "stock_uvicorn"])
async def test_a_client_leaving_while_it_waits_for_the_circuit_frees_its_place(stock_uvicorn: bool):
    async with fake_pair("mtp") as (device, servers, urls), \
            gateway(urls, stock_uvicorn=stock_uvicorn, monitor={"circuit_open_s": 30}) as (runtime, url):
        await holding(runtime, "mtp")
        holder, waiting = runtime.pool.backends["mtp"], runtime.turns.waiting
        open_circuit(runtime, "mtp")
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            leaving = asyncio.create_task(stream(client))
            await wait_until(lambda: waiting.waiting == 1, timeout=5)
            leaving.cancel()  # the client closes its connection
            await wait_until(lambda: waiting.waiting == 0, timeout=5)  # not after the 30 s bound
            assert runtime.pool.concurrency == 0 and holder.inflight == 0
            holder.circuit_success()  # closed again: the gateway serves on
            assert await stream(client) == "whole"
        assert runtime.pool.concurrency == 0 and servers["mtp"].served == 1


@pytest.mark.timeout(30)
async def test_mtp_resumed_with_drafts_that_no_longer_pay_serves_and_says_so():
    async with fake_pair("plain", accept_length=1.0) as (device, servers, urls), \
            gateway(urls) as (runtime, url):
        await holding(runtime, "plain")  # quiet: the memory goes to MTP, whose drafts fail
        await wait_until(lambda: driver(runtime).state.speculation_lost, timeout=10)
        await holding(runtime, "mtp")  # it still serves: correct answers, only slower
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            assert await stream(client) == "whole"
            metrics = (await client.get("/metrics")).text
        assert metric(metrics, "gateway_memory_turns_total", outcome="done_speculation_lost") == 1
        assert metric(metrics, "gateway_memory_turn_failures_total", step="check_speculation",
                      kind="check") == 1
        assert "sglang #31674" in driver(runtime).describe()["last_failure"]["detail"]


@pytest.mark.timeout(30)
async def test_a_speculation_check_whose_request_fails_leaves_mtp_wished_for_again():
    async with fake_pair("plain") as (device, servers, urls), gateway(urls) as (runtime, url):
        servers["mtp"].faults["generate"] = "error"  # the check's one /generate answers 400
        await holding(runtime, "mtp")  # quiet: the memory goes to MTP; its check fails
        assert not driver(runtime).state.speculation_lost
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            # the load: plain (long enough streams that the driver's tick sees it)
            load = asyncio.gather(*(stream(client, tokens=200) for _ in range(6)))
            await holding(runtime, "plain")
            assert await load == ["whole"] * 6
            assert await stream(client) == "whole"  # quiet again: MTP, its drafts not in doubt
            await holding(runtime, "mtp")
            metrics = (await client.get("/metrics")).text
        assert metric(metrics, "gateway_memory_turns_total", outcome="done") == 3
        assert metric(metrics, "gateway_memory_turns_total", outcome="done_speculation_lost") == 0
        assert metric(metrics, "gateway_memory_turn_failures_total", step="check_speculation",
                      kind="error") == 1
        assert_safe(device, servers, runtime)
