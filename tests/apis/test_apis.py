"""Every API served as SGLang 0.5.23 serves it, through the gateway (issue 10), against scripted
backends that show what the gateway sent and let each test choose the bytes back.

Model names pass through; errors come in the shape of the API they came in on, before and
inside a stream; a stream whose first event is an error is retried on the other server;
aborts name every rid SGLang uses; stored responses stay on their server; /generate,
/server_info and /v1/models/{id} answer; one access-log line per request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.upstream.client import Upstream
from tests.conftest import LiveGateway, circuit_open, live_gateway
from tests.live import serve_app, wait_until
from tests.scripted import (
    MODEL,
    QUEUE_FULL,
    ScriptedBackend,
    anthropic_events,
    anthropic_refusal,
    chat_events,
    chat_refusal,
    responses_events,
    responses_refusal,
)
from tests.test_gateway_live import settled

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
MESSAGES = {"model": "claude-sonnet-4-5-20250929", "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": MODEL, "input": "hi"}


@contextlib.asynccontextmanager
async def scripted_pair(**sections: dict[str, Any]
                        ) -> AsyncIterator[tuple[LiveGateway, dict[str, ScriptedBackend]]]:
    backends = {"mtp": ScriptedBackend("mtp"), "plain": ScriptedBackend("plain")}
    keys = sections.pop("backend_keys", {})
    async with serve_app(backends["mtp"].app) as mtp_url, \
            serve_app(backends["plain"].app) as plain_url:
        urls = {"mtp": {"url": mtp_url, **keys.get("mtp", {})},
                "plain": {"url": plain_url, **keys.get("plain", {})}}
        async with live_gateway(None, backends=urls, **sections) as gateway:
            yield gateway, backends


async def post_raw(gateway: LiveGateway, path: str, body: dict[str, Any],
                   headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(gateway.url + path, json=body, headers=headers)


def use_only(gateway: LiveGateway, backend: str) -> None:
    runtime = gateway.runtime
    runtime.apply_routing(runtime.settings.model_copy(update={
        "routing": runtime.settings.routing.model_copy(update={"policy": f"{backend}-only"})}))


def anthropic_client(gateway: LiveGateway, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway.url, api_key=key, max_retries=0)


def openai_client(gateway: LiveGateway, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


# --- model names: passed through as SGLang takes them ------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("model", ["claude-sonnet-4-5-20250929", "claude-3-5-haiku-20241022",
                                   f"{MODEL}:my-lora", "qwen", "Qwen/Qwen3.5-122B-A10B-FP8"])
async def test_any_model_name_reaches_the_backend_unchanged(model: str) -> None:
    """SGLang does not check the name on chat, completions or messages (serving_base.py:40-60
    only splits base:adapter; only /v1/responses checks, serving_responses.py:297-314). The
    gateway answered 404 model_not_found for any name missing from /v1/models."""
    async with scripted_pair() as (gateway, backends):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions",
                                                            {"prompt": "x", "max_tokens": 4}),
                           ("/v1/messages", MESSAGES)):
            response = await post_raw(gateway, path, {**body, "model": model})
            assert response.status_code == 200, (path, response.text)
            assert backends["mtp"].requests_to(path)[-1].json["model"] == model


@pytest.mark.timeout(30)
async def test_an_alias_rewrites_only_the_model_and_anything_else_is_relayed_byte_for_byte() -> None:
    """models.aliases (issue 29): the backend gets the client's bytes with only the `model`
    value changed; a request no alias applies to arrives exactly as the client sent it. The
    aliases are not listed on /v1/models unless models.list_aliases asks."""
    aliases = {"aliases": {"claude-*": MODEL, "gpt-5-codex": MODEL}}
    body = (b'{"model" : "%s",  "max_tokens": 64, "messages": [{"role": "user", "content":'
            b' "caf\\u00e9 \\"model\\": \\"claude-x\\""}], "metadata": {"model": "claude-y"}}')
    async with scripted_pair(models=aliases) as (gateway, backends), \
            httpx.AsyncClient(timeout=10) as client:
        for model, upstream in ((b"claude-sonnet-4-5", MODEL.encode()), (b"gpt-5", b"gpt-5"),
                                (b"Claude-x", b"Claude-x")):
            answered = await client.post(gateway.url + "/v1/messages", content=body % model,
                                         headers={"content-type": "application/json"})
            assert answered.status_code == 200, answered.text
            assert answered.json()["model"] == upstream.decode()
            assert backends["mtp"].requests_to("/v1/messages")[-1].body == body % upstream
        listed = await client.get(gateway.url + "/v1/models")  # list_aliases off: not listed
        assert [card["id"] for card in listed.json()["data"]] == [MODEL]
        assert (await client.get(gateway.url + "/v1/models/gpt-5-codex")).status_code == 404


@pytest.mark.timeout(30)
async def test_models_come_from_the_backends_live_and_behind_the_client_key() -> None:
    """/v1/models and /v1/models/{id} as the backend answers them now (a server restarted with
    another --served-model-name shows at once), and, as SGLang with --api-key, 401 without a
    client key when auth.api_keys is set (issue 14)."""
    async with scripted_pair(auth={"api_keys": ["client-key"]}) as (gateway, backends), \
            httpx.AsyncClient() as client:
        for path in ("/v1/models", f"/v1/models/{MODEL}"):
            refused = await client.get(gateway.url + path)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["type"] == "authentication_error"
        auth = {"authorization": "Bearer client-key"}
        listed = await client.get(gateway.url + "/v1/models", headers=auth)
        assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == [MODEL]
        backends["mtp"].models = ["renamed"]
        listed = await client.get(gateway.url + "/v1/models", headers=auth)
        assert [m["id"] for m in listed.json()["data"]] == ["renamed"]
        sdk = openai_client(gateway, key="client-key")
        assert (await sdk.models.retrieve("renamed")).id == "renamed"
        with pytest.raises(openai.NotFoundError):
            await sdk.models.retrieve("gpt-5")
        await sdk.close()


@pytest.mark.timeout(30)
async def test_the_root_answers_as_sglang_behind_the_client_key() -> None:
    """GET and HEAD / are SGLang's "SGLang is running" (Claude Code sends HEAD / before its
    first request), 401 without the client key as SGLang with --api-key."""
    async with scripted_pair(auth={"api_keys": ["client-key"]}) as (gateway, _), \
            httpx.AsyncClient() as client:
        refused = await client.head(gateway.url + "/")
        assert refused.status_code == 401
        auth = {"authorization": "Bearer client-key"}
        probed = await client.head(gateway.url + "/", headers=auth)
        assert probed.status_code == 200 and probed.content == b""
        answered = await client.get(gateway.url + "/", headers=auth)
        assert answered.status_code == 200 and answered.json() == "SGLang is running"


# --- errors in the shape of the API, before the stream ---------------------------------------

@pytest.mark.timeout(30)
async def test_gateway_errors_on_messages_use_the_anthropic_envelope() -> None:
    async with scripted_pair(auth={"api_keys": ["client-key"]}) as (gateway, _):
        refused = await post_raw(gateway, "/v1/messages", MESSAGES)
        assert refused.status_code == 401
        assert refused.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "invalid or missing API key"}}
        async with httpx.AsyncClient() as client:
            bad = await client.post(gateway.url + "/v1/messages", content=b"{nope",
                                    headers={"x-api-key": "client-key",
                                             "content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["type"] == "error"
        assert bad.json()["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.AuthenticationError):
            await anthropic_client(gateway, key="wrong").messages.create(**MESSAGES)
        chat = await post_raw(gateway, "/v1/chat/completions", CHAT)  # OpenAI's shape there
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"


# --- errors inside a stream the gateway must break off ----------------------------------------

@pytest.mark.timeout(30)
async def test_a_chat_stream_broken_mid_event_sends_no_stray_byte() -> None:
    """The old framer sent one byte of an unfinished event early: `...d\\n\\ndata: {"error"`."""
    async with scripted_pair() as (gateway, backends):
        events = chat_events()
        backends["mtp"].script, backends["mtp"].die = [*events[:3], b"d"], True
        response = await post_raw(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
        head, _, rest = response.content.partition(b"".join(events[:3]))
        assert head == b"" and rest.startswith(b'data: {"error": '), response.content
        assert rest.endswith(b"}\n\ndata: [DONE]\n\n") and rest.count(b"\n\n") == 2


@pytest.mark.timeout(30)
async def test_crlf_framed_streams_pass_through_whole() -> None:
    """Events ending in CRLF never matched the old b"\\n\\n" check: held to the end and then
    reported as a broken stream."""
    async with scripted_pair() as (gateway, backends):
        events = [event.replace(b"\n", b"\r\n") for event in chat_events()]
        backends["mtp"].script = events
        response = await post_raw(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
        assert response.content == b"".join(events)


@pytest.mark.timeout(30)
async def test_a_messages_stream_broken_mid_way_ends_with_error_then_message_stop() -> None:
    """As SGLang ends it (anthropic/serving.py:978-993): the open block closed, `event: error`,
    `event: message_stop`, never [DONE]. The anthropic SDK raises on `event: error` only: it
    ignored the old unnamed `data: {"error"}` and returned a truncated message."""
    async with scripted_pair() as (gateway, backends):
        events = anthropic_events("one two three four")
        backends["mtp"].script, backends["mtp"].die = events[:4], True
        response = await post_raw(gateway, "/v1/messages", {**MESSAGES, "stream": True})
        assert response.status_code == 200
        sent = b"".join(events[:4])
        assert response.content.startswith(sent)
        ending = response.content[len(sent):]
        assert ending.startswith(b'event: content_block_stop\ndata: {"type": "content_block_stop", '
                                 b'"index": 0}\n\nevent: error\ndata: {"type": "error", "error": '
                                 b'{"type": "api_error", "message": '), ending
        assert ending.endswith(b'\n\nevent: message_stop\ndata: {"type": "message_stop"}\n\n')
        assert b"[DONE]" not in response.content
        client = anthropic_client(gateway)
        with pytest.raises(anthropic.APIError, match="middle of the response|api_error"):
            async with client.messages.stream(**MESSAGES) as stream:
                async for _ in stream:
                    pass
        await settled(gateway, 0)


@pytest.mark.timeout(30)
async def test_a_responses_stream_broken_mid_way_ends_with_response_failed() -> None:
    """/v1/responses ends a failure with `response.failed` for the same response id and the
    next sequence number (serving_responses.py:2988-3004), never [DONE]; the SDK's stream
    helper raises instead of handing back a truncated response."""
    async with scripted_pair() as (gateway, backends):
        events = responses_events("resp_fixed", "one two three four")
        backends["mtp"].script, backends["mtp"].die = events[:6], True
        response = await post_raw(gateway, "/v1/responses",
                                  {**RESPONSES, "stream": True, "request_id": "resp_fixed"})
        sent = b"".join(events[:6])
        assert response.content.startswith(sent) and b"[DONE]" not in response.content
        name, data = response.content[len(sent):].split(b"\n", 1)
        assert name == b"event: response.failed" and data.endswith(b"}\n\n")
        failed = json.loads(data.removeprefix(b"data: "))
        assert failed["sequence_number"] == 6 and failed["response"]["id"] == "resp_fixed"
        assert failed["response"]["status"] == "failed" and failed["response"]["error"]["message"]
        client = openai_client(gateway)
        with pytest.raises(RuntimeError, match="response.completed"):
            async with client.responses.stream(**RESPONSES, extra_body={
                    "request_id": "resp_fixed"}) as stream:
                await stream.get_final_response()
        await client.close()


@pytest.mark.timeout(30)
async def test_both_sdks_raise_when_the_backend_dies_after_the_first_byte() -> None:
    async with scripted_pair() as (gateway, backends):
        mtp, plain = backends["mtp"], backends["plain"]
        for backend in (mtp, plain):
            backend.die = True
        client = openai_client(gateway)
        mtp.script = plain.script = chat_events("a b c d e f")[:3]
        with pytest.raises(openai.APIError):
            async for _ in await client.chat.completions.create(**CHAT, stream=True):
                pass
        with pytest.raises(openai.APIError):
            async for _ in await client.completions.create(model=MODEL, prompt="x", stream=True):
                pass
        mtp.script = plain.script = anthropic_events("a b c d e f")[:3]
        with pytest.raises(anthropic.APIError):
            async for _ in await anthropic_client(gateway).messages.create(**MESSAGES, stream=True):
                pass
        await client.close()


# --- a stream whose first event is an error: SGLang's refusal in a 200 ------------------------

REFUSALS = {
    "/v1/chat/completions": ({**CHAT, "stream": True}, chat_refusal()),
    "/v1/messages": ({**MESSAGES, "stream": True}, anthropic_refusal()),
    "/v1/responses": ({**RESPONSES, "stream": True, "request_id": "resp_r"},
                      responses_refusal("resp_r")),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", list(REFUSALS))
async def test_a_full_queue_in_a_200_is_served_by_the_other_server(path: str) -> None:
    """SGLang answers a full queue on a stream as HTTP 200 whose first event is the error
    (serving_chat.py:2565-2576). The gateway took that for a success and sent it on."""
    body, refusal = REFUSALS[path]
    async with scripted_pair() as (gateway, backends), httpx.AsyncClient() as client:
        backends["mtp"].script = refusal
        response = await post_raw(gateway, path, body)
        assert response.status_code == 200
        assert (response.headers["x-gateway-backend"], response.headers["x-gateway-route-reason"]
                ) == ("plain", "failover")
        assert QUEUE_FULL.encode() not in response.content
        assert b"Hello" in response.content or b"there" in response.content
        assert gateway.pool.backends["mtp"].circuit.failures == 1  # the circuit counts it
        metrics = (await client.get(gateway.url + "/metrics")).text
        assert 'gateway_upstream_errors_total{backend="mtp",kind="stream_error"} 1.0' in metrics
        await settled(gateway, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", list(REFUSALS))
async def test_both_queues_full_the_client_gets_sglangs_own_refusal(path: str) -> None:
    """Nothing left to retry: the client gets the stream as SGLang sent it, its error in the
    API's shape, and its SDK raises. A refusal both servers give the same request opens
    neither circuit (as for a 5xx both give: the load, not a broken server)."""
    body, refusal = REFUSALS[path]
    async with scripted_pair() as (gateway, backends), httpx.AsyncClient() as client:
        backends["mtp"].script = backends["plain"].script = refusal
        response = await post_raw(gateway, path, body)
        assert response.status_code == 200 and response.content == b"".join(refusal)
        metrics = (await client.get(gateway.url + "/metrics")).text
        for name in ("mtp", "plain"):
            assert f'gateway_upstream_errors_total{{backend="{name}",kind="stream_error"}} 1.0' in metrics
            assert not circuit_open(gateway.pool.backends[name])
        if path == "/v1/chat/completions":
            with pytest.raises(openai.APIError, match="queue is full"):
                async for _ in await openai_client(gateway).chat.completions.create(
                        **CHAT, stream=True):
                    pass
        if path == "/v1/messages":
            with pytest.raises(anthropic.APIError, match="queue is full"):
                async for _ in await anthropic_client(gateway).messages.create(
                        **MESSAGES, stream=True):
                    pass
        await settled(gateway, 0)


# --- the circuit judges whole streams ----------------------------------------------------------

@pytest.mark.timeout(30)
async def test_a_server_whose_streams_all_die_after_the_first_token_is_taken_out() -> None:
    """The first byte used to count as a success and reset the count: 10 of 10 broken streams
    left the circuit closed. Now a stream succeeds when it ends whole."""
    async with scripted_pair(monitor={"circuit_failures": 3, "circuit_open_s": 60}) as (
            gateway, backends):
        backends["mtp"].script, backends["mtp"].die = chat_events()[:2], True
        for _ in range(3):
            response = await post_raw(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
            assert response.headers["x-gateway-backend"] == "mtp"
            assert b'data: {"error"' in response.content
        assert circuit_open(gateway.pool.backends["mtp"])
        served = await post_raw(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
        assert served.headers["x-gateway-backend"] == "plain"
        assert served.content == b"".join(chat_events())


@pytest.mark.timeout(30)
async def test_a_stream_ending_with_sglangs_own_error_event_counts_against_its_server() -> None:
    async with scripted_pair(monitor={"circuit_failures": 2, "circuit_open_s": 60}) as (
            gateway, backends):
        backends["mtp"].script = [*chat_events()[:3], *chat_refusal(500, "boom")]
        for _ in range(2):
            response = await post_raw(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
            assert response.content.endswith(b"data: [DONE]\n\n")
        assert circuit_open(gateway.pool.backends["mtp"])


@pytest.mark.timeout(10)
async def test_a_failing_client_writer_is_not_the_backends_failure() -> None:
    """An exception in the gateway's own sink (its client writer) fails the response with a
    RelayError: the relay counts only UpstreamErrors against a backend's circuit."""
    backend = ScriptedBackend("mtp")
    async with serve_app(backend.app) as url:
        upstream = Upstream(connect_timeout_s=2)
        await upstream.start()
        try:
            body = json.dumps({**CHAT, "stream": True}).encode()
            response = await upstream.send("POST", url + "/v1/chat/completions",
                                           [(b"content-type", b"application/json")], body)

            def sink(chunk: bytes) -> None:
                raise OSError("client socket gone wrong")

            response.pump(sink)
            with pytest.raises(Exception) as raised:
                await response.pumped()
            from gateway.apis.errors import RelayError, UpstreamError
            assert isinstance(raised.value, RelayError)
            assert not isinstance(raised.value, UpstreamError)
        finally:
            await upstream.close()


# --- aborts on every path SGLang can abort -----------------------------------------------------

async def open_then_leave(gateway: LiveGateway, path: str, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as client, \
            client.stream("POST", gateway.url + path, json=body) as response:
        assert response.status_code == 200
        await response.aiter_raw().__anext__()  # the first events arrived: now leave


@pytest.mark.timeout(30)
async def test_a_disconnect_aborts_messages_and_responses_by_the_rid_sglang_uses() -> None:
    """/v1/messages: the rid goes in x-override-rid (read by SGLang launched with
    SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1); /v1/responses: its request_id is the rid.
    Neither got an abort before: SGLang still frees a stream whose connection closes
    (tokenizer_manager.py:958), but a non-streamed request only within 4 s (:1960-1970)."""
    async with scripted_pair() as (gateway, backends):
        mtp = backends["mtp"]
        mtp.hold = True
        await open_then_leave(gateway, "/v1/messages", {**MESSAGES, "stream": True})
        rid = mtp.requests_to("/v1/messages")[-1].headers["x-override-rid"]
        await wait_until(lambda: mtp.aborted == [rid])
        await open_then_leave(gateway, "/v1/responses", {**RESPONSES, "stream": True})
        request_id = mtp.requests_to("/v1/responses")[-1].json["request_id"]
        await wait_until(lambda: mtp.aborted == [rid, request_id])
        await settled(gateway, 0)


@pytest.mark.timeout(30)
async def test_aborts_carry_the_admin_key_and_every_batch_rid(caplog) -> None:
    """SGLang with --admin-api-key refuses the API key on /abort_request; a batch of prompts
    runs as rid_0, rid_1, ... and the abort must name each (io_struct.py:764)."""
    keys = {"mtp": {"api_key": "api", "admin_api_key": "admin"}, "plain": {"api_key": "api"}}
    async with scripted_pair(backend_keys=keys) as (gateway, backends):
        mtp, plain = backends["mtp"], backends["plain"]
        mtp.admin_key, plain.admin_key = "admin", "admin"
        mtp.hold = plain.hold = True
        await open_then_leave(gateway, "/v1/completions",
                              {"model": MODEL, "prompt": ["a", "b"], "stream": True})
        rid = mtp.requests_to("/v1/completions")[-1].json["rid"]
        await wait_until(lambda: sorted(mtp.aborted) == [f"{rid}_0", f"{rid}_1"])
        assert {r.headers["authorization"] for r in mtp.requests_to("/abort_request")} == {
            "Bearer admin"}
        use_only(gateway, "plain")  # no admin key configured for it
        with caplog.at_level(logging.WARNING, logger="mtp_gateway.relay"):
            await open_then_leave(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
            await wait_until(lambda: len(plain.aborted) == 1)
            await wait_until(lambda: "admin_api_key" in caplog.text)
        await settled(gateway, 0)


# --- state that lives on one server --------------------------------------------------------

@pytest.mark.timeout(30)
async def test_a_stored_response_is_followed_to_its_server_whatever_the_mode() -> None:
    async with scripted_pair(routing={"policy": "mtp-only"}) as (gateway, backends), \
            httpx.AsyncClient() as client:
        first = await post_raw(gateway, "/v1/responses", RESPONSES)
        assert first.headers["x-gateway-backend"] == "mtp"
        response_id = first.json()["id"]
        assert response_id in backends["mtp"].stored
        use_only(gateway, "plain")
        follow_up = await post_raw(gateway, "/v1/responses",
                                   {**RESPONSES, "previous_response_id": response_id})
        assert follow_up.headers["x-gateway-backend"] == "mtp"
        other = await post_raw(gateway, "/v1/responses", RESPONSES)
        assert other.headers["x-gateway-backend"] == "plain"
        fetched = await client.get(f"{gateway.url}/v1/responses/{response_id}")
        assert fetched.status_code == 200 and fetched.json()["id"] == response_id
        assert fetched.headers["x-gateway-backend"] == "mtp"
        cancelled = await client.post(f"{gateway.url}/v1/responses/{response_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.headers["x-gateway-backend"] == "mtp"
        sdk = openai_client(gateway)
        assert (await sdk.responses.retrieve(other.json()["id"])).id == other.json()["id"]
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve("resp_nowhere")
        await sdk.close()


# --- SGLang's native endpoints ---------------------------------------------------------------

@pytest.mark.timeout(30)
async def test_generate_is_relayed_and_routed_like_the_rest() -> None:
    async with scripted_pair() as (gateway, backends):
        whole = await post_raw(gateway, "/generate", {"text": "hi", "sampling_params": {}})
        assert whole.status_code == 200 and whole.json()["text"] == "Hello there"
        assert whole.headers["x-gateway-route-reason"] == "below_crossover"
        streamed = await post_raw(gateway, "/generate", {"text": "hi", "stream": True})
        assert streamed.content.endswith(b"data: [DONE]\n\n") and b"Hello there" in streamed.content
        async with httpx.AsyncClient() as client:  # SGLang serves /generate on PUT too
            put = await client.put(gateway.url + "/generate", json={"text": "hi"})
            assert put.status_code == 200 and put.json()["text"] == "Hello there"
            wrong = await client.patch(gateway.url + "/generate", json={"text": "hi"})
            assert wrong.status_code == 405 and wrong.headers["allow"] == "POST, PUT"
        sent = backends["mtp"].requests_to("/generate")
        assert len(sent) == 3 and all(r.json["rid"] for r in sent)  # abortable


@pytest.mark.timeout(30)
async def test_server_info_is_the_mtp_servers_so_sglangs_bench_reads_its_accept_length() -> None:
    async with scripted_pair(auth={"api_keys": ["k"]}) as (gateway, _), \
            httpx.AsyncClient() as client:
        for path in ("/server_info", "/get_server_info"):
            assert (await client.get(gateway.url + path)).status_code == 401
            info = await client.get(gateway.url + path, headers={"authorization": "Bearer k"})
            assert info.status_code == 200 and info.json()["served_by"] == "mtp"
            assert info.json()["internal_states"][0]["avg_spec_accept_length"] == 1.8


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["true", 1, "yes"])
async def test_stream_given_as_sglangs_pydantic_accepts_it_streams(value: Any) -> None:
    async with scripted_pair() as (gateway, backends):
        response = await post_raw(gateway, "/v1/chat/completions", {**CHAT, "stream": value})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.content == b"".join(chat_events())


# --- one access-log line per request --------------------------------------------------------

@pytest.mark.timeout(30)
async def test_one_access_log_line_per_request_and_none_when_off(caplog) -> None:
    async with scripted_pair() as (gateway, _):
        with caplog.at_level(logging.INFO, logger="mtp_gateway.access"):
            await post_raw(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
            await post_raw(gateway, "/v1/chat/completions", {**CHAT, "messages": "x"})
            await settled(gateway, 0)
        lines = [r.getMessage() for r in caplog.records if r.name == "mtp_gateway.access"]
        assert len(lines) == 2, lines
        fields = dict(pair.split("=", 1) for pair in lines[0].split(" "))
        assert (fields["path"], fields["backend"], fields["reason"], fields["status"],
                fields["ended"]) == ("/v1/chat/completions", "mtp", "below_crossover", "200",
                                     "complete")
        assert float(fields["ttft_ms"]) > 0 and float(fields["duration_ms"]) >= float(fields["ttft_ms"])
        assert (fields["prompt_tokens"], fields["completion_tokens"]) == ("7", "2")
        assert "status=400" in lines[1] and "ended=rejected" in lines[1]
    caplog.clear()
    async with scripted_pair(log={"access": False}) as (gateway, _):
        with caplog.at_level(logging.INFO, logger="mtp_gateway.access"):
            await post_raw(gateway, "/v1/chat/completions", CHAT)
            await settled(gateway, 0)
        assert not [r for r in caplog.records if r.name == "mtp_gateway.access"]


@pytest.mark.timeout(30)
async def test_anthropic_sdk_through_the_gateway_stream_and_not() -> None:
    async with scripted_pair() as (gateway, _):
        client = anthropic_client(gateway)
        message = await client.messages.create(**MESSAGES)
        assert message.content[0].text == "Hello there"
        async with client.messages.stream(**MESSAGES) as stream:
            text = "".join([chunk async for chunk in stream.text_stream])
        assert text.strip() == "Hello there"
        await asyncio.gather(*(client.messages.create(**MESSAGES) for _ in range(3)))
        await settled(gateway, 0)


@pytest.mark.timeout(30)
async def test_a_model_writing_error_event_text_is_not_a_failure() -> None:
    """Only a line that starts an SSE field counts: text the model writes is JSON-escaped."""
    async with scripted_pair() as (gateway, backends):
        backends["mtp"].script = anthropic_events('event: error\n data: {"error": 1}')
        response = await post_raw(gateway, "/v1/messages", {**MESSAGES, "stream": True})
        assert response.content == b"".join(backends["mtp"].script)
        backends["mtp"].script = chat_events('data: {"error": "no"}')
        response = await post_raw(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
        assert response.content == b"".join(backends["mtp"].script)
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(gateway.url + "/metrics")).text
        errors = [line for line in metrics.splitlines() if line.startswith("gateway_upstream_errors_total")]
        assert errors == [] and gateway.pool.backends["mtp"].circuit.failures == 0, errors
