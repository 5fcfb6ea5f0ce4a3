"""A running stream continued on the other server reaches the real SDKs as one answer.

The simulated MTP server crashes after its 4th event (gateway/sim/faults.py); the gateway
continues each stream on plain from what its client has (gateway.relay.continuing). Or, at a turn, the
relay's `InFlight.continue_running` takes the running streams of one server to the other, once or
twice. The simulator's tokens are words, so "nothing repeated or lost at the seam" is: the
answer has exactly as many words as its usage counts completion tokens, and with `max_tokens`
(and `ignore_eos`) exactly that many."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.sim.faults import Faults
from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from tests.conftest import LiveGateway, live_gateway
from tests.live import wait_until

MODEL = "Qwen/Qwen3.5-122B-A10B"
PROMPT = "tell me about the gateway in front of the pair"
LIMIT = 40
CRASH = Faults(crash_after_chunks=4)


@pytest.fixture
async def pair() -> AsyncIterator[SimPair]:
    async with start_sim_pair(SimOptions(speed=20)) as started:
        yield started


def _openai(gateway: LiveGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


def _claude(gateway: LiveGateway) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway.url, api_key="x", max_retries=0)


Moves = Callable[[int], Awaitable[None]]  # called with the number of text pieces read so far


async def _no_moves(_: int) -> None:
    return None


async def chat(gateway: LiveGateway, moves: Moves = _no_moves, *, limit: int = LIMIT
               ) -> dict[str, Any]:
    stream = await _openai(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=limit,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": limit == LIMIT})
    text, ids, roles, finishes, usage = [], set(), 0, [], None
    async for chunk in stream:
        ids.add(chunk.id)
        for choice in chunk.choices:
            roles += choice.delta.role == "assistant"
            if choice.delta.content:
                text.append(choice.delta.content)
                await moves(len(text))
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert len(ids) == 1 and roles == 1 and len(finishes) == 1
    return {"text": "".join(text), "finish": finishes[0], "completion": usage.completion_tokens,
            "prompt": usage.prompt_tokens}


async def completion(gateway: LiveGateway, moves: Moves = _no_moves) -> dict[str, Any]:
    stream = await _openai(gateway).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=LIMIT, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, ids, finishes, usage = [], set(), [], None
    async for chunk in stream:
        ids.add(chunk.id)
        for choice in chunk.choices:
            if choice.text:
                text.append(choice.text)
                await moves(len(text))
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert len(ids) == 1 and len(finishes) == 1
    return {"text": "".join(text), "finish": finishes[0], "completion": usage.completion_tokens,
            "prompt": usage.prompt_tokens}


async def message(gateway: LiveGateway, moves: Moves = _no_moves, *, limit: int = LIMIT,
                  blocks: int = 1) -> dict[str, Any]:
    pieces = 0
    async with _claude(gateway).messages.stream(
            model=MODEL, max_tokens=limit, messages=[{"role": "user", "content": PROMPT}],
            extra_body={"ignore_eos": True} if limit == LIMIT else None) as stream:
        starts = 0
        async for event in stream:
            starts += event.type == "message_start"
            if event.type == "content_block_delta":
                pieces += 1
                await moves(pieces)
        final = await stream.get_final_message()
    assert starts == 1 and 1 <= len(final.content) <= blocks
    assert [block.type for block in final.content] == ["text"] * len(final.content)
    return {"text": "".join(block.text for block in final.content), "finish": final.stop_reason,
            "completion": final.usage.output_tokens, "prompt": final.usage.input_tokens}


async def response(gateway: LiveGateway, moves: Moves = _no_moves, *, limit: int = LIMIT,
                   blocks: int = 1) -> dict[str, Any]:
    stream = await _openai(gateway).responses.create(
        model=MODEL, input=PROMPT, max_output_tokens=limit, stream=True,
        extra_body={"ignore_eos": True} if limit == LIMIT else None)
    pieces, created, final = 0, 0, None
    numbers = []
    async for event in stream:
        numbers.append(event.sequence_number)
        created += event.type == "response.created"
        if event.type == "response.output_text.delta":
            pieces += 1
            await moves(pieces)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert created == 1 and final is not None and numbers == list(range(len(numbers)))
    assert 1 <= len(final.output) <= blocks
    return {"text": final.output_text, "finish": final.status,
            "completion": final.usage.output_tokens, "prompt": final.usage.input_tokens}


def _words(text: str) -> int:
    return len(text.split())


def _continued(metrics: str, cause: str, source: str = "mtp", target: str = "plain") -> float:
    labels = f'cause="{cause}",from_backend="{source}",to_backend="{target}"'
    found = re.search(r"^gateway_continued_requests_total\{" + labels + r"\} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


async def _metrics(gateway: LiveGateway) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(gateway.url + "/metrics")).text


READERS = {"chat": chat, "completions": completion, "messages": message, "responses": response}
AT_LIMIT = {"chat": "length", "completions": "length", "messages": "max_tokens",
            "responses": "incomplete"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", ["chat", "messages", "responses", "completions"])
async def test_a_stream_whose_server_crashes_after_its_fourth_event_ends_whole(pair, api,
                                                                              caplog):
    caplog.set_level(logging.INFO, logger="mtp_gateway.access")
    await pair.servers["mtp"].set_faults(CRASH)
    async with live_gateway(pair) as gateway:
        answer = await asyncio.wait_for(READERS[api](gateway), timeout=30)
        assert answer["finish"] == AT_LIMIT[api]
        assert answer["completion"] == LIMIT == _words(answer["text"])
        metrics = await _metrics(gateway)
        assert _continued(metrics, "failure") == 1
        # The circuit counts the failure against the server that failed.
        assert re.search(r'^gateway_upstream_errors_total\{backend="mtp",kind="broken_stream"\} '
                         r'1\.0$', metrics, re.M), metrics
        assert gateway.pool.backends["mtp"].circuit.failures == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "mtp_gateway.access"]
    assert len(lines) == 1 and "backend=plain reason=failover status=200" in lines[0]
    assert "ended=complete" in lines[0] and "continued_from=mtp" in lines[0]
    if api in ("chat", "completions"):  # the usage the access line reads (prompt/completion)
        assert f"completion_tokens={LIMIT}" in lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_below_the_limit_a_continued_stream_ends_as_it_would_have(pair, api):
    await pair.servers["mtp"].set_faults(CRASH)
    async with live_gateway(pair) as gateway:
        answer = await READERS[api](gateway, limit=4000)  # below it: the natural stop
        assert answer["finish"] == {"chat": "stop", "messages": "end_turn",
                                    "responses": "completed"}[api]
        assert answer["completion"] == _words(answer["text"]) > 4


@pytest.mark.timeout(60)
async def test_off_the_crash_ends_with_an_error_as_before(pair):
    await pair.servers["mtp"].set_faults(CRASH)
    async with live_gateway(pair, handoff={"on_failure": False}) as gateway:
        with pytest.raises(openai.APIError):
            await chat(gateway)
        assert _continued(await _metrics(gateway), "failure") == 0


@pytest.mark.timeout(60)
async def test_a_stream_beyond_its_transcript_bound_finishes_where_it_is_at_a_turn(pair):
    """handoff.transcript_chunks: a stream that sent more pieces than the gateway keeps whole
    is not continued (its transcript would not be whole): it finishes where it is. Bound 1:
    the client has read six text deltas, so the gateway has sent its first events and at
    least one piece after them, however the bytes were cut."""
    async with live_gateway(pair, handoff={"transcript_chunks": 1}) as gateway:
        handed: list[Any] = []
        backends = gateway.pool.backends

        async def turn(pieces: int) -> None:
            if pieces == 6:
                handed.append(await gateway.runtime.proxy.in_flight.continue_running(backends["mtp"],
                                                                            backends["plain"]))
        answer = await chat(gateway, turn)
        assert handed[0].continued == 0 and handed[0].staying == {"transcript_chunks": 1}
        assert answer["finish"] == "length" and answer["completion"] == LIMIT == _words(answer["text"])
        assert _continued(await _metrics(gateway), "turn") == 0


def _turns(gateway: LiveGateway, at: tuple[int, ...]) -> tuple[Moves, list[Any]]:
    """Hand the running streams over at the given pieces read: MTP to plain, then back."""
    backends = gateway.pool.backends
    route = [(backends["mtp"], backends["plain"]), (backends["plain"], backends["mtp"])]
    results: list[Any] = []

    async def moves(pieces: int) -> None:
        if len(results) < len(at) and pieces == at[len(results)]:
            source, target = route[len(results)]
            results.append(await gateway.runtime.proxy.in_flight.continue_running(source, target))
    return moves, results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
@pytest.mark.parametrize("times", [1, 2])
async def test_a_stream_handed_over_at_a_turn_once_or_twice_is_one_answer(pair, api, times):
    async with live_gateway(pair) as gateway:
        moves, results = _turns(gateway, (3, 8)[:times])
        answer = await asyncio.wait_for(READERS[api](gateway, moves), timeout=30)
        assert [r.continued for r in results] == [1] * times
        assert answer["finish"] == AT_LIMIT[api]
        assert answer["completion"] == LIMIT == _words(answer["text"])
        metrics = await _metrics(gateway)
        assert _continued(metrics, "turn") == 1
        if times == 2:
            assert _continued(metrics, "turn", "plain", "mtp") == 1
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)
        assert gateway.pool.backends["mtp"].circuit.failures == 0  # a turn is no failure


@pytest.mark.timeout(60)
async def test_a_stream_that_cannot_be_continued_stays_at_a_turn(pair):
    """Reasoning relayed: the prefix would not carry it (serving_chat.py:540-545)."""
    async with live_gateway(pair) as gateway:
        client = _openai(gateway)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=LIMIT,
            stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        first = [await anext(aiter(stream)) for _ in range(3)]
        assert any(c.choices[0].delta.model_extra.get("reasoning_content") for c in first[1:])
        backends = gateway.pool.backends
        handed = await gateway.runtime.proxy.in_flight.continue_running(backends["mtp"], backends["plain"])
        assert handed.continued == 0 and handed.staying == {"reasoning": 1}
        rest = [chunk async for chunk in stream]
        assert rest[-1].choices[0].finish_reason == "length"



@pytest.mark.timeout(60)
async def test_a_stream_whose_server_goes_silent_is_continued_after_the_idle_timeout():
    options = SimOptions(speed=20, shared_device=False)  # mtp's stall must not block plain
    async with start_sim_pair(options) as pair, \
            live_gateway(pair, timeouts={"idle_s": 0.4}) as gateway:
        mtp = pair.servers["mtp"]

        async def stall(pieces: int) -> None:
            if pieces == 3:
                await mtp.set_faults(Faults(slow_factor=1e6))
        answer = await asyncio.wait_for(chat(gateway, stall), timeout=30)
        assert answer["finish"] == "length"
        assert answer["completion"] == LIMIT == _words(answer["text"])
        assert gateway.pool.backends["mtp"].circuit.failures == 1
        await wait_until(lambda: mtp.live.engine.num_running == 0, timeout=5)  # aborted there


@pytest.mark.timeout(60)
async def test_a_crashed_stream_is_continued_through_uvicorn_as_shipped_too(pair):
    """The relay by ASGI send (no body writer): the same continuation."""
    await pair.servers["mtp"].set_faults(CRASH)
    async with live_gateway(pair, stock_uvicorn=True) as gateway:
        answer = await asyncio.wait_for(chat(gateway), timeout=30)
        assert answer["finish"] == "length"
        assert answer["completion"] == LIMIT == _words(answer["text"])


@pytest.mark.timeout(60)
async def test_a_crashed_generate_stream_is_continued_with_sglangs_own_ids(pair):
    await pair.servers["mtp"].set_faults(CRASH)
    async with live_gateway(pair) as gateway, httpx.AsyncClient(timeout=30) as client:
        body = {"text": PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": LIMIT, "ignore_eos": True}}
        raw = (await client.post(gateway.url + "/generate", json=body)).content
    chunks = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    last = chunks[-1]
    assert raw.endswith(b"data: [DONE]\n\n")
    assert len({c["meta_info"]["id"] for c in chunks}) == 1
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["completion_tokens"] == LIMIT == _words(last["text"])
    assert len(last["output_ids"]) == LIMIT
    # Cumulative over the seam: every chunk's text goes on from the one before.
    assert all(later["text"].startswith(earlier["text"])
               for earlier, later in zip(chunks, chunks[1:], strict=False))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_a_stream_ended_by_its_servers_own_error_event_is_continued(pair, api):
    """SGLang's mid-stream error (a scheduler abort with a status: its error event in the
    API's shape) never reaches the client: the stream goes on on plain, the error still
    counted against MTP."""
    await pair.servers["mtp"].set_faults(Faults(error_after_chunks=4, abort_status=500))
    async with live_gateway(pair) as gateway:
        # SGLang's adapter closes the open block before its error (anthropic/serving.py:
        # 978-993): when that close reached the client first, the text goes on in a new block.
        extra = {"blocks": 2} if api != "chat" else {}  # Responses: its item done likewise
        answer = await asyncio.wait_for(READERS[api](gateway, **extra), timeout=30)
        assert answer["finish"] == AT_LIMIT[api]
        assert answer["completion"] == LIMIT == _words(answer["text"])
        assert gateway.pool.backends["mtp"].circuit.failures == 1
        assert _continued(await _metrics(gateway), "failure") == 1


@pytest.mark.timeout(60)
async def test_a_crashed_stream_with_a_tool_call_begun_ends_with_its_error(pair):
    """Not continued (the prefix would not carry the call, serving_chat.py:540-545): the SDK
    raises, as without continuations; the failure counts against MTP, nothing against plain."""
    await pair.servers["mtp"].set_faults(CRASH)
    async with live_gateway(pair) as gateway:
        stream = await _openai(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=LIMIT,
            stream=True, tools=[{"type": "function", "function": {"name": "read", "parameters": {}}}])
        calls = 0
        with pytest.raises(openai.APIError, match="broken|closed"):
            async for chunk in stream:
                calls += bool(chunk.choices and chunk.choices[0].delta.tool_calls)
        assert calls >= 1
        assert _continued(await _metrics(gateway), "failure") == 0
        assert gateway.pool.backends["mtp"].circuit.failures == 1
        assert gateway.pool.backends["plain"].circuit.failures == 0


@pytest.mark.timeout(60)
async def test_a_turn_takes_the_streams_to_a_paused_server_that_runs_them_once_it_continues(pair):
    """continue_running(wait_opened=False): the streams leave MTP at once (aborted there); plain,
    paused, holds their continuations (tokenizer_manager.py:938-939) until it continues."""
    async with live_gateway(pair) as gateway, httpx.AsyncClient(timeout=10) as http:
        plain_url = pair.servers["plain"].url
        assert (await http.post(plain_url + "/pause_generation", json={"mode": "in_place"})
                ).status_code == 200
        backends, taken = gateway.pool.backends, []

        async def turn(pieces: int) -> None:
            if pieces == 3:
                handover = gateway.runtime.proxy.in_flight
                taken.append(await handover.continue_running(backends["mtp"], backends["plain"],
                                                     wait_opened=False))
                engine = pair.servers["mtp"].live.engine
                await wait_until(lambda: engine.num_running == 0, timeout=5)  # left MTP
                assert (await http.post(plain_url + "/continue_generation", json={})
                        ).status_code == 200
        answer = await asyncio.wait_for(chat(gateway, turn), timeout=30)
        assert [t.continued for t in taken] == [1]
        assert answer["finish"] == "length"
        assert answer["completion"] == LIMIT == _words(answer["text"])
