"""SGLang 0.5.23's memory saver in the simulator: the endpoints, retract and continue, what a
paused server answers, and the wrong orders that kill or hang a server (docs/compat.md)."""

import asyncio
import contextlib
import dataclasses
import json
import random

import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.sim import saver as saver_module
from gateway.sim.engine import Engine, Request
from gateway.sim.faults import Faults
from gateway.sim.live import Device
from gateway.sim.profile import load_profiles
from gateway.sim.saver import (
    ALL_TAGS,
    FIRST_PAUSE_S,
    RETAINED_PAUSE_S,
    RETAINED_RESUME_S,
    UNRETAINED_RESUME_S,
    SaverOptions,
    pause_cost_s,
    resume_cost_s,
)
from gateway.sim.server import SimOptions, start_sim_pair
from tests.sim.conftest import wait_until

SPEED = 200  # simulated seconds per real second: a 20 s health timeout is 0.1 s here
# Where a stream must still be running when the test acts on it: LONG lasts ~1 s real at 20.
STREAM_SPEED = 20
LONG = {"model": "m", "prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
SAVER_ON = SaverOptions(enable_memory_saver=True, weights_cpu_backup=True, cuda_graph_in_saver=True,
                        retain_cpu_backup=True)  # fmt: skip
PROBE_WEIGHTS_GIB = 30e9 / (1 << 30)  # the probe's 30 GB


def turns(**kw) -> SimOptions:
    return SimOptions(speed=SPEED, memory="turns", **kw)


async def post(http: httpx.AsyncClient, url: str, path: str, body: object = None, **kw) -> httpx.Response:
    return await http.post(url + path, json={} if body is None else body, **kw)


async def tokens_of(lines) -> tuple[int, str | None]:
    """Read a completions stream to its end: (text chunks, the last finish_reason)."""
    chunks, reason = 0, None
    async for line in lines:
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            chunks += bool(choice["text"])
            reason = choice["finish_reason"] or reason
    return chunks, reason


class Reader:
    """Reads a stream's lines in the background, so that silence can be watched without
    cancelling the stream's iterator."""

    def __init__(self, lines) -> None:
        self.lines: list[str] = []
        self.done = asyncio.Event()
        self._task = asyncio.create_task(self._read(lines))

    async def _read(self, lines) -> None:
        async for line in lines:
            self.lines.append(line)
        self.done.set()

    async def quiet(self, seconds: float) -> bool:
        """Nothing came for ``seconds`` and the stream is still open."""
        while True:
            count = len(self.lines)
            await asyncio.sleep(seconds)
            if self.done.is_set():
                return False
            if len(self.lines) == count:
                return True

    def finish_reason(self) -> str | None:
        reason = None
        for line in self.lines:
            if line.startswith("data: {"):
                reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
        return reason


async def first_chunks(lines, count: int) -> None:
    seen = 0
    async for line in lines:
        seen += line.startswith("data: {")
        if seen == count:
            return


# --- the engine's operations -----------------------------------------------------------------


def _engine(**changes) -> Engine:
    profile = dataclasses.replace(load_profiles()["plain"], **changes)
    return Engine(profile, random.Random(0))


def _run(engine: Engine, steps: int) -> list:
    outputs = []
    for _ in range(steps):
        step = engine.begin_step()
        if step is None:
            break
        outputs += engine.finish_step(step)
    return outputs


def test_retract_puts_running_requests_back_and_prefills_prompt_and_generated_tokens_again():
    engine = _engine()
    prompt = list(range(300))
    engine.submit(Request("a", prompt, 50))
    _run(engine, 11)  # the prefill, then 10 decode steps
    assert (engine.num_running, engine.num_waiting) == (1, 0)
    assert engine.retract() == ["a"]
    assert (engine.num_running, engine.num_waiting) == (0, 1)
    engine.flush_cache()  # as a release of the KV cache does
    step = engine.begin_step()
    assert step.kind == "prefill" and step.prefill_tokens == [300 + 11]  # prompt + 11 generated
    [out] = engine.finish_step(step)
    assert (out.tokens, out.first) == (1, False)  # its next token, not a first one
    assert engine.stats.reprefill_tokens == 311 and engine.stats.retracted_requests == 1
    rest = _run(engine, 100)
    assert sum(o.tokens for o in rest) == 50 - 12 and rest[-1].finish_reason == "length"


def test_a_paused_engine_takes_no_step_and_a_flush_drops_the_prefix_cache():
    engine = _engine()
    prompt = list(range(640))
    engine.submit(Request("a", prompt, 1))
    _run(engine, 5)
    engine.paused = True
    engine.submit(Request("b", prompt, 1))
    assert engine.begin_step() is None
    engine.paused = False
    engine.flush_cache()
    step = engine.begin_step()
    assert step.prefill_tokens == [640]  # nothing cached: the whole prompt again


def test_broken_drafts_accept_nothing():
    engine = Engine(load_profiles()["mtp"], random.Random(0))
    engine.drafts_broken = True
    engine.submit(Request("a", [1, 2, 3], 40))
    _run(engine, 100)
    assert engine.stats.avg_spec_accept_length == 1.0


# --- what a turn costs -----------------------------------------------------------------------


def test_costs_reproduce_the_h200_probe_and_scale_with_bytes_and_link():
    kept, first = (pause_cost_s("weights", PROBE_WEIGHTS_GIB, SAVER_ON, k, True) for k in (True, False))
    assert kept == pytest.approx(RETAINED_PAUSE_S) and first == pytest.approx(FIRST_PAUSE_S)
    assert resume_cost_s("weights", PROBE_WEIGHTS_GIB, SAVER_ON, True) == pytest.approx(RETAINED_RESUME_S)
    unretained = dataclasses.replace(SAVER_ON, retain_cpu_backup=False)
    assert resume_cost_s("weights", PROBE_WEIGHTS_GIB, unretained, True) == pytest.approx(UNRETAINED_RESUME_S)
    slow_link = dataclasses.replace(SAVER_ON, host_link_gbps=SAVER_ON.host_link_gbps / 2)
    assert pause_cost_s("weights", 2 * PROBE_WEIGHTS_GIB, slow_link, True, True) == pytest.approx(4 * kept)
    assert pause_cost_s("kv_cache", 90e9 / (1 << 30), SAVER_ON, True, True) == pytest.approx(0.055)
    off = SaverOptions()  # no --enable-memory-saver: the no-op adapter moves nothing
    assert pause_cost_s("weights", PROBE_WEIGHTS_GIB, off, False, True) == 0.0


async def test_the_first_pause_pays_for_the_host_buffer_and_a_retained_one_does_not(monkeypatch):
    slept: list[float] = []  # simulated seconds each step of a release or resume took

    async def record(self, seconds: float) -> None:
        slept.append(seconds)

    async with start_sim_pair(turns()) as pair, httpx.AsyncClient(timeout=5) as http:
        mtp, plain = pair.urls["mtp"], pair.urls["plain"]
        monkeypatch.setattr(saver_module.MemorySaver, "_sleep", record)
        for url in (mtp, plain):  # MTP's first turn, then plain back ...
            await post(http, url if url == mtp else plain, "/pause_generation", {"mode": "retract"})
            other = plain if url == mtp else mtp
            assert (await post(http, url, "/release_memory_occupation")).text == "null"
            assert (await post(http, other, "/resume_memory_occupation")).text == "null"
            await post(http, other, "/continue_generation")
        first_release, second_release = slept[0:3], slept[6:9]
        weights = pair.servers["mtp"].saver.footprint.weights_gib
    # [kv, weights, graphs] of MTP's first release, then plain's second (plain was parked once).
    assert first_release[1] == pytest.approx(pause_cost_s("weights", weights, SAVER_ON, False, True))
    plain_weights = pair.servers["plain"].saver.footprint.weights_gib
    assert second_release[1] == pytest.approx(
        pause_cost_s("weights", plain_weights, SAVER_ON, True, True))
    assert second_release[1] < first_release[1] / 10


# --- the endpoints ---------------------------------------------------------------------------


async def test_the_four_endpoints_answer_as_sglang():
    async with start_sim_pair(SimOptions(speed=SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]
        paused = await post(http, url, "/pause_generation", {"mode": "in_place"})
        assert (paused.status_code, paused.json()) == (200, {"message": "Generation paused successfully.",
                                                             "status": "ok"})  # fmt: skip
        released = await http.get(url + "/release_memory_occupation", params=None, headers=None)
        assert released.status_code == 400  # GET is routed, but the body is required
        released = await http.request("GET", url + "/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert (released.status_code, released.text) == (200, "null")
        resumed = await post(http, url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert (resumed.status_code, resumed.text) == (200, "null")
        continued = await post(http, url, "/continue_generation")
        assert continued.json() == {"message": "Generation continued successfully.", "status": "ok"}
        bad = await post(http, url, "/pause_generation", {"mode": "sleep"})
        assert bad.status_code == 400 and bad.json()["code"] == 400
        assert (await post(http, url, "/release_memory_occupation", {"tags": "weights"})).status_code == 400


async def test_the_endpoints_are_admin_optional():
    options = SimOptions(speed=SPEED, api_key="user", admin_api_key="admin")
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]
        user, admin = ({"Authorization": f"Bearer {key}"} for key in ("user", "admin"))
        for path in ("/pause_generation", "/continue_generation"):
            refused = await post(http, url, path, headers=user)
            assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
            assert (await post(http, url, path, headers=admin)).status_code == 200
    async with start_sim_pair(SimOptions(speed=SPEED, api_key="user")) as pair, httpx.AsyncClient() as http:
        url = pair.urls["plain"]
        assert (await post(http, url, "/pause_generation")).status_code == 401
        ok = await post(http, url, "/pause_generation", headers={"Authorization": "Bearer user"})
        assert ok.status_code == 200


# --- pause, retract, continue ----------------------------------------------------------------


async def test_retract_keeps_streams_open_and_silent_and_continue_finishes_them_whole():
    async with start_sim_pair(SimOptions(speed=STREAM_SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url, live = pair.urls["plain"], pair.servers["plain"].live
        async with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()
            await first_chunks(lines, 3)
            await post(http, url, "/pause_generation", {"mode": "retract"})
            await wait_until(lambda: live.engine.num_waiting == 1)
            assert live.engine.num_running == 0
            generated = live.engine.stats.generated_tokens
            info = (await http.get(url + "/server_info")).json()
            assert info["internal_states"][0]["last_gen_throughput"] == 0.0
            reader = Reader(lines)
            assert await reader.quiet(0.2)  # what was sent before the pause, then silence
            assert live.engine.stats.generated_tokens == generated
            await post(http, url, "/continue_generation")
            await asyncio.wait_for(reader.done.wait(), 10)
        assert reader.finish_reason() == "length"
        assert live.engine.stats.generated_tokens == LONG["max_tokens"]
        # prompt + what it had generated, prefilled again (the prefix cache held only the prompt)
        assert live.engine.stats.reprefill_tokens >= generated


async def test_abort_mode_ends_running_streams_with_abort_and_answers_after_they_end():
    async with start_sim_pair(SimOptions(speed=STREAM_SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url, live = pair.urls["plain"], pair.servers["plain"].live
        async with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()
            await first_chunks(lines, 2)
            assert (await post(http, url, "/pause_generation", {"mode": "abort"})).status_code == 200
            assert live.engine.is_fully_idle
            _, reason = await tokens_of(lines)
    assert reason == "abort"


async def test_an_abort_pause_waits_one_poll_when_requests_were_in_flight(monkeypatch):
    slept: list[float] = []

    async def record(self, seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(saver_module.MemorySaver, "_sleep", record)
    async with start_sim_pair(SimOptions(speed=STREAM_SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]
        await post(http, url, "/pause_generation", {"mode": "abort"})  # idle: at once
        await post(http, url, "/continue_generation")
        async with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()  # held: a collected iterator closes the stream
            await first_chunks(lines, 2)
            await post(http, url, "/pause_generation", {"mode": "abort"})
    assert slept == [saver_module.ABORT_PAUSE_POLL_S]  # tokenizer_manager.py:2280's 1 s sleep


async def test_new_requests_wait_while_paused_and_run_after_continue():
    async with start_sim_pair(SimOptions(speed=SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url, live = pair.urls["plain"], pair.servers["plain"].live
        await post(http, url, "/pause_generation", {"mode": "retract"})
        waiting = asyncio.create_task(post(http, url, "/v1/completions", {**LONG, "stream": False}))
        await wait_until(lambda: live.num_held == 1)
        await asyncio.sleep(0.1)
        assert not waiting.done() and live.engine.stats.generated_tokens == 0
        await post(http, url, "/continue_generation")
        done = await waiting
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == LONG["max_tokens"]


async def test_a_release_flushes_the_prefix_cache():
    prompt = " ".join(f"w{i}" for i in range(400))
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    async with start_sim_pair(SimOptions(speed=SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url, stats = pair.urls["plain"], pair.servers["plain"].live.engine.stats
        await post(http, url, "/v1/completions", body)
        await post(http, url, "/v1/completions", body)
        cached = stats.cached_tokens
        assert cached > 0
        await post(http, url, "/pause_generation", {"mode": "retract"})
        await post(http, url, "/release_memory_occupation", {"tags": ["kv_cache"]})
        await post(http, url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        await post(http, url, "/continue_generation")
        await post(http, url, "/v1/completions", body)
    assert stats.cached_tokens == cached  # nothing of it was left


async def test_ready_is_503_while_paused_ping_200_and_health_503_after_20_seconds():
    async with start_sim_pair(SimOptions(speed=SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]

        async def codes() -> tuple[int, int]:
            return (await http.get(url + "/ready")).status_code, (await http.get(url + "/ping")).status_code

        assert await codes() == (200, 200)
        await post(http, url, "/pause_generation", {"mode": "retract"})
        assert await codes() == (503, 200)
        assert (await http.get(url + "/health")).status_code == 503  # its probe waited the 20 s
        assert await codes() == (503, 503)  # and marked the server unhealthy
        await post(http, url, "/continue_generation")
        assert await codes() == (503, 503)  # until a /health succeeds
        assert (await http.get(url + "/health")).status_code == 200
        assert await codes() == (200, 200)


async def test_health_of_a_busy_server_is_answered_by_its_running_requests():
    """A busy scheduler skips the probe (scheduler.py:2240-2247): any output since the check
    began makes /health 200, even when the probe itself could not run (cap 1, one running)."""
    plain = dataclasses.replace(load_profiles()["plain"], max_running_requests=1)
    options = SimOptions(speed=STREAM_SPEED, profiles={**load_profiles(), "plain": plain})
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]
        endless = {**LONG, "max_tokens": 20_000}  # far past the 20 s of the health check
        async with http.stream("POST", url + "/v1/completions", json=endless) as response:
            lines = response.aiter_lines()  # held: a collected iterator closes the stream
            await first_chunks(lines, 1)
            assert (await http.get(url + "/health")).status_code == 200
            assert pair.servers["plain"].live.engine.num_waiting == 0  # no probe queued


# --- the hard failures -----------------------------------------------------------------------


async def _is_dead(http: httpx.AsyncClient, url: str) -> bool:
    try:
        await http.get(url + "/ping")
    except httpx.ConnectError:
        return True
    return False


async def test_a_release_while_requests_run_kills_the_server():
    async with start_sim_pair(SimOptions(speed=STREAM_SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]
        async with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()
            await first_chunks(lines, 2)
            with pytest.raises(httpx.RemoteProtocolError):
                await post(http, url, "/release_memory_occupation")
            with pytest.raises(httpx.HTTPError):  # the stream's connection went with it
                await tokens_of(lines)
        assert await _is_dead(http, url)
        assert "idle" in pair.servers["plain"].saver.state.cause
        assert (await http.get(pair.urls["mtp"] + "/ping")).status_code == 200  # the other lives


async def test_a_connection_accepted_as_the_server_dies_is_dropped_not_served(monkeypatch):
    # asyncio tells a protocol of its connection a loop iteration after making its transport:
    # the death comes in between here. An exited process serves nothing; served, the request
    # waited forever on the halted engine (a turns test's stream hung behind the gateway).
    async with start_sim_pair(SimOptions(speed=SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        saver, made = pair.servers["plain"].saver, HttpToolsProtocol.connection_made

        def dying_as_made(protocol: HttpToolsProtocol, transport: asyncio.Transport) -> None:
            saver.die("killed as it accepted a connection")
            made(protocol, transport)

        monkeypatch.setattr(HttpToolsProtocol, "connection_made", dying_as_made)
        # dropped without an answer (reset: its request unread), at once, not a ReadTimeout
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await post(http, pair.urls["plain"], "/v1/completions", {**LONG, "stream": False})
        assert saver.dead


async def test_a_release_after_an_in_place_pause_with_requests_running_kills_the_server():
    async with start_sim_pair(SimOptions(speed=STREAM_SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]
        async with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()  # held: a collected iterator closes the stream
            await first_chunks(lines, 2)
            await post(http, url, "/pause_generation", {"mode": "in_place"})
            with pytest.raises(httpx.RemoteProtocolError):
                await post(http, url, "/release_memory_occupation")
        assert await _is_dead(http, url)


@pytest.mark.parametrize("memory_saver", [True, False])
async def test_a_second_release_of_the_same_tags_kills_a_server_with_the_memory_saver(memory_saver):
    options = SimOptions(speed=SPEED, saver=SAVER_ON if memory_saver else SaverOptions())
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]
        await post(http, url, "/pause_generation", {"mode": "retract"})
        assert (await post(http, url, "/release_memory_occupation", {"tags": ["weights"]})).text == "null"
        if memory_saver:
            with pytest.raises(httpx.RemoteProtocolError):
                await post(http, url, "/release_memory_occupation", {"tags": ["weights"]})
            assert await _is_dead(http, url)
        else:  # the no-op adapter pauses nothing, so nothing is paused twice
            assert (await post(http, url, "/release_memory_occupation", {"tags": ["weights"]})).text == "null"
            assert not await _is_dead(http, url)


async def test_a_release_sent_before_an_abort_pause_answers_can_find_a_request_still_running():
    """The abort lets a running request run one more forward pass: a release that does not wait
    for the pause's answer reaches the scheduler before it, and kills the server."""
    slow = {"plain": Faults(slow_factor=300)}  # decode steps of ~0.45 s real: the release comes within one
    options = SimOptions(speed=10, faults=slow)
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=5) as http:
        url = pair.urls["plain"]
        async with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()  # held: a collected iterator closes the stream
            await first_chunks(lines, 1)
            pausing = asyncio.create_task(post(http, url, "/pause_generation", {"mode": "abort"}))
            await wait_until(lambda: pair.servers["plain"].saver.state.tokenizer_paused)
            with pytest.raises(httpx.RemoteProtocolError):
                await post(http, url, "/release_memory_occupation")
            with contextlib.suppress(httpx.HTTPError):  # answered or not before the death
                await pausing
        assert "idle" in pair.servers["plain"].saver.state.cause


async def test_a_second_resume_or_a_resume_of_tags_never_released_kills_the_server():
    async with start_sim_pair(SimOptions(speed=SPEED)) as pair, httpx.AsyncClient(timeout=5) as http:
        mtp, plain = pair.urls["mtp"], pair.urls["plain"]
        await post(http, plain, "/pause_generation", {"mode": "retract"})
        await post(http, plain, "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert (await post(http, plain, "/resume_memory_occupation", {"tags": ["kv_cache"]})).text == "null"
        with pytest.raises(httpx.RemoteProtocolError):
            await post(http, plain, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert await _is_dead(http, plain)
        with pytest.raises(httpx.RemoteProtocolError):  # KeyError: 'kv_cache' (offload_tags.remove)
            await post(http, mtp, "/resume_memory_occupation")
        assert pair.servers["mtp"].saver.state.cause == "KeyError: 'kv_cache'"


async def test_a_resume_while_the_other_server_holds_the_memory_never_answers():
    async with start_sim_pair(turns()) as pair, httpx.AsyncClient(timeout=5) as http:
        mtp, plain = pair.urls["mtp"], pair.urls["plain"]  # plain parked, MTP holds the GPU
        with pytest.raises(httpx.ReadTimeout):
            await post(http, plain, "/resume_memory_occupation", timeout=0.5)
        saver = pair.servers["plain"].saver
        assert saver.hung and "OUT_OF_MEMORY" in saver.state.cause
        # The server is lost: it still takes connections, and answers nothing that needs it.
        assert (await http.get(plain + "/ping")).status_code == 200
        await post(http, plain, "/continue_generation")
        with pytest.raises(httpx.ReadTimeout):
            await http.get(plain + "/server_info", timeout=0.3)
        assert (await http.get(plain + "/v1/loads")).status_code == 200  # read from a snapshot
        with pytest.raises(httpx.ReadTimeout):
            await post(http, plain, "/v1/completions", {**LONG, "stream": False}, timeout=0.3)
        assert (await http.get(plain + "/health")).status_code == 503
        # MTP was never touched and still serves.
        done = await post(http, mtp, "/v1/completions", {**LONG, "stream": False, "max_tokens": 4})
        assert done.status_code == 200


async def test_server_info_answers_after_a_release_in_progress_and_loads_at_once(monkeypatch):
    """/server_info goes through the scheduler, after the control requests sent before it;
    /v1/loads reads the load snapshot."""
    copying = asyncio.Event()  # a release whose copy finishes when the test says

    async def slow_copy(self, seconds: float) -> None:
        await copying.wait()

    monkeypatch.setattr(saver_module.MemorySaver, "_sleep", slow_copy)
    async with start_sim_pair(SimOptions(speed=SPEED, saver=SAVER_ON)) as pair, httpx.AsyncClient() as http:
        url = pair.urls["plain"]
        await post(http, url, "/pause_generation", {"mode": "retract"})
        releasing = asyncio.create_task(post(http, url, "/release_memory_occupation"))
        await wait_until(lambda: pair.servers["plain"].live.scheduler.locked())
        info = asyncio.create_task(http.get(url + "/server_info"))
        assert (await http.get(url + "/v1/loads")).status_code == 200
        await asyncio.sleep(0.05)
        assert not info.done() and not releasing.done()
        copying.set()
        assert (await releasing).text == "null" and (await info).status_code == 200


async def test_a_request_to_a_released_server_that_was_not_paused_kills_it():
    async with start_sim_pair(SimOptions(speed=SPEED, saver=SAVER_ON)) as pair, httpx.AsyncClient() as http:
        url = pair.urls["plain"]
        assert (await post(http, url, "/release_memory_occupation")).text == "null"  # idle: allowed
        with pytest.raises(httpx.RemoteProtocolError):
            await post(http, url, "/v1/completions", {**LONG, "stream": False})
        assert await _is_dead(http, url)
        assert "illegal memory access" in pair.servers["plain"].saver.state.cause


async def test_continue_without_resume_kills_the_server_at_its_next_step():
    options = SimOptions(speed=STREAM_SPEED, memory="turns")
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=5) as http:
        mtp = pair.urls["mtp"]
        async with http.stream("POST", mtp + "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()  # held: a collected iterator closes the stream
            await first_chunks(lines, 2)
            await post(http, mtp, "/pause_generation", {"mode": "retract"})
            await post(http, mtp, "/release_memory_occupation")
            await post(http, mtp, "/continue_generation")  # the retracted request is prefilled again
            await wait_until(lambda: pair.servers["mtp"].saver.dead, timeout=2)
        assert await _is_dead(http, mtp)


# --- the shared device -----------------------------------------------------------------------


def test_the_device_refuses_a_second_resident_server():
    device = Device(capacity_gib=96.0)
    device.hold("plain", "weights", 60.0)
    assert device.fits(36.0) and not device.fits(36.5)
    device.drop("plain")  # a process that exits gives its memory back
    assert device.free_gib == 96.0


async def test_a_turn_hands_the_memory_over_and_a_dying_server_gives_it_back():
    async with start_sim_pair(turns()) as pair, httpx.AsyncClient(timeout=5) as http:
        mtp, plain = pair.urls["mtp"], pair.urls["plain"]
        device = pair.servers["mtp"].saver.device
        with pytest.raises(MemoryError):  # both resident do not fit
            pair.servers["plain"].saver.occupy()
        held = {name: device.holding(name) for name in ("mtp", "plain")}
        assert held["mtp"] > 50 > 2 > held["plain"]
        await post(http, mtp, "/pause_generation", {"mode": "retract"})
        await post(http, mtp, "/release_memory_occupation")
        await post(http, plain, "/resume_memory_occupation")
        await post(http, plain, "/continue_generation")
        assert device.holding("plain") > 50 > 2 > device.holding("mtp")
        assert device.free_gib >= 0
        done = await post(http, plain, "/v1/completions", {**LONG, "stream": False, "max_tokens": 8})
        assert done.status_code == 200
        state = (await http.get(mtp + "/sim/state")).json()["memory"]
        assert state["released"] == sorted(ALL_TAGS) and state["paused"] is True
        with pytest.raises(httpx.RemoteProtocolError):  # a wrong order: MTP released again
            await post(http, mtp, "/release_memory_occupation")
        assert device.holding("mtp") == 0


async def test_server_info_reports_the_memory_saver_flags():
    async with start_sim_pair(turns()) as pair, httpx.AsyncClient(timeout=5) as http:
        info = (await http.get(pair.urls["mtp"] + "/server_info")).json()
    assert (info["enable_memory_saver"], info["enable_weights_cpu_backup"]) == (True, True)
    assert "--enable-memory-saver --enable-weights-cpu-backup" in info["launch_command"]
    assert info["max_running_requests"] == 48


async def test_draft_weights_released_without_a_host_copy_come_back_broken():
    options = SimOptions(speed=SPEED, saver=SaverOptions(enable_memory_saver=True))
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=5) as http:
        url, engine = pair.urls["mtp"], pair.servers["mtp"].live.engine
        await post(http, url, "/pause_generation", {"mode": "retract"})
        await post(http, url, "/release_memory_occupation", {"tags": ["weights"]})
        await post(http, url, "/resume_memory_occupation", {"tags": ["weights"]})
        await post(http, url, "/continue_generation")
        await post(http, url, "/v1/completions", {**LONG, "stream": False, "max_tokens": 60})
    assert engine.drafts_broken and engine.stats.avg_spec_accept_length == 1.0
    assert pair.servers["mtp"].saver.state.weights_garbage


def test_the_sim_command_takes_sglangs_memory_saver_flags():
    import argparse
    from pathlib import Path

    from gateway.sim.cli import _saver_options, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert _saver_options(parser.parse_args([])) is None  # the memory shape's own
    args = parser.parse_args(["--enable-memory-saver", "--enable-weights-cpu-backup", "--retain-cpu-backup"])
    assert _saver_options(args) == SaverOptions(enable_memory_saver=True, weights_cpu_backup=True,
                                                retain_cpu_backup=True)  # fmt: skip
    real = Path(__file__).resolve().parents[1] / "data" / "sglang_0.5.23_flags.txt"
    flags = set(real.read_text().split())
    ours = {"--enable-memory-saver", "--enable-weights-cpu-backup", "--enable-draft-weights-cpu-backup"}
    assert ours <= flags  # the names SGLang 0.5.23 has
