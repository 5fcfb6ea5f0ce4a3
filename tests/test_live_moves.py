"""Live moves at the flip: streams queued on MTP that have had no byte move to plain.

A simulated pair whose MTP server runs 2 requests at once, a crossover of 6: two long streams
run on MTP, four more requests queue behind them there, and the seventh request flips the pair
to plain. The queued streams then move (cancelled on MTP, re-sent whole to plain) and end as
ordinary streams from plain; the running ones and the non-streamed one stay where they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import openai
import pytest

from gateway.sim.faults import Faults
from gateway.sim.profile import load_profiles
from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from tests.conftest import LiveGateway, live_gateway
from tests.live import wait_until

MODEL = "Qwen/Qwen3.5-122B-A10B"
MTP_CAP = 2
CROSSOVER = 6
QUEUED_STREAMS = 3
ROUTING = {"crossover": CROSSOVER, "hysteresis": 2, "min_dwell_s": 600,
           "adaptive_crossover": False, "adapt_to_accept_length": False}


@pytest.fixture
async def small_mtp() -> AsyncIterator[SimPair]:
    """The pair with MTP's running cap at 2, at 5x the modelled GPU: a 100,000-token stream
    runs for minutes of wall time, so what queues behind it stays queued until the test says."""
    profiles = load_profiles()
    profiles["mtp"] = dataclasses.replace(profiles["mtp"], max_running_requests=MTP_CAP)
    async with start_sim_pair(SimOptions(speed=5, profiles=profiles)) as pair:
        yield pair


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def _open_stream(client: openai.AsyncOpenAI, max_tokens: int,
                       **extra: Any) -> tuple[Any, Any]:
    """A chat stream opened with the SDK: its raw response (headers) and its chunk stream."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_messages("hello"), max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **extra)
    return raw, raw.parse()


async def _whole_stream(client: openai.AsyncOpenAI, max_tokens: int,
                        **extra: Any) -> dict[str, Any]:
    """One streamed answer read to its end, as a client sees it."""
    raw, stream = await _open_stream(client, max_tokens, **extra)
    text, finish, usage = [], None, None
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return {"backend": raw.headers["x-gateway-backend"],
            "reason": raw.headers["x-gateway-route-reason"], "text": "".join(text),
            "finish": finish, "completion_tokens": usage.completion_tokens if usage else None}


async def _whole_answer(client: openai.AsyncOpenAI, max_tokens: int) -> dict[str, Any]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_messages("hello"), max_tokens=max_tokens,
        extra_body={"ignore_eos": True})
    answer = raw.parse()
    return {"backend": raw.headers["x-gateway-backend"],
            "reason": raw.headers["x-gateway-route-reason"],
            "completion_tokens": answer.usage.completion_tokens}


class Burst:
    """Two streams running on MTP, then three streams and one non-streamed request queued
    behind them there, then the request that flips the pair to plain."""

    def __init__(self, gateway: LiveGateway, pair: SimPair, client: openai.AsyncOpenAI) -> None:
        self.gateway, self.pair, self.client = gateway, pair, client
        self.mtp = pair.servers["mtp"].live.engine

    async def start(self, before_flip: Callable[[], Awaitable[None]] | None = None,
                    queued: Sequence[Callable[[], Awaitable[Any]]] = ()) -> None:
        """`queued`: the three streams that queue (default: chat streams by the SDK)."""
        pool = self.gateway.pool
        self.running = [await _open_stream(self.client, 100_000) for _ in range(MTP_CAP)]
        self.firsts = [await anext(aiter(stream)) for _, stream in self.running]
        queued = queued or [lambda: _whole_stream(self.client, 40)] * QUEUED_STREAMS
        self.queued = [asyncio.create_task(send()) for send in queued]
        self.whole = asyncio.create_task(_whole_answer(self.client, 40))
        queued = QUEUED_STREAMS + 1
        await wait_until(lambda: self.mtp.num_waiting == queued, timeout=20)
        assert pool.backends["mtp"].inflight == MTP_CAP + queued
        assert pool.backends["mtp"].not_started == queued
        assert pool.pairs["default"].mode == "mtp"
        if before_flip is not None:
            await before_flip()
        self.flip = asyncio.create_task(_whole_stream(self.client, 40))
        await wait_until(lambda: pool.pairs["default"].mode == "plain", timeout=20)

    async def finish(self) -> None:
        """The running streams end (their clients close them); everything else ends by
        itself, and the gateway's counts return to zero."""
        for raw, stream in self.running:
            assert raw.headers["x-gateway-backend"] == "mtp"
            await stream.close()
        await asyncio.wait_for(asyncio.gather(*self.queued, self.whole, self.flip), timeout=30)
        await wait_until(lambda: self.gateway.pool.concurrency == 0, timeout=10)
        assert [b.not_started for b in self.gateway.pool.backends.values()] == [0, 0]


def _moved_total(metrics: str) -> float:
    found = re.search(r'^gateway_moved_requests_total\{from_backend="mtp",to_backend="plain"\} '
                      r"(\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.timeout(90)
async def test_flip_moves_queued_streams_to_plain(small_mtp, caplog) -> None:
    caplog.set_level(logging.INFO, logger="mtp_gateway.access")
    async with live_gateway(small_mtp, routing=ROUTING) as gateway, \
            httpx.AsyncClient() as http:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        burst = Burst(gateway, small_mtp, client)
        await burst.start()
        moved = await asyncio.wait_for(asyncio.gather(*burst.queued), timeout=30)
        flip = await burst.flip
        # Each queued stream came whole from plain, as a stream plain served from the start.
        assert [(m["backend"], m["reason"]) for m in moved] == [("plain", "moved")] * 3
        assert all(m["finish"] == "length" and m["completion_tokens"] == 40 and m["text"]
                   for m in moved)
        assert (flip["backend"], flip["reason"]) == ("plain", "above_crossover")
        # MTP kept its running streams and the non-streamed request (its start is unknowable);
        # its queue holds nothing else: the moved requests were aborted there.
        await wait_until(lambda: burst.mtp.num_waiting == 1, timeout=10)
        assert burst.mtp.num_running == MTP_CAP
        assert gateway.pool.backends["mtp"].inflight == MTP_CAP + 1
        assert not burst.whole.done()
        metrics = (await http.get(gateway.url + "/metrics")).text
        assert _moved_total(metrics) == QUEUED_STREAMS
        dashboard = (await http.get(gateway.url + "/dashboard/state")).json()
        assert [p["moved"] for p in dashboard["pairs"]] == [QUEUED_STREAMS]
        await burst.finish()
        assert (await burst.whole)["backend"] == "mtp"
        await client.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "mtp_gateway.access"]
    moved_lines = [line for line in lines if "moved_from=mtp" in line]
    assert len(moved_lines) == QUEUED_STREAMS
    assert all("backend=plain reason=moved status=200" in line and "ended=complete" in line
               for line in moved_lines)


@pytest.mark.timeout(90)
async def test_nothing_moves_with_move_unstarted_off(small_mtp) -> None:
    routing = {**ROUTING, "move_unstarted": False}
    async with live_gateway(small_mtp, routing=routing) as gateway, httpx.AsyncClient() as http:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        burst = Burst(gateway, small_mtp, client)
        await burst.start()
        flip = await asyncio.wait_for(burst.flip, timeout=30)
        assert (flip["backend"], flip["reason"]) == ("plain", "above_crossover")
        assert burst.mtp.num_waiting == QUEUED_STREAMS + 1
        assert not any(task.done() for task in burst.queued)
        assert _moved_total((await http.get(gateway.url + "/metrics")).text) == 0
        await burst.finish()
        assert [(t.result()["backend"], t.result()["reason"]) for t in burst.queued] == \
            [("mtp", "below_crossover")] * QUEUED_STREAMS
        await client.close()


@pytest.mark.timeout(90)
async def test_a_moved_stream_that_plain_fails_is_retried_like_any_other(small_mtp) -> None:
    """Plain answers the flip's request and the three moved streams with HTTP 500: each is
    retried on MTP (plain excluded, as after any failure before the first byte), each counts
    once against plain's circuit, and every client still gets its whole stream."""
    async def plain_fails() -> None:
        await small_mtp.servers["plain"].set_faults(Faults(fail_status=500, fail_count=4))

    # No health probes during the burst: /health answers 503 while the fault is set.
    async with live_gateway(small_mtp, routing=ROUTING, monitor={"interval_s": 600}) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        burst = Burst(gateway, small_mtp, client)
        await burst.start(before_flip=plain_fails)
        await wait_until(lambda: burst.mtp.num_waiting == QUEUED_STREAMS + 2, timeout=20)
        assert gateway.pool.backends["plain"].inflight == 0
        await burst.finish()
        streams = [task.result() for task in (*burst.queued, burst.flip)]
        assert [(s["backend"], s["reason"]) for s in streams] == [("mtp", "failover")] * 4
        assert all(s["finish"] == "length" and s["completion_tokens"] == 40 for s in streams)
        assert gateway.pool.backends["plain"].circuit.failures == 4
        assert gateway.pool.backends["mtp"].circuit.failures == 0
        await client.close()


@pytest.mark.timeout(90)
async def test_at_a_flip_with_handoff_running_the_running_streams_go_on_on_plain(small_mtp):
    """routing.handoff_running, live: at the flip to plain, MTP's running streams are
    continued on plain (not only in the virtual bench), MTP left with nothing running."""
    routing = {**ROUTING, "handoff_running": True}
    async with live_gateway(small_mtp, routing=routing) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        burst = Burst(gateway, small_mtp, client)
        await burst.start()
        await wait_until(lambda: _continued_now(gateway) == MTP_CAP, timeout=20)
        for (_, stream), first in zip(burst.running, burst.firsts, strict=True):
            chunks = [await anext(aiter(stream)) for _ in range(5)]  # it goes on, one stream
            assert {chunk.id for chunk in chunks} == {first.id}
        await wait_until(lambda: burst.mtp.num_running == 0, timeout=10)
        assert gateway.pool.backends["plain"].inflight >= MTP_CAP
        await burst.finish()
        await client.close()


def _continued_now(gateway: LiveGateway) -> float:
    """gateway_continued_requests_total{cause="flip"}, summed."""
    metric = gateway.runtime.metrics.continued
    return sum(sample.value for family in metric.collect() for sample in family.samples
               if sample.name.endswith("_total") and sample.labels["cause"] == "flip")


@pytest.mark.timeout(60)
async def test_a_burst_arriving_at_once_reaches_each_server_once_per_request() -> None:
    """Twelve streams sent together, crossover 4, MTP too slow to start any: the four MTP
    took move at the flip, most before their request was even sent to MTP. Each request
    reaches plain once (an opening cancelled by the move sends nothing), and each stream ends
    whole."""
    seen: list[tuple[str, str]] = []
    async with start_sim_pair(SimOptions(speed=5)) as pair:
        await pair.servers["mtp"].set_faults(Faults(slow_factor=10_000))
        for name, server in pair.servers.items():
            engine = server.live.engine
            submit = engine.submit

            def record(request: Any, name: str = name, submit: Any = submit) -> None:
                seen.append((name, request.rid))
                submit(request)

            engine.submit = record
        routing = {**ROUTING, "crossover": 4}
        async with live_gateway(pair, routing=routing) as gateway, httpx.AsyncClient() as http:
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused",
                                        max_retries=0)
            streams = await asyncio.gather(*(_whole_stream(client, 20) for _ in range(12)))
            assert all(s["finish"] == "length" and s["completion_tokens"] == 20
                       for s in streams)
            assert sorted(s["reason"] for s in streams).count("moved") == 4
            assert {s["backend"] for s in streams} == {"plain"}
            metrics = (await http.get(gateway.url + "/metrics")).text
            assert _moved_total(metrics) == 4
            await wait_until(lambda: gateway.pool.concurrency == 0, timeout=10)
            await client.close()
    on_plain = [rid for name, rid in seen if name == "plain"]
    assert len(on_plain) == len(set(on_plain)) == 12


async def _raw_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.stream("POST", url, json=body) as response:
        raw = await response.aread()
    return {"status": response.status_code, "backend": response.headers["x-gateway-backend"],
            "reason": response.headers["x-gateway-route-reason"], "body": raw}


@pytest.mark.timeout(90)
async def test_responses_and_messages_streams_move_too(small_mtp) -> None:
    """SGLang's Responses stream sends response.created and response.in_progress before any
    output (serving_responses.py:2144-2145): events that say nothing of the answer, which the
    relay holds until the first one that does. A stream that had only those is still movable;
    the client gets plain's stream alone, lead-in included."""
    async with live_gateway(small_mtp, routing=ROUTING) as gateway, \
            httpx.AsyncClient(timeout=60) as http:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        responses = {"model": MODEL, "input": "hello", "max_output_tokens": 40, "stream": True}
        messages = {"model": MODEL, "messages": _messages("hello"), "max_tokens": 40,
                    "stream": True}
        burst = Burst(gateway, small_mtp, client)
        await burst.start(queued=[
            lambda: _raw_stream(http, gateway.url + "/v1/responses", responses),
            lambda: _raw_stream(http, gateway.url + "/v1/messages", messages),
            lambda: _whole_stream(client, 40)])
        moved = await asyncio.wait_for(asyncio.gather(*burst.queued), timeout=30)
        assert [(m["backend"], m["reason"]) for m in moved] == [("plain", "moved")] * 3
        responses_body, messages_body = moved[0]["body"], moved[1]["body"]
        assert responses_body.count(b"event: response.created") == 1
        # At max_output_tokens the Responses stream ends "incomplete", as SGLang's does.
        assert b"event: response.incomplete" in responses_body
        assert b'"output_tokens":40' in responses_body
        assert messages_body.count(b"event: message_start") == 1
        assert b"event: message_stop" in messages_body and b'"output_tokens":40' in messages_body
        await burst.finish()
        await client.close()


@pytest.mark.timeout(90)
async def test_a_stream_pinned_to_mtp_is_not_moved(small_mtp) -> None:
    """A client's pin (x-gateway-pin) says where the request must run: the flip leaves it."""
    routing = {**ROUTING, "allow_pin_header": True}
    async with live_gateway(small_mtp, routing=routing) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        pinned = {"extra_headers": {"x-gateway-pin": "mtp"}}
        burst = Burst(gateway, small_mtp, client)
        await burst.start(queued=[lambda: _whole_stream(client, 40, **pinned),
                                  lambda: _whole_stream(client, 40),
                                  lambda: _whole_stream(client, 40)])
        moved = await asyncio.wait_for(asyncio.gather(*burst.queued[1:]), timeout=30)
        assert [(m["backend"], m["reason"]) for m in moved] == [("plain", "moved")] * 2
        assert burst.mtp.num_waiting == 2 and not burst.queued[0].done()  # with the non-stream
        await burst.finish()
        assert (burst.queued[0].result()["backend"], burst.queued[0].result()["reason"]) == \
            ("mtp", "pinned")
        await client.close()


@pytest.mark.timeout(90)
async def test_a_stream_already_sent_keepalives_still_moves_whole(small_mtp, caplog) -> None:
    """A queued stream that has had keep-alive comments (its headers are out, naming MTP) has
    had no event: it still moves, and the SDK reads one whole stream from plain."""
    caplog.set_level(logging.INFO, logger="mtp_gateway.access")
    async with live_gateway(small_mtp, routing=ROUTING, timeouts={"keepalive_s": 0.05}) \
            as gateway, httpx.AsyncClient() as http:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        burst = Burst(gateway, small_mtp, client)

        def keepalives_out() -> bool:  # every queued stream has its headers and a comment
            mtp = gateway.pool.backends["mtp"]
            waiting = [e for e in gateway.runtime.proxy.in_flight.openings.values()
                       if e.lease.backend is mtp]
            return len(waiting) == QUEUED_STREAMS and all(e.committed for e in waiting)

        async def keepalives_sent() -> None:
            await wait_until(keepalives_out, timeout=10)

        await burst.start(before_flip=keepalives_sent)
        moved = await asyncio.wait_for(asyncio.gather(*burst.queued), timeout=30)
        assert all(m["finish"] == "length" and m["completion_tokens"] == 40 for m in moved)
        assert {m["backend"] for m in moved} == {"mtp"}  # what the headers said when sent
        assert _moved_total((await http.get(gateway.url + "/metrics")).text) == QUEUED_STREAMS
        await burst.finish()
        await client.close()
    moved_lines = [r.getMessage() for r in caplog.records
                   if r.name == "mtp_gateway.access" and "moved_from=mtp" in r.getMessage()]
    assert len(moved_lines) == QUEUED_STREAMS
    assert all("backend=plain reason=moved status=200" in line for line in moved_lines)


@pytest.mark.timeout(10)
async def test_a_stream_whose_first_bytes_wait_unread_is_not_moved() -> None:
    """The backend's first bytes can be in the upstream buffer, not yet taken by the opening
    task, at the instant of the flip: moving that stream would throw away an answer that has
    begun. Only a stream with nothing unread is movable."""
    from types import SimpleNamespace

    from gateway.relay.exchange import Waiting
    from gateway.relay.in_flight import movable

    source, target = object(), object()
    lease = SimpleNamespace(backend=source, movable=True, attempts=[SimpleNamespace(backend=source)])
    upstream = SimpleNamespace(unread=False)
    task = asyncio.current_task()
    assert task is not None
    exchange = SimpleNamespace(waiting=Waiting(task),
                               upstream=upstream, lease=lease)
    assert movable(exchange, source, target)
    upstream.unread = True  # bytes arrived; the opening has not run since
    assert not movable(exchange, source, target)
