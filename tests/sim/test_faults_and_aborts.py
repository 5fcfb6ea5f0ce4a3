"""Slots freed by disconnects and aborts, the queue limit, and every fault mode, over sockets."""

import asyncio
import contextlib
import dataclasses
import json
import re

import httpx
import pytest

from gateway.sim.faults import Faults
from gateway.sim.profile import load_profiles
from gateway.sim.server import SimOptions, start_sim_pair
from tests.sim.conftest import run_on_loop_clock, until_on_loop_clock, wait_until

LONG = {"model": "m", "prompt": "go on", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
SHORT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}


async def running(http: httpx.AsyncClient, url: str, headers: dict | None = None) -> int:
    return (await http.get(url + "/v1/loads", headers=headers)).json()["loads"][0]["num_running_reqs"]


def test_a_stream_whose_client_leaves_is_aborted_at_once():
    """The disconnect cancels the StreamingResponse and generate_request aborts on the
    CancelledError: the slot frees after the step in flight, not 2 s later (on the loop's
    clock, so a loaded machine cannot stretch it)."""
    run_on_loop_clock(_a_stream_whose_client_leaves_is_aborted_at_once)


async def _a_stream_whose_client_leaves_is_aborted_at_once():
    async with start_sim_pair(SimOptions(speed=1)) as pair, httpx.AsyncClient() as http:
        url = pair.urls["plain"]
        async with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            chunks = response.aiter_bytes()  # held: a collected iterator closes the stream
            await anext(chunks)
            assert await running(http, url) == 1
        # One decode step is ~15 ms; the old background abort came after 2 s.
        assert await until_on_loop_clock(lambda: _freed(http, url), within=2.0) < 0.1


def test_a_waiting_handler_notices_a_gone_client_when_it_wakes():
    """Queued behind a running request: a non-stream or a kick-started chat stream notices the
    disconnect at its 4 s wake-up; a Messages stream (already streaming) at once.

    On looptime's clock (it moves only when every task waits for a timer), so the 4 s are the
    simulator's and the client's timeout, not how busy the machine is: on the wall clock a
    loaded box once made the wake-up look early or late."""
    run_on_loop_clock(_a_waiting_handler_notices_a_gone_client_when_it_wakes)


async def _a_waiting_handler_notices_a_gone_client_when_it_wakes():
    speed = 4
    clock = asyncio.get_running_loop().time
    plain = dataclasses.replace(load_profiles()["plain"], max_running_requests=1)
    options = SimOptions(speed=speed, profiles={**load_profiles(), "plain": plain})
    messages = {"model": "m", "max_tokens": 50, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    async with start_sim_pair(options) as pair, httpx.AsyncClient() as http:
        url = pair.urls["plain"]
        async with http.stream("POST", url + "/v1/completions", json=LONG) as holder:
            held = holder.aiter_bytes()  # held: a collected iterator closes the stream
            await anext(held)
            for path, body in (("/v1/messages", messages), ("/v1/chat/completions", SHORT),
                               ("/v1/completions", {**LONG, "stream": False})):  # fmt: skip
                sent = clock()
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(url + path, json=body, timeout=0.05)
                gone = clock()
                await until_on_loop_clock(lambda: _waiting_is(http, url, 0), within=8.0 / speed)
                left = clock()
                if path == "/v1/messages":
                    assert left - gone < 4.0 / speed
                else:
                    assert left - sent >= 4.0 / speed


async def _waiting_is(http: httpx.AsyncClient, url: str, count: int) -> bool:
    return (await http.get(url + "/v1/loads")).json()["loads"][0]["num_waiting_reqs"] == count


def test_a_running_non_stream_request_is_aborted_at_its_next_50th_token():
    """On the loop's clock: on the wall clock a starved loop could let the simulator run
    several steps (it catches up late steps) before the handler looked."""
    run_on_loop_clock(_a_running_non_stream_request_is_aborted_at_its_next_50th_token)


async def _a_running_non_stream_request_is_aborted_at_its_next_50th_token():
    async with start_sim_pair(SimOptions(speed=5)) as pair, httpx.AsyncClient() as http:
        url, engine = pair.urls["plain"], pair.servers["plain"].live.engine
        with pytest.raises(httpx.ReadTimeout):
            await http.post(url + "/v1/completions", json={**LONG, "stream": False}, timeout=0.2)
        await until_on_loop_clock(lambda: _freed(http, url), within=5.0)
    # SGLang looks at the connection when an output comes (every 50 tokens for a non-stream
    # request); the abort frees the slot after the step in flight and the next (a token each).
    assert engine.stats.generated_tokens >= 50
    assert engine.stats.generated_tokens % 50 in (1, 2, 3)


async def _freed(http: httpx.AsyncClient, url: str, headers: dict | None = None) -> bool:
    return await running(http, url, headers) == 0


async def test_abort_request_frees_at_once_and_ends_the_stream(pair):
    url = pair.urls["mtp"]
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", url + "/v1/completions", json={**LONG, "rid": "job-17"}) as response:
            lines = response.aiter_lines()
            await anext(lines)
            # tokenizer_manager.abort_request drops a rid it does not hold: no prefix match.
            for ignored in ({"rid": "job-"}, {"rid": ""}, {}):
                assert (await http.post(url + "/abort_request", json=ignored)).status_code == 200
            assert await running(http, url) == 1
            aborted = await http.post(url + "/abort_request", json={"rid": "job-17"})
            assert aborted.status_code == 200
            assert await running(http, url) == 0
            rest = [line async for line in lines if line.startswith("data: {")]
    assert json.loads(rest[-1][6:])["choices"][0]["finish_reason"] == "abort"


async def test_abort_request_needs_the_admin_key_when_one_is_set():
    options = SimOptions(speed=50, api_key="user", admin_api_key="admin")
    async with start_sim_pair(options) as pair, httpx.AsyncClient() as http:
        url = pair.urls["plain"]
        user, admin = ({"Authorization": f"Bearer {key}"} for key in ("user", "admin"))
        body = {**LONG, "rid": "r1"}
        async with http.stream("POST", url + "/v1/completions", json=body, headers=user) as r:
            lines = r.aiter_lines()
            await anext(lines)
            refused = await http.post(url + "/abort_request", json={"rid": "r1"}, headers=user)
            assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
            assert (await http.get(url + "/v1/models", headers=admin)).status_code == 401
            allowed = await http.post(url + "/abort_request", json={"rid": "r1"}, headers=admin)
            assert allowed.status_code == 200
            await wait_until(lambda: _freed(http, url, user))


async def test_a_full_queue_answers_503_or_an_error_inside_a_200_stream():
    plain = dataclasses.replace(load_profiles()["plain"], max_running_requests=1)
    options = SimOptions(speed=50, profiles={**load_profiles(), "plain": plain}, max_queued_requests=1)
    async with start_sim_pair(options) as pair, httpx.AsyncClient() as http:
        url = pair.urls["plain"]
        async with http.stream("POST", url + "/v1/completions", json=LONG):
            queued = asyncio.create_task(http.post(url + "/v1/completions", json=LONG))
            await wait_until(lambda: _waiting(http, url))
            rejected = await http.post(url + "/v1/completions", json={**LONG, "stream": False})
            usage = {"include_usage": True}
            in_stream = await http.post(url + "/v1/chat/completions",
                                        json={**SHORT, "rid": "q1", "stream_options": usage})  # fmt: skip
            queued.cancel()
    assert rejected.status_code == 503
    assert rejected.json() == {"object": "error", "message": "The request queue is full.",
                               "type": "503", "param": None, "code": 503}  # fmt: skip
    # serving_chat.py: the abort's error chunk first (json.dumps spacing), usage, [DONE]; HTTP 200.
    assert in_stream.status_code == 200
    head = '{"id":"q1","object":"chat.completion.chunk","created":'
    assert re.fullmatch(
        'data: {"error": {"object": "error", "message": "The request queue is full.", '
        '"type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}}\n\n'
        "data: " + re.escape(head) + r'\d+,"model":"m","choices":\[\],"usage":{"prompt_tokens":0,'
        '"total_tokens":0,"completion_tokens":0,"prompt_tokens_details":null,"reasoning_tokens":0,'
        '"completion_tokens_details":null}}\n\n'
        "data: \\[DONE\\]\n\n",
        in_stream.text,
    )


async def _waiting(http: httpx.AsyncClient, url: str) -> bool:
    return (await http.get(url + "/v1/loads")).json()["loads"][0]["num_waiting_reqs"] == 1


async def test_crash_drops_the_connection_after_n_events(pair):
    await pair.servers["mtp"].set_faults(Faults(crash_after_chunks=3))
    events = []
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            async with http.stream("POST", pair.urls["mtp"] + "/v1/chat/completions", json=SHORT) as r:
                async for line in r.aiter_lines():
                    if line:
                        events.append(line)
        with pytest.raises(httpx.RemoteProtocolError):  # non-stream: headers, then nothing
            await http.post(pair.urls["mtp"] + "/v1/chat/completions", json={**SHORT, "stream": False})
    assert len(events) == 3 and "[DONE]" not in events[-1]


async def test_error_fault_sends_sglangs_mid_stream_error_then_done(pair):
    await pair.servers["plain"].set_faults(Faults(error_after_chunks=2))
    async with httpx.AsyncClient() as http:
        response = await http.post(pair.urls["plain"] + "/v1/chat/completions", json=SHORT)
    events = response.content.decode().split("\n\n")[:-1]
    assert response.status_code == 200 and len(events) == 4
    assert events[2].startswith('data: {"error": {"object": "error", "message": ')
    assert json.loads(events[2][6:])["error"]["code"] == 500
    assert events[3] == "data: [DONE]"
    await wait_until(lambda: pair.servers["plain"].live.engine.num_running == 0)


async def test_hang_sends_nothing_until_cleared(pair):
    server = pair.servers["mtp"]
    await server.set_faults(Faults(hang_before_first_byte=True))
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(pair.urls["mtp"] + "/v1/chat/completions", json=SHORT, timeout=0.3)
        pending = asyncio.create_task(http.post(pair.urls["mtp"] + "/v1/chat/completions", json=SHORT))
        await asyncio.sleep(0.1)
        assert not pending.done()
        cleared = await http.delete(pair.urls["mtp"] + "/sim/faults")
        assert cleared.json()["faults"]["hang_before_first_byte"] is False
        assert (await pending).content.endswith(b"data: [DONE]\n\n")


async def test_fail_status_for_a_count_then_recovers(pair):
    url = pair.urls["plain"]
    async with httpx.AsyncClient() as http:
        set_ = await http.post(url + "/sim/faults", json={"fail_status": 502, "fail_count": 2})
        assert set_.status_code == 200
        health = await http.get(url + "/health")
        failed = [await http.post(url + "/v1/chat/completions", json=SHORT) for _ in range(2)]
        ok = await http.post(url + "/v1/chat/completions", json=SHORT)
        state = (await http.get(url + "/sim/state")).json()
    assert health.status_code == 503
    assert [r.status_code for r in failed] == [502, 502]
    assert failed[0].json()["object"] == "error" and failed[0].json()["code"] == 502
    assert ok.status_code == 200
    assert state["faults"]["fail_status"] == 502  # still set, but its count is spent


async def test_slow_factor_stretches_every_step():
    speed, slow_factor, tokens = 10, 5.0, 40
    async with start_sim_pair(SimOptions(speed=speed)) as pair, httpx.AsyncClient() as http:
        body = {**SHORT, "max_tokens": tokens, "stream": False, "ignore_eos": True}
        url = pair.urls["plain"] + "/v1/chat/completions"
        await pair.servers["plain"].set_faults(Faults(slow_factor=slow_factor))
        slow = (await http.post(url, json=body)).elapsed.total_seconds()
    # One batch-1 decode step per token after the first (prefill left out, which only makes the
    # bound lower). Against the modelled time, not a second request's wall time: a loaded
    # machine stretches the fast request too, and a one-sided lower bound cannot fail by load.
    unslowed_s = (tokens - 1) * load_profiles()["plain"].decode_step_s(1) / speed
    assert slow >= slow_factor * unslowed_s, (slow, unslowed_s)


async def test_refused_connections_come_back_on_the_same_port(pair):
    server = pair.servers["plain"]
    url = pair.urls["plain"]
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            lines = response.aiter_lines()
            await anext(lines)
            await server.set_faults(Faults(refuse_connections=True))
            with pytest.raises(httpx.RemoteProtocolError):  # a crash drops open streams too
                async for _ in lines:
                    pass
        assert server.live.engine.num_running == 0
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as fresh:
                await fresh.get(url + "/ready")
        await server.clear_faults()
        assert (await http.get(url + "/ready")).status_code == 200
        await server.set_faults(Faults(refuse_connections=True, restore_after_s=0.2))
        await wait_until(lambda: _connects(url))


async def _connects(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as fresh:
            return (await fresh.get(url + "/ready")).status_code == 200
    except httpx.ConnectError:
        return False


async def test_bad_fault_bodies_are_rejected(pair):
    async with httpx.AsyncClient() as http:
        response = await http.post(pair.urls["mtp"] + "/sim/faults", json={"crash": 1})
    assert response.status_code == 400 and "unknown fault fields" in response.json()["message"]


async def test_bad_fault_values_and_wrongly_shaped_requests_are_400s(pair):
    """Fault fields of the wrong JSON type, and valid JSON of the wrong shape, are the caller's
    400, not a 500 or (for a fault) a server that then answers every stream with nothing."""
    url = pair.urls["mtp"]
    async with httpx.AsyncClient() as http:
        for fault in ({"crash_after_chunks": "3"}, {"hang_before_first_byte": 1},
                      {"slow_factor": True}):
            assert (await http.post(url + "/sim/faults", json=fault)).status_code == 400, fault
        assert (await http.post(url + "/sim/faults", json={"slow_factor": 2})).status_code == 200
        await http.delete(url + "/sim/faults")
        bad_shapes = [{"chat_template_kwargs": "yes"}, {"tools": [{"function": "x"}],
                      "tool_choice": "required"}, {"tool_choice": {"function": "x"}, "tools": [{}]},
                      {"messages": [{"role": "assistant", "content": "", "tool_calls": 5}]}]
        for extra in bad_shapes:
            response = await http.post(url + "/v1/chat/completions", json={**SHORT, **extra})
            assert response.status_code == 400, (extra, response.text)


async def test_a_client_rid_with_quotes_streams_valid_json(pair):
    async with httpx.AsyncClient() as http:
        response = await http.post(pair.urls["mtp"] + "/v1/chat/completions",
                                   json={**SHORT, "rid": 'a"b\\c'})
        events = [line[6:] for line in response.text.split("\n") if line.startswith("data: {")]
        assert events and all(json.loads(event)["id"] == 'a"b\\c' for event in events)


async def test_a_later_fault_is_not_ended_by_an_earlier_restore_timer():
    async with start_sim_pair(SimOptions(speed=50)) as pair:
        server = pair.servers["mtp"]
        await server.set_faults(Faults(refuse_connections=True, restore_after_s=0.2))
        first_timer = server.faults._restore_task
        assert first_timer is not None
        await server.clear_faults()
        await server.set_faults(Faults(refuse_connections=True))  # no timer: down until cleared
        with contextlib.suppress(asyncio.CancelledError):
            await first_timer  # its end: cancelled, or (the bug) re-opened after its 0.2 s
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(pair.urls["mtp"] + "/v1/loads")
        await server.clear_faults()


async def test_an_error_fault_ends_only_its_own_stream(pair):
    """The error fault aborts the faulted request by its exact id: a request whose id merely
    starts with it ("r" and "r1") runs to its end."""
    url = pair.urls["mtp"] + "/v1/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        other = asyncio.create_task(http.post(url, json={
            "model": "m", "prompt": "go on", "max_tokens": 300, "ignore_eos": True, "rid": "r1"}))
        await wait_until(lambda: _running_at_least(http, pair.urls["mtp"], 1))
        await pair.servers["mtp"].set_faults(Faults(error_after_chunks=2))
        faulted = await http.post(url, json={**LONG, "max_tokens": 50, "rid": "r"})
        assert b'"error"' in faulted.content
        await pair.servers["mtp"].clear_faults()
        finished = (await other).json()
        assert finished["usage"]["completion_tokens"] == 300, finished


async def _running_at_least(http: httpx.AsyncClient, url: str, n: int) -> bool:
    return await running(http, url) >= n
