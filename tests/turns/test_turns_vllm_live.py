"""A vLLM turns pair, live on loopback: the simulated vLLM 0.33.0 pair in the turns shape (one
device, sleep mode under dev mode, gateway/sim/vllm/sleep.py) behind a gateway with
`engine: vllm` and `memory: turns`. The memory is handed over both ways by one `sleep` (level
1) and one `wake_up`; every stream ends whole; at no instant do both servers hold their weights
or KV cache; in-flight returns to 0. Each sleep and wake failing or hanging ends with the pair
serving on one server and the failure on /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from gateway.sim.vllm.app import VllmOptions
from gateway.sim.vllm.sleep import WAKE_OOM, WakeFailed
from tests.conftest import LiveGateway
from tests.live import serve_app, wait_until
from tests.turns.test_driver_live import metric
from tests.turns.test_turns_sim_live import LEVELS, ROUTING, SERVED, TURNS, Overlap, memory_of, openai_stream


@contextlib.asynccontextmanager
async def vllm_turns_demo(speed: float = 200, **turns: Any
                          ) -> AsyncIterator[tuple[SimPair, LiveGateway, Overlap]]:
    """What `mtp-gateway demo --engine vllm --memory turns` runs, on port 0."""
    options = SimOptions(speed=speed, memory="turns", engine="vllm", vllm=VllmOptions(dev_mode=True))
    async with start_sim_pair(options) as pair:
        overlap = Overlap(pair)
        settings = build_settings({
            "backends": {name: {"url": url} for name, url in pair.urls.items()},
            "engine": "vllm", "memory": "turns", "routing": ROUTING, "turns": {**TURNS, **turns},
            "monitor": {"interval_s": 0.05}, "log": {"access": False}})
        app = create_app(settings, registry=CollectorRegistry())
        async with serve_app(app) as url:
            yield pair, LiveGateway(app, url), overlap


async def anthropic_stream(client: anthropic.AsyncAnthropic) -> str:
    """vLLM answers 404 to a name it does not serve (an agent's claude-* default): the served one."""
    async with client.messages.stream(model=SERVED, max_tokens=24, messages=[
            {"role": "user", "content": "say something"}]) as stream:
        message = await stream.get_final_message()
    assert message.stop_reason in ("end_turn", "max_tokens"), message.stop_reason
    assert message.content and message.content[-1].type == "text" and message.content[-1].text
    return "whole"


def sleeping(pair: SimPair) -> dict[str, bool]:
    return {name: server.sleep_mode.state.is_sleeping  # type: ignore[union-attr]
            for name, server in pair.servers.items()}


@pytest.mark.timeout(60)
async def test_the_vllm_turns_demo_under_a_ramp_hands_the_memory_over_both_ways():
    async with vllm_turns_demo() as (pair, gateway, overlap):
        await wait_until(lambda: memory_of(gateway).phase == "holding", timeout=10)
        assert memory_of(gateway).holder == "mtp"  # the sim puts plain to sleep, MTP on top
        assert memory_of(gateway).of("plain") == "released"  # /is_sleeping says so
        oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="x", max_retries=0)
        results: list[str] = []
        held_plain = False
        for level in LEVELS:
            streams = [openai_stream(oai) if i % 2 else anthropic_stream(claude)
                       for i in range(level * 2)]
            results += await asyncio.gather(*streams)
            held_plain |= memory_of(gateway).holder == "plain"
        deadline = time.monotonic() + 10  # quiet: one stream at a time until MTP holds again
        while memory_of(gateway).holder != "mtp" or memory_of(gateway).phase != "holding":
            assert time.monotonic() < deadline, "the memory did not come back to MTP"
            results.append(await openai_stream(oai))
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            metrics = (await client.get("/metrics")).text
        assert results == ["whole"] * len(results)
        assert held_plain and overlap.held_by == {"mtp", "plain"}
        assert overlap.most == 1, "both servers held their weights or KV cache at once"
        assert metric(metrics, "gateway_memory_turns_total", outcome="done") >= 2
        assert metric(metrics, "gateway_memory_turn_step_seconds_count", step="sleep") >= 2
        assert metric(metrics, "gateway_memory_turn_step_seconds_count", step="wake_up") >= 2
        for step in ("pause", "release", "resume", "continue", "keep_caches"):  # SGLang's calls
            assert metric(metrics, "gateway_memory_turn_step_seconds_count", step=step) == 0
        assert sleeping(pair) == {"mtp": False, "plain": True}
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)


@pytest.mark.timeout(60)
async def test_running_streams_finish_on_the_outgoing_server_before_it_sleeps():
    """No hand-off on vLLM: a stream running at the turn ends whole where it started, and the
    sleep (mode abort) comes only after it: nothing of the gateway's is aborted by it."""
    async with vllm_turns_demo(speed=20) as (pair, gateway, overlap):
        await wait_until(lambda: memory_of(gateway).phase == "holding", timeout=15)
        oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)

        async def long_stream() -> int:
            stream = await oai.chat.completions.create(
                model=SERVED, stream=True, max_tokens=200, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": "go on"}])
            usage, finishes = None, []
            async for chunk in stream:
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
                usage = chunk.usage or usage
            assert finishes == ["length"] and usage is not None, finishes  # never "abort"
            return usage.completion_tokens

        running = [asyncio.create_task(long_stream()) for _ in range(ROUTING["crossover"] - 1)]
        mtp = gateway.pool.backends["mtp"]
        await wait_until(lambda: mtp.inflight == len(running) and mtp.not_started == 0,
                         timeout=15)  # all streaming on MTP
        done = await asyncio.gather(long_stream(), *running)  # the crossover: a turn
        await wait_until(lambda: memory_of(gateway).holder == "plain", timeout=15)
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            metrics = (await client.get("/metrics")).text
        assert done == [200] * ROUTING["crossover"]
        assert metric(metrics, "gateway_continued_requests_total") == 0
        assert metric(metrics, "gateway_memory_turn_step_seconds_count", step="finish_streams") == 1
        assert overlap.most == 1
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)


def _failing(kind: str, released: asyncio.Event) -> Callable[..., Awaitable[Any]]:
    """The sim's sleep or wake, failing as vLLM's engine core does (a 500), or hanging until
    `released`, then failing."""
    async def failing(*args: Any) -> Any:
        if kind == "hang":
            await released.wait()
        raise WakeFailed(WAKE_OOM)
    return failing


FAILURES = [  # (server, step, fault, the holder after, the failure's kind on /metrics)
    ("mtp", "sleep", "error", "mtp", "error"),
    ("mtp", "sleep", "hang", "mtp", "timeout"),
    ("plain", "wake_up", "error", "mtp", "error"),
    ("plain", "wake_up", "hang", "mtp", "timeout"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server,step,fault,after,kind", FAILURES,
                         ids=[f"{s}-{st}-{f}" for s, st, f, _, _ in FAILURES])
async def test_a_sleep_or_wake_failing_leaves_the_pair_serving_on_one_server(
        server: str, step: str, fault: str, after: str, kind: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with vllm_turns_demo(release_timeout_s=1, resume_timeout_s=1, call_timeout_s=1) as (
            pair, gateway, overlap):
        await wait_until(lambda: memory_of(gateway).phase == "holding", timeout=10)
        sleep_mode = pair.servers[server].sleep_mode
        released = asyncio.Event()
        monkeypatch.setattr(sleep_mode, step, _failing(fault, released))
        oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)

        async def whole_or_error() -> str:
            try:
                return await openai_stream(oai)
            except openai.APIError as exc:  # waited on plain, which never woke: ended
                return f"error {exc.message[:40]}"

        results = await asyncio.gather(*(whole_or_error() for _ in range(12)))  # wants plain
        await wait_until(lambda: memory_of(gateway).failure is not None
                         and memory_of(gateway).phase == "holding", timeout=15)
        state = memory_of(gateway)
        assert str(state.failure.step) == f"{step}({server})" and state.failure.kind == kind
        assert state.holder == after
        assert await openai_stream(oai) == "whole"  # it serves
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            metrics = (await client.get("/metrics")).text
        # the load still wants plain: the turn may be tried again, and fail again
        assert metric(metrics, "gateway_memory_turn_failures_total", step=step, kind=kind) >= 1
        assert metric(metrics, "gateway_memory_turns_total", outcome="failed") >= 1
        assert all(r == "whole" or r.startswith("error") for r in results), results
        assert overlap.most == 1
        assert sleeping(pair)[after] is False
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)
        released.set()


@pytest.mark.timeout(30)
async def test_a_replica_without_its_controller_follows_is_sleeping_not_health():
    """/health is 200 on both servers while one sleeps (v1/engine/async_llm.py:1129-1134): a
    replica whose controller is gone admits to the one /is_sleeping says awake, and serves."""
    options = SimOptions(speed=200, memory="turns", engine="vllm", vllm=VllmOptions(dev_mode=True))
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=10) as client:
        health = [(await client.get(url + "/health")).status_code for url in pair.urls.values()]
        assert health == [200, 200]
        settings = build_settings({
            "backends": {name: {"url": url} for name, url in pair.urls.items()},
            "engine": "vllm", "memory": "turns", "routing": ROUTING,
            "turns": {**TURNS, "controller_url": "http://127.0.0.1:9/turns/state"},  # nothing there
            "monitor": {"interval_s": 0.05}, "log": {"access": False}})
        app = create_app(settings, registry=CollectorRegistry())
        async with serve_app(app) as url:
            follower = LiveGateway(app, url).runtime.turns.drivers["default"]
            await wait_until(lambda: follower.admitting == "mtp", timeout=10)
            assert follower.describe()["via"] == "readiness"
            oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            assert await openai_stream(oai) == "whole"
