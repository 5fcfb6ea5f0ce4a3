"""The demo's turns pair, live on loopback: the simulated SGLang pair in turns mode (one device,
SGLang 0.5.23's memory saver, gateway/sim/saver.py) behind a gateway with `memory: turns`,
under a ramp of concurrent streams 1 -> 32 -> 1 with the openai and anthropic SDKs. The memory
is handed over both ways; every stream ends whole; at no instant do both servers hold their
weights or KV cache; no simulated server dies or hangs; in-flight returns to 0."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from tests.conftest import LiveGateway
from tests.live import serve_app, wait_until

SERVED = "Qwen/Qwen3.5-122B-A10B"
CLAUDE = "claude-sonnet-4-5-20250929"
LEVELS = (1, 4, 16, 32, 16, 4, 1)
ROUTING = {"crossover": 8, "hysteresis": 4, "min_dwell_s": 0.5, "load_signal": "requests",
           "adaptive_crossover": False, "adapt_to_accept_length": False}
TURNS = {"dwell_turns": 0, "payback_turns": 0, "to_mtp_after_s": 0.3, "finish_within_s": 10, "wait_max_s": 15,
         "check_memory": False}
RESIDENT = ("weights", "kv_cache")


class Overlap:
    """Watches the shared device's ledger at every change: the most servers holding weights or
    KV cache at once, and every server that ever held them."""

    def __init__(self, pair: SimPair) -> None:
        self.device = pair.servers["mtp"].saver.device
        self.most = 0
        self.held_by: set[str] = set()
        hold = self.device.hold

        def watched(owner: str, part: str, gib: float) -> None:
            hold(owner, part, gib)
            self._look()

        self.device.hold = watched  # type: ignore[method-assign]
        self._look()

    def _look(self) -> None:
        holders = {owner for owner, parts in self.device.held_gib.items()
                   if any(parts.get(part, 0) > 0 for part in RESIDENT)}
        self.held_by |= holders
        self.most = max(self.most, len(holders))


@contextlib.asynccontextmanager
async def turns_demo(speed: float = 200, handoff: bool = True, **turns: Any
                     ) -> AsyncIterator[tuple[SimPair, LiveGateway, Overlap]]:
    """What `mtp-gateway demo --memory turns` runs, on port 0."""
    async with start_sim_pair(SimOptions(speed=speed, memory="turns")) as pair:
        overlap = Overlap(pair)
        settings = build_settings({
            "backends": {name: {"url": url} for name, url in pair.urls.items()},
            "memory": "turns", "routing": ROUTING, "turns": {**TURNS, **turns},
            "monitor": {"interval_s": 0.05}, "handoff": {"at_turn": handoff},
            "log": {"access": False}})
        app = create_app(settings, registry=CollectorRegistry())
        async with serve_app(app) as url:
            yield pair, LiveGateway(app, url), overlap


def memory_of(gateway: LiveGateway) -> Any:
    return gateway.runtime.turns.drivers["default"].state


async def openai_stream(client: openai.AsyncOpenAI) -> str:
    stream = await client.chat.completions.create(
        model=SERVED, stream=True, max_tokens=24, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "say something"}])
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert finish in ("stop", "length") and text and usage is not None, (finish, text)
    return "whole"


async def anthropic_stream(client: anthropic.AsyncAnthropic) -> str:
    async with client.messages.stream(model=CLAUDE, max_tokens=24, messages=[
            {"role": "user", "content": "say something"}]) as stream:
        message = await stream.get_final_message()
    assert message.stop_reason in ("end_turn", "max_tokens"), message.stop_reason
    assert message.content and message.content[0].type == "text" and message.content[0].text
    return "whole"


@pytest.mark.timeout(60)
async def test_the_turns_demo_under_a_ramp_hands_the_memory_over_both_ways():
    async with turns_demo() as (pair, gateway, overlap):
        await wait_until(lambda: memory_of(gateway).phase == "holding", timeout=10)
        assert memory_of(gateway).holder == "mtp"  # the sim parks plain and starts MTP on top
        oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="x", max_retries=0)
        results: list[str] = []
        held_plain = False
        for level in LEVELS:
            streams = [openai_stream(oai) if i % 2 else anthropic_stream(claude)
                       for i in range(level * 2)]
            results += await asyncio.gather(*streams)
            held_plain |= memory_of(gateway).holder == "plain"
        # quiet: one stream at a time until the memory is back with MTP
        deadline = time.monotonic() + 10
        while memory_of(gateway).holder != "mtp" or memory_of(gateway).phase != "holding":
            assert time.monotonic() < deadline, "the memory did not come back to MTP"
            results.append(await openai_stream(oai))
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            metrics = (await client.get("/metrics")).text
        assert results == ["whole"] * len(results)
        assert held_plain and overlap.held_by == {"mtp", "plain"}
        assert overlap.most == 1, "both servers held their weights or KV cache at once"
        turns = [line for line in metrics.splitlines()
                 if line.startswith("gateway_memory_turns_total{") and 'outcome="done"' in line]
        assert turns and float(turns[0].rsplit(" ", 1)[1]) >= 2, turns
        for server in pair.servers.values():
            assert not server.saver.dead and not server.saver.hung, server.saver.state.view()
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)


@pytest.mark.timeout(60)
async def test_a_resume_that_never_answers_leaves_the_pair_serving_on_mtp():
    async with turns_demo(resume_timeout_s=1, call_timeout_s=1) as (pair, gateway, overlap):
        await wait_until(lambda: memory_of(gateway).phase == "holding", timeout=10)
        # something other than the gateway resumes plain while MTP holds: SGLang's resume
        # without the memory never answers again (the simulator hangs it so)
        async with httpx.AsyncClient(base_url=pair.urls["plain"]) as direct:
            with pytest.raises(httpx.ReadTimeout):
                await direct.post("/resume_memory_occupation", json={}, timeout=0.5)
        assert pair.servers["plain"].saver.hung
        oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        async def whole_or_error() -> str:
            try:
                return await openai_stream(oai)
            except openai.APIError as exc:  # it waited on plain, which will not serve: ended
                return f"error {exc.message[:40]}"

        results = await asyncio.gather(*(whole_or_error() for _ in range(12)))  # wants plain
        await wait_until(lambda: memory_of(gateway).failure is not None
                         and memory_of(gateway).phase == "holding", timeout=15)
        state = memory_of(gateway)
        assert str(state.failure.step) == "resume(plain)" and state.failure.kind == "timeout"
        assert state.holder == "mtp" and state.of("plain") == "hung"
        assert all(r == "whole" or r.startswith("error backend 'plain' handed") for r in results)
        assert await openai_stream(oai) == "whole"
        mtp = pair.servers["mtp"].saver
        assert not mtp.dead and not mtp.hung and overlap.most == 1
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)


@pytest.mark.timeout(60)
async def test_the_holder_dying_mid_turn_hands_the_memory_to_the_other():
    # running streams finish first here (no hand-off), so the death comes while they run
    async with turns_demo(speed=20, handoff=False) as (pair, gateway, overlap):
        await wait_until(lambda: memory_of(gateway).phase == "holding", timeout=15)
        oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)

        async def long_stream(max_tokens: int) -> str:
            try:
                stream = await oai.chat.completions.create(
                    model=SERVED, stream=True, max_tokens=max_tokens, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": "go on"}])
                async for _ in stream:
                    pass
            except openai.APIError as exc:  # the server died under it: an error, not a hang
                return f"error {type(exc).__name__}"
            return "whole"

        # Streaming on MTP before the crossover, so the turn finds them running: ~2 s of MTP at
        # speed 20, which the death cuts short. Started together, a stream without its first
        # byte at the turn was moved to plain and ran all its tokens there, 8 x 3000 chunks
        # through the sim, gateway and SDK: 42-57 s of CPU on a loaded 2-core machine, past
        # the 60 s timeout once.
        running = [asyncio.create_task(long_stream(3000))
                   for _ in range(ROUTING["crossover"] - 1)]
        mtp = gateway.pool.backends["mtp"]
        await wait_until(lambda: mtp.inflight == len(running) and mtp.not_started == 0,
                         timeout=15)
        crossing = asyncio.create_task(long_stream(24))  # the crossover: a turn to plain
        await wait_until(lambda: str(memory_of(gateway).step) == "running_streams(mtp)",
                         timeout=15)
        pair.servers["mtp"].saver.die("killed by the test mid-turn")
        ended = await asyncio.wait_for(asyncio.gather(crossing, *running), timeout=30)
        await wait_until(lambda: memory_of(gateway).phase == "holding"
                         and memory_of(gateway).holder == "plain", timeout=15)
        # each ends: whole (moved before its first byte, or continued on plain after the
        # failure, handoff.on_failure) or with an error the SDK raises; none hangs
        assert all(r == "whole" or r.startswith("error") for r in ended), ended
        assert await openai_stream(oai) == "whole"  # plain serves
        assert memory_of(gateway).of("mtp") == "gone" and overlap.most == 1
        assert not pair.servers["plain"].saver.dead and not pair.servers["plain"].saver.hung
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)


@pytest.mark.timeout(60)
async def test_running_streams_continue_on_the_incoming_server_at_a_turn():
    async with turns_demo(speed=20) as (pair, gateway, overlap):
        await wait_until(lambda: memory_of(gateway).phase == "holding", timeout=15)
        oai = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)

        async def long_stream() -> int:
            stream = await oai.chat.completions.create(
                model=SERVED, stream=True, max_tokens=300, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": "go on"}])
            usage, finishes = None, []
            async for chunk in stream:
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
                usage = chunk.usage or usage
            assert finishes == ["length"] and usage is not None  # one stream, one end
            return usage.completion_tokens

        running = [asyncio.create_task(long_stream()) for _ in range(ROUTING["crossover"] - 1)]
        mtp = gateway.pool.backends["mtp"]
        await wait_until(lambda: mtp.inflight == len(running) and mtp.not_started == 0,
                         timeout=15)  # all streaming on MTP
        tokens = await asyncio.gather(long_stream(), *running)  # the crossover: a turn
        await wait_until(lambda: memory_of(gateway).holder == "plain", timeout=15)
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            metrics = (await client.get("/metrics")).text
        assert tokens == [300] * ROUTING["crossover"]  # the whole answer, across the seam
        continued = [line for line in metrics.splitlines() if line.startswith(
            "gateway_continued_requests_total{") and 'cause="turn"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in continued) >= len(running)
        assert overlap.most == 1
        for server in pair.servers.values():
            assert not server.saver.dead and not server.saver.hung
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)
