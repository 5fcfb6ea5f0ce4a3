"""Backend faults, timeouts, the circuit breaker and admission, against the simulator's faults.

Every stream must end with either the full answer or exactly one SSE error event followed by
`[DONE]`, within its timeout; the in-flight count must return to 0; a request fails over to the
other backend only before its first byte. Complements tests/test_gateway_live.py (single crash,
5xx retry, refused connect retry, first-byte 504, keep-alive), which is not repeated here.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.routing.backend import CircuitRules
from gateway.routing.pool import Ask, Failure, Lease, Outcome
from gateway.sim.faults import Faults
from gateway.sim.profile import load_profiles
from gateway.sim.server import SimOptions, start_sim_pair
from tests.conftest import LiveGateway, circuit_open, live_gateway
from tests.live import serve_app, wait_until
from tests.test_gateway_live import OpenStream, chat, settled, sse_events, text_of
from tests.test_load import one_pair

URL = "/v1/chat/completions"
LONG = {"max_tokens": 100000, "ignore_eos": True, "stream": True}


def ending(raw: bytes) -> dict[str, Any] | None:
    """None for a full answer; the error object for a stream that ended with an error event.

    Either way the stream ends with exactly one `[DONE]`, and every event is whole JSON."""
    events = sse_events(raw)
    assert events and events[-1] == "[DONE]", raw[-300:]
    assert events.count("[DONE]") == 1, raw[-300:]
    payloads = [json.loads(event) for event in events[:-1]]
    errors = [p for p in payloads if "error" in p]
    if not errors:
        assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length"), payloads[-1]
        return None
    assert len(errors) == 1 and "error" in payloads[-1], "the error event must be the last one"
    error = payloads[-1]["error"]
    assert {"message", "type", "code"} <= set(error), error
    return error


async def stream(client: httpx.AsyncClient, gateway: LiveGateway, body: dict[str, Any]
                 ) -> tuple[httpx.Response, bytes, float]:
    started = time.monotonic()
    async with client.stream("POST", gateway.url + URL, json=body) as response:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    return response, raw, time.monotonic() - started


async def idle_engines(pair: Any) -> None:
    """The backends run nothing any more: what the gateway gave up on was aborted upstream."""
    await wait_until(lambda: all(s.live.engine.num_running == 0 and s.live.engine.num_waiting == 0
                                 for s in pair.servers.values()), timeout=5)


class FakeBackend:
    """A scripted SGLang stand-in on a real socket: records what it receives, answers what
    the test tells it to (the simulator cannot show received headers or serve garbage)."""

    MODEL = "Qwen/Qwen3.5-122B-A10B"

    def __init__(self) -> None:
        self.loads: object = {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}
        self.received: list[tuple[str, list[tuple[str, str]], bytes]] = []
        self.response_headers: dict[str, str] = {}
        self.flood: tuple[int, int] | None = None  # (events, bytes each): a fast, long stream
        self.pieces: list[bytes] | None = None  # a stream sent in these writes, one at a time
        self.die_after_pieces = False  # ... then the backend dies without ending the stream
        self.poison: bytes | None = None  # requests containing these bytes get SGLang's 500
        self.flooded = 0  # events yielded so far
        self.last_yield_at = 0.0
        routes = [
            Route("/v1/loads", self._loads), Route("/server_info", self._server_info),
            Route("/v1/models", self._models),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/abort_request", self._record, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    async def _loads(self, request: Request) -> Response:
        if isinstance(self.loads, bytes):
            return Response(self.loads, media_type="text/html")
        return JSONResponse(self.loads)

    async def _server_info(self, request: Request) -> Response:
        return JSONResponse({"max_running_requests": 48})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.MODEL, "object": "model"}]})

    async def _record(self, request: Request) -> Response:
        body = await request.body()
        self.received.append((request.url.path, request.headers.items(), body))
        return Response(status_code=200)

    async def _generate(self, request: Request) -> Response:
        await self._record(request)
        raw = self.received[-1][2]
        if self.poison is not None and self.poison in raw:
            return JSONResponse({"object": "error", "message": "Internal server error: boom",
                                 "type": "InternalServerError", "param": None, "code": 500}, 500)
        body = json.loads(raw)
        done = {"id": "fake", "object": "chat.completion.chunk", "model": self.MODEL,
                "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}
        if body.get("stream") and self.pieces is not None:
            return StreamingResponse(self._pieces(), media_type="text/event-stream")
        if body.get("stream") and self.flood is not None:
            return StreamingResponse(self._flood(*self.flood), media_type="text/event-stream")
        if body.get("stream"):
            async def events() -> Any:
                yield b"data: " + json.dumps(done).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers=self.response_headers)
        whole = {"id": "fake", "object": "chat.completion", "model": self.MODEL, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
        return JSONResponse(whole, headers=self.response_headers)

    async def _pieces(self) -> Any:
        for piece in self.pieces or []:
            yield piece
            await asyncio.sleep(0.002)  # its own write and, mostly, its own read at the gateway
        if self.die_after_pieces:
            raise ConnectionAbortedError("the backend process died")  # uvicorn drops the socket

    async def _flood(self, count: int, size: int) -> Any:
        for i in range(count):
            self.last_yield_at = time.monotonic()
            yield b"data: %08d %s\n\n" % (i, b"x" * size)
            self.flooded = i + 1
        yield b"data: [DONE]\n\n"


# --- failures before and after the first byte ------------------------------------------------

@pytest.mark.timeout(30)
async def test_stream_broken_before_its_first_byte_fails_over_with_the_full_answer(sim) -> None:
    """The backend sends 200 and drops the connection before any event: retried on plain."""
    await sim.servers["mtp"].set_faults(Faults(crash_after_chunks=0))
    async with live_gateway(sim, monitor={"circuit_failures": 100}) as gateway, \
            httpx.AsyncClient() as client:
        reference = await client.post(sim.urls["plain"] + URL, json=chat(max_tokens=30, stream=True))
        results = await asyncio.gather(
            *(stream(client, gateway, chat(max_tokens=30, stream=True)) for _ in range(6)))
        for response, raw, _ in results:
            assert response.status_code == 200
            assert (response.headers["x-gateway-backend"], response.headers["x-gateway-route-reason"]
                    ) == ("plain", "failover")
            assert ending(raw) is None and text_of(raw) == text_of(reference.content)
        await settled(gateway, 0)
        assert gateway.inflight() == {"mtp": 0, "plain": 0}
        metrics = (await client.get(gateway.url + "/metrics")).text
        assert 'gateway_retries_total{from_backend="mtp",to_backend="plain"} 6.0' in metrics


@pytest.mark.timeout(30)
async def test_non_stream_answer_broken_before_anything_was_sent_fails_over(sim) -> None:
    """A non-streaming answer is sent to the client only once read whole: a backend that
    dies half way through it has cost the client nothing yet, so it is retried elsewhere."""
    await sim.servers["mtp"].set_faults(Faults(crash_after_chunks=0))  # headers, then gone
    async with live_gateway(sim) as gateway, httpx.AsyncClient() as client:
        response = await client.post(gateway.url + URL, json=chat(max_tokens=10))
        assert response.status_code == 200, response.text
        assert (response.headers["x-gateway-backend"], response.headers["x-gateway-route-reason"]
                ) == ("plain", "failover")
        assert response.json()["choices"][0]["message"]["content"]
        await settled(gateway, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", [Faults(crash_after_chunks=3), Faults(error_after_chunks=3)],
                         ids=["crash", "sglang_error_event"])
async def test_every_concurrent_stream_broken_mid_way_ends_with_one_error_then_done(
        sim, fault: Faults) -> None:
    await sim.servers["mtp"].set_faults(fault)
    # Off, a crash ends the stream with an error (on, it is continued: test_handoff_live.py).
    async with live_gateway(sim, monitor={"circuit_failures": 100},
                            handoff={"on_failure": False}) as gateway, \
            httpx.AsyncClient() as client:
        results = await asyncio.gather(
            *(stream(client, gateway, chat(max_tokens=50, stream=True)) for _ in range(8)))
        for response, raw, _ in results:
            assert response.status_code == 200 and response.headers["x-gateway-backend"] == "mtp"
            assert ending(raw) is not None  # bytes went out: no retry, an error event instead
        await settled(gateway, 0)
        await idle_engines(sim)


# --- timeouts ----------------------------------------------------------------------------------

@pytest.mark.timeout(30)
async def test_hang_before_first_byte_behind_keepalives_ends_with_an_error_event(sim) -> None:
    """Keep-alives committed the 200: the first-byte timeout must end the stream in-band."""
    await sim.servers["mtp"].set_faults(Faults(hang_before_first_byte=True))
    timeouts = {"keepalive_s": 0.05, "first_byte_s": 0.5}
    async with live_gateway(sim, timeouts=timeouts) as gateway, httpx.AsyncClient() as client:
        response, raw, took = await stream(client, gateway, chat(stream=True))
        assert response.status_code == 200 and raw.startswith(b": keep-alive\n\n")
        error = ending(raw)
        assert error is not None and error["code"] == "upstream_timeout", error
        assert "first byte" in error["message"]
        assert 0.5 <= took < 1.5
        await settled(gateway, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keepalive_s", [0.0, 0.05], ids=["no_keepalive", "with_keepalive"])
@pytest.mark.parametrize("stock_uvicorn", [False, True], ids=["gateway-server", "stock-uvicorn"])
async def test_idle_timeout_mid_stream_ends_with_an_error_event(keepalive_s: float,
                                                               stock_uvicorn: bool) -> None:
    """The backend stalls after its first chunks. Keep-alive comments keep the CLIENT's
    proxies from timing out; they must not reset the gateway's own idle deadline on the
    silent BACKEND, or a stalled stream would hang until `total_s`."""
    options = SimOptions(speed=50, shared_device=False)  # mtp's stall must not block plain
    timeouts = {"keepalive_s": keepalive_s, "idle_s": 0.4, "total_s": 4.0}
    async with start_sim_pair(options) as pair, \
            live_gateway(pair, timeouts=timeouts, stock_uvicorn=stock_uvicorn,
                         handoff={"on_failure": False}) as gateway, \
            httpx.AsyncClient() as client:
        opened = await OpenStream(client, gateway.url + URL, chat(**LONG)).open()
        raw = opened.first
        while b"data: " not in raw:  # past any keep-alive: the first tokens arrived
            raw += await opened.chunks.__anext__()
        stalled_at = time.monotonic()
        await pair.servers["mtp"].set_faults(Faults(slow_factor=1e6))
        raw += b"".join([chunk async for chunk in opened.chunks])
        took = time.monotonic() - stalled_at
        await opened.close()
        error = ending(raw)
        assert error is not None and error["code"] == "upstream_timeout"
        assert "timeout idle" in error["message"], error["message"]
        assert took < 0.4 + 1.0, f"stalled stream ended after {took:.2f} s"
        await settled(gateway, 0)
        # The gateway aborted the request (SGLang's /abort_request), freeing the slot upstream.
        rid = json.loads(sse_events(raw)[0])["id"]
        await wait_until(lambda: rid not in pair.servers["mtp"].live.engine, timeout=3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stock_uvicorn", [False, True], ids=["gateway-server", "stock-uvicorn"])
async def test_keepalive_comments_during_a_mid_stream_stall_then_the_full_answer(
        stock_uvicorn: bool) -> None:
    """Silence after the first token (a long tool-call argument, a stalled step) gets keep-alive
    comments too, not only the wait for the first token; the stream then finishes normally."""
    options = SimOptions(speed=50, shared_device=False)
    async with start_sim_pair(options) as pair, \
            live_gateway(pair, timeouts={"keepalive_s": 0.1}, stock_uvicorn=stock_uvicorn) as gateway, \
            httpx.AsyncClient() as client:
        body = chat(max_tokens=40, stream=True)
        _, reference, _ = await stream(client, gateway, body)
        mtp = pair.servers["mtp"]
        await mtp.set_faults(Faults(slow_factor=20))  # slow enough to catch it mid-stream
        opened = await OpenStream(client, gateway.url + URL, body).open()
        head = opened.first
        while b"data: " not in head:  # past any keep-alive: the first tokens arrived
            head += await opened.chunks.__anext__()
        await mtp.set_faults(Faults(slow_factor=500))  # the next step takes ~0.3 s
        rest = b""
        async for chunk in opened.chunks:
            rest += chunk
            if b": keep-alive" in chunk:
                await mtp.clear_faults()
                break
        rest += b"".join([chunk async for chunk in opened.chunks])
        await opened.close()
        assert b": keep-alive\n\n" in rest
        raw = head + rest
        assert ending(raw) is None and text_of(raw) == text_of(reference)
        await settled(gateway, 0)


@pytest.mark.timeout(30)
async def test_total_timeout_ends_a_long_stream_and_aborts_it_upstream(sim) -> None:
    async with live_gateway(sim, timeouts={"total_s": 0.6}) as gateway, \
            httpx.AsyncClient() as client:
        response, raw, took = await stream(client, gateway, chat(**LONG))
        assert response.status_code == 200 and text_of(raw)  # it was streaming ...
        error = ending(raw)  # ... and was cut at the deadline
        assert error is not None and "timeout total" in error["message"]
        assert 0.6 <= took < 1.6
        await settled(gateway, 0)
        await idle_engines(sim)


@pytest.mark.timeout(30)
async def test_slow_backend_completes_when_every_gap_is_within_the_idle_budget() -> None:
    options = SimOptions(speed=50, shared_device=False)
    idle_s, slow_factor = 0.25, 40
    async with start_sim_pair(options) as pair, \
            live_gateway(pair, timeouts={"idle_s": idle_s}) as gateway, \
            httpx.AsyncClient() as client:
        body = chat(max_tokens=60, stream=True)
        _, fast, _ = await stream(client, gateway, body)
        mtp = pair.servers["mtp"]
        await mtp.set_faults(Faults(slow_factor=slow_factor))
        steps_before = mtp.live.engine.stats.spec_verify_ct
        response, slow, slow_s = await stream(client, gateway, body)
        assert response.headers["x-gateway-backend"] == "mtp"
        assert ending(slow) is None and text_of(slow) == text_of(fast)
        # Each slowed decode step (a gap) is ~13 ms, far inside the idle budget; together they
        # take longer than it. Counted in modelled steps, not compared with the fast stream's
        # wall time (~20 ms), which a load hiccup stretches.
        steps = mtp.live.engine.stats.spec_verify_ct - steps_before
        modelled_s = steps * load_profiles()["mtp"].decode_step_s(1) * slow_factor / options.speed
        assert modelled_s > 1.5 * idle_s, (steps, modelled_s)
        assert slow_s >= modelled_s > idle_s, (slow_s, modelled_s)
        await settled(gateway, 0)


# --- connection refused, backend crash and restart -------------------------------------------

@pytest.mark.timeout(30)
async def test_both_backends_refusing_gives_a_clean_openai_shaped_502(sim) -> None:
    async with live_gateway(sim, monitor={"interval_s": 60}) as gateway, \
            httpx.AsyncClient() as client:
        # Refused only once the gateway holds its port (a gateway started after could be given
        # a port a refusing server just freed; tests/test_gateway_live.py says what follows).
        for server in sim.servers.values():
            await server.set_faults(Faults(refuse_connections=True))
        for backend in ("mtp", "plain"):
            assert gateway.pool.backends[backend].up  # the monitor has not noticed yet
        for body in (chat(stream=True), chat()):
            response = await client.post(gateway.url + URL, json=body)
            assert response.status_code == 502
            assert response.json()["error"]["code"] == "upstream_connect_error"
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert gateway.inflight() == {"mtp": 0, "plain": 0}


@pytest.mark.timeout(30)
async def test_backend_crash_and_restart_down_after_fall_up_after_rise(sim) -> None:
    """Probes are driven by hand (the monitor's own interval is 60 s) so every count is exact."""
    monitor = {"interval_s": 60, "fall": 2, "rise": 3}
    # Continuations off: its open streams end in-band, as this test is about (on, they would
    # go on on plain: test_handoff_live.py).
    async with live_gateway(sim, monitor=monitor, handoff={"on_failure": False}) as gateway, \
            httpx.AsyncClient(timeout=10) as client:
        health, probe = gateway.pool.backends["mtp"], gateway.runtime.probes.probe_all
        streams = [await OpenStream(client, gateway.url + URL, chat(**LONG)).open() for _ in range(3)]
        assert {s.backend for s in streams} == {"mtp"}
        await sim.servers["mtp"].set_faults(Faults(refuse_connections=True))  # the process dies
        for opened in streams:  # its open streams end in-band
            raw = opened.first + b"".join([chunk async for chunk in opened.chunks])
            assert ending(raw) is not None
            await opened.close()
        await probe()
        assert health.up, "one failed probe is not `fall` failed probes"
        await probe()
        assert not health.up
        during = await client.post(gateway.url + URL, json=chat())
        assert during.status_code == 200 and during.headers["x-gateway-backend"] == "plain"

        await sim.servers["mtp"].clear_faults()  # restarted on the same port
        for _ in range(2):
            await probe()
            assert not health.up, "up before `rise` good probes"
        await probe()
        assert health.up
        after = await client.post(gateway.url + URL, json=chat(stream=True))
        assert after.status_code == 200 and after.headers["x-gateway-backend"] == "mtp"
        assert ending(after.content) is None
        await settled(gateway, 0)


GARBAGE_PROBE_ANSWERS = [b"<html>502 Bad Gateway</html>", b"\xff\xfe{",
                         {"loads": [{"num_running_reqs": "many"}]},
                         {"loads": [{"num_running_reqs": None}]}]


@pytest.mark.timeout(30)
async def test_a_backend_answering_garbage_probes_is_marked_down_and_probing_goes_on(sim) -> None:
    """A 200 whose body is not what SGLang sends (a proxy's HTML page, a half-started server)
    is a failed probe: it must not end the monitor, which would then never mark anything
    down or up again."""
    fake = FakeBackend()
    async with serve_app(fake.app) as fake_url:
        backends = {"mtp": {"url": fake_url}, "plain": {"url": sim.urls["plain"]}}
        async with live_gateway(None, backends=backends,
                                monitor={"interval_s": 0.02, "fall": 2, "rise": 2}) as gateway:
            health = gateway.pool.backends["mtp"]
            await wait_until(lambda: gateway.pool.backends["mtp"].good_probes >= 1)
            for i, garbage in enumerate(GARBAGE_PROBE_ANSWERS):
                fake.loads = garbage
                await wait_until(lambda: not health.up, timeout=3)
                fake.loads = {"loads": [{"num_running_reqs": i, "num_waiting_reqs": 1}]}
                await wait_until(lambda: health.up, timeout=3)
                assert (health.loads.running, health.loads.waiting) == (i, 1)


# --- the circuit breaker ---------------------------------------------------------------------

@pytest.mark.timeout(30)
async def test_circuit_opens_after_consecutive_failures_and_a_half_open_trial_closes_it(sim) -> None:
    open_s = 0.5
    await sim.servers["mtp"].set_faults(Faults(fail_status=500))  # a 5xx burst, until cleared
    monitor = {"circuit_failures": 3, "circuit_open_s": open_s}
    async with live_gateway(sim, monitor=monitor) as gateway, httpx.AsyncClient() as client:
        health = gateway.pool.backends["mtp"]

        async def one(stream: bool = False) -> httpx.Response:
            response = await client.post(gateway.url + URL, json=chat(max_tokens=4, stream=stream))
            assert response.status_code == 200
            return response

        async def mtp_failures() -> float:
            text = (await client.get(gateway.url + "/metrics")).text
            line = 'gateway_upstream_errors_total{backend="mtp",kind="status_5xx"} '
            return float(text.split(line)[1].split()[0]) if line in text else 0.0

        for i in range(3):
            assert not circuit_open(health), f"opened after {i} failures"
            response = await one(stream=i % 2 == 1)
            assert response.headers["x-gateway-route-reason"] == "failover"
        assert circuit_open(health)
        opened_at = time.monotonic()
        assert 'gateway_circuit_open{backend="mtp"} 1.0' in (await client.get(gateway.url + "/metrics")).text

        for _ in range(4):  # open: requests avoid mtp entirely, no failed attempt first
            assert (await one()).headers["x-gateway-backend"] == "plain"
        assert await mtp_failures() == 3

        await wait_until(lambda: not circuit_open(health), timeout=5)  # half-open
        assert time.monotonic() - opened_at >= open_s * 0.9
        trial = await one()  # the trial fails: open again at once, not after 3 more failures
        assert trial.headers["x-gateway-route-reason"] == "failover"
        assert circuit_open(health) and await mtp_failures() == 4

        await sim.servers["mtp"].clear_faults()  # the backend recovered
        await wait_until(lambda: not circuit_open(health), timeout=5)
        trial = await one(stream=True)
        assert trial.headers["x-gateway-backend"] == "mtp"
        assert not circuit_open(health) and gateway.pool.backends["mtp"].circuit.failures == 0
        for _ in range(3):
            assert (await one()).headers["x-gateway-backend"] == "mtp"
        await settled(gateway, 0)


def test_a_success_cancels_the_pending_half_open_of_an_earlier_opening() -> None:
    """Open, closed by a success (a request admitted earlier ended whole), open again: the
    second opening must last its full `open_s`, not end when the first one's would have."""
    open_s = 0.4
    pool = one_pair(circuit=CircuitRules(failures_to_open=2, open_s=open_s))
    mtp = pool.backends["mtp"]
    mtp.circuit_failure(10.0)
    mtp.circuit_failure(10.0)
    assert mtp.circuit.is_open(10.0)
    mtp.circuit_success()
    assert not mtp.circuit.is_open(10.0)
    reopened = 10.0 + open_s / 2  # time passes
    mtp.circuit_failure(reopened)
    mtp.circuit_failure(reopened)
    assert mtp.circuit.is_open(10.0 + open_s)  # the first opening would have ended here
    assert mtp.circuit.is_open(reopened + open_s * 0.95)
    assert not mtp.circuit.is_open(reopened + open_s)


@pytest.mark.timeout(30)
async def test_requests_that_fail_on_both_servers_open_neither_circuit() -> None:
    """A request that makes SGLang fail (its content, or both queues full) fails on the retry
    too. Counting that against the circuits would let a handful of such requests open both
    and turn every other client away with 503s."""
    fake = FakeBackend()
    fake.poison = b"make-it-fail"
    async with serve_app(fake.app) as fake_url:
        backends = {"mtp": {"url": fake_url}, "plain": {"url": fake_url}}
        async with live_gateway(None, backends=backends,
                                monitor={"circuit_failures": 3, "circuit_open_s": 60}) as gateway, \
                httpx.AsyncClient() as client:
            for stream in (False, True) * 4:
                failed = await client.post(gateway.url + URL,
                                           json=chat(stream=stream, user="make-it-fail"))
                assert failed.status_code == 500
                assert failed.json()["error"]["code"] == "upstream_error"
            health = gateway.pool.backends
            assert not circuit_open(health["mtp"]) and not circuit_open(health["plain"])
            served = await client.post(gateway.url + URL, json=chat())
            assert served.status_code == 200 and served.headers["x-gateway-backend"] == "mtp"
            metrics = (await client.get(gateway.url + "/metrics")).text
            assert 'gateway_upstream_errors_total{backend="mtp",kind="status_5xx"} 8.0' in metrics
            await settled(gateway, 0)


def test_half_open_lets_exactly_one_trial_through_at_a_time() -> None:
    """After the open period one request tries the backend; the rest keep away until it
    succeeds (closed) or fails (open again). A trial the client abandons frees the next."""
    pool = one_pair(circuit=CircuitRules(failures_to_open=2, open_s=0.05))
    mtp = pool.backends["mtp"]
    mtp.circuit_failure(1.0)
    mtp.circuit_failure(1.0)
    assert isinstance(lease := pool.admit(Ask(), 1.0), Lease)
    assert lease.backend.name == "plain"  # open
    lease.end(Outcome.SUCCESS, 1.0)
    now = 1.05
    assert mtp.circuit.is_half_open(now)
    trial = pool.admit(Ask(), now)
    others = [pool.admit(Ask(), now) for _ in range(3)]
    assert isinstance(trial, Lease) and trial.backend is mtp and trial.attempts[0].trial
    assert [(o.backend.name, o.reason) for o in others] == [("plain", "failover")] * 3
    trial.end(Outcome.CLIENT_GONE, now)  # no verdict: the client went away first
    second = pool.admit(Ask(), now)
    assert second.backend is mtp and second.attempts[0].trial
    second.end(Outcome.BACKEND_FAILURE, now, Failure("connect"))  # failed: open again at once
    assert mtp.circuit.is_open(now) and not mtp.circuit.is_half_open(now)
    now += 0.05
    third = pool.admit(Ask(), now)
    assert third.backend is mtp and third.attempts[0].trial
    third.end(Outcome.SUCCESS, now)
    assert mtp.accepting(now) and not mtp.circuit.is_half_open(now)
    for lease in others:
        lease.end(Outcome.SUCCESS, now)
    assert [pool.admit(Ask(), now).backend.name for _ in range(3)] == ["mtp"] * 3


# --- admission and bounded state ---------------------------------------------------------------

@pytest.mark.timeout(30)
async def test_over_max_inflight_gets_429_with_retry_after_and_recovers(sim) -> None:
    async with live_gateway(sim, limits={"max_inflight": 3}) as gateway, \
            httpx.AsyncClient(limits=httpx.Limits(max_connections=50)) as client:
        held = [await OpenStream(client, gateway.url + URL, chat(**LONG)).open() for _ in range(3)]
        refused = await asyncio.gather(
            *(client.post(gateway.url + URL, json=chat(stream=i % 2 == 0)) for i in range(20)))
        for response in refused:
            assert response.status_code == 429
            assert int(response.headers["retry-after"]) >= 1
            assert response.json() == {"error": {
                "message": response.json()["error"]["message"], "type": "rate_limit_error",
                "param": None, "code": "gateway_overloaded"}}
        assert gateway.pool.concurrency == 3  # a refusal never holds a slot
        metrics = (await client.get(gateway.url + "/metrics")).text
        assert 'gateway_rejected_total{reason="gateway_overloaded"} 20.0' in metrics
        await asyncio.gather(*(s.close() for s in held))
        await settled(gateway, 0)
        assert (await client.post(gateway.url + URL, json=chat())).status_code == 200


@pytest.mark.timeout(30)
async def test_state_kept_per_client_stays_bounded(sim) -> None:
    """Session ids are client-chosen: the map is capped. Upstream aborts do not pile up."""
    async with live_gateway(sim, routing={"max_sessions": 5}) as gateway, \
            httpx.AsyncClient() as client:
        for i in range(12):
            response = await client.post(gateway.url + URL, json=chat(max_tokens=1),
                                         headers={"x-session-id": f"session-{i}"})
            assert response.status_code == 200
        assert len(gateway.pool.sessions) == 5
        streams = [await OpenStream(client, gateway.url + URL, chat(**LONG)).open() for _ in range(8)]
        await asyncio.gather(*(s.close() for s in streams))  # eight disconnects, eight aborts
        await settled(gateway, 0)
        await wait_until(lambda: not gateway.runtime.proxy.aborts.background, timeout=5)
        await idle_engines(sim)


# --- a slow client ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("stock_uvicorn", [False, True], ids=["gateway-server", "stock-uvicorn"])
async def test_a_slow_client_holds_the_backend_back_instead_of_filling_gateway_memory(
        stock_uvicorn: bool) -> None:
    """A client that stops reading a fast stream: the gateway stops reading the backend (TCP
    pushes back) rather than buffering the stream, then relays every byte once it reads."""
    fake = FakeBackend()
    count, size = 4000, 16_000  # 64 MB, far more than the socket buffers on the way
    fake.flood = (count, size)
    async with serve_app(fake.app) as fake_url, \
            live_gateway(None, backends={"mtp": {"url": fake_url}, "plain": {"url": fake_url}},
                         stock_uvicorn=stock_uvicorn) as gateway, httpx.AsyncClient() as client:
        async with client.stream("POST", gateway.url + URL, json=chat(stream=True)) as response:
            raw = response.aiter_raw()
            received = [await raw.__anext__()]
            # The backend blocks in its writes for good, or (no pushback) finishes the stream.
            await wait_until(lambda: fake.flooded == count
                             or time.monotonic() - fake.last_yield_at > 0.5, timeout=30)
            assert fake.flooded < count // 2, "the gateway read on while its client did not"
            received += [chunk async for chunk in raw]
        events = sse_events(b"".join(received))
        assert events[-1] == "[DONE]" and len(events) == count + 1
        assert [int(event[:8]) for event in events[:-1]] == list(range(count))
        await settled(gateway, 0)


# --- events split anywhere by the backend ----------------------------------------------------

def _sse_stream(events: int) -> list[bytes]:
    chunk = {"id": "fake", "object": "chat.completion.chunk", "model": FakeBackend.MODEL,
             "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}
    out = [b"data: " + json.dumps(chunk).encode() + b"\n\n" for _ in range(events - 1)]
    chunk["choices"][0]["finish_reason"] = "stop"
    return [*out, b"data: " + json.dumps(chunk).encode() + b"\n\n", b"data: [DONE]\n\n"]


def _cut(data: bytes, cuts: int, seed: int) -> list[bytes]:
    points = sorted(random.Random(seed).sample(range(1, len(data)), cuts))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stock_uvicorn", [False, True], ids=["gateway-server", "stock-uvicorn"])
async def test_events_split_anywhere_by_the_backend_reach_the_client_whole(stock_uvicorn: bool) -> None:
    """The backend's writes cut events (and their blank line) at arbitrary bytes. A finished
    stream arrives byte for byte; one the backend abandons mid-event ends with whole events
    only, then the error event and [DONE]: never a torn event the client cannot parse."""
    events = _sse_stream(30)
    whole = b"".join(events)
    fake = FakeBackend()
    async with serve_app(fake.app) as fake_url, \
            live_gateway(None, backends={"mtp": {"url": fake_url}, "plain": {"url": fake_url}},
                         stock_uvicorn=stock_uvicorn) as gateway, httpx.AsyncClient() as client:
        for seed in range(3):
            fake.pieces, fake.die_after_pieces = _cut(whole, 60, seed), False
            response = await client.post(gateway.url + URL, json=chat(stream=True))
            assert response.content == whole, seed

            died_at = len(b"".join(events[:15])) + 40  # inside the 16th event
            fake.pieces, fake.die_after_pieces = _cut(whole[:died_at], 30, seed), True
            response = await client.post(gateway.url + URL, json=chat(stream=True))
            error = ending(response.content)
            assert error is not None and error["code"] == "upstream_stream_broken", error
            assert response.content.startswith(b"".join(events[:15]))
            assert len(sse_events(response.content)) == 15 + 2  # whole events, error, [DONE]
        await settled(gateway, 0)
