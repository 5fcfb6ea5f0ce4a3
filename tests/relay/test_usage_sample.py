"""Every stream is a sample for the learned crossover, not only those whose client asked for
usage: the gateway asks SGLang for the usage chunk (stream_options.include_usage) and takes it
out of what the client gets, so the client sees what the server would have sent it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.relay.inbound import parse_inbound
from tests.conftest import live_gateway
from tests.test_gateway_live import settled

HEADERS = [(b"content-type", b"application/json")]
MTP_ALONE = {"adaptive_crossover": True, "crossover": 8}


def shape(raw: bytes) -> list[Any]:
    """The events of a stream with what differs from one answer to the next left out: ids,
    times, text, and how many chunks the text came in (MTP's accepted drafts vary). What is
    left is what a client's parser relies on."""
    shapes: list[Any] = []
    for event in raw.split(b"\n\n"):
        if not event.strip():
            continue
        assert event.startswith(b"data: "), event
        data = event[6:]
        if data == b"[DONE]":
            shapes.append("[DONE]")
            continue
        value = json.loads(data)
        this = (sorted(value), value["object"], value.get("usage"),
                [(sorted(c), c.get("finish_reason")) for c in value["choices"]])
        if not shapes or shapes[-1] != this:
            shapes.append(this)
    return shapes


def upstream_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    inbound = parse_inbound(path, HEADERS, json.dumps(body).encode(), session_headers=(),
                            allow_pin=False)
    return json.loads(b"".join(bytes(piece) for piece in inbound.body))  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_without_stream_options_asks_the_server_for_usage(path) -> None:
    body = {"model": "m", "stream": True, "max_tokens": 5,
            **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})}
    sent = upstream_body(path, body)
    assert sent["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in sent.items() if k not in ("stream_options", "rid")} == body


@pytest.mark.parametrize("options", [{"include_usage": False}, {}, None])
def test_the_clients_own_stream_options_are_left_as_they_are(options) -> None:
    body = {"model": "m", "stream": True, "stream_options": options,
            "messages": [{"role": "user", "content": "hi"}]}
    assert upstream_body("/v1/chat/completions", body)["stream_options"] == options


def test_a_whole_answer_or_another_api_is_not_asked() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert "stream_options" not in upstream_body("/v1/chat/completions", chat)
    messages = {**chat, "stream": True, "max_tokens": 5}
    assert "stream_options" not in upstream_body("/v1/messages", messages)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_whose_client_did_not_ask_for_usage_is_sampled_and_its_bytes_unchanged(
        sim, path) -> None:
    body = {"model": "m", "stream": True, "max_tokens": 24, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})}
    async with live_gateway(sim, routing=MTP_ALONE) as gateway, \
            httpx.AsyncClient(timeout=10) as client:
        estimator = gateway.pool.pairs["default"].estimator
        direct = await client.post(sim.urls["mtp"] + path, json=body)
        relayed = await client.post(gateway.url + path, json=body)
        await settled(gateway, 0)
        assert relayed.status_code == direct.status_code == 200
        assert shape(relayed.content) == shape(direct.content)
        assert b'"usage":{' not in relayed.content
        assert estimator.samples == 1  # before: 0, the stream told the learner nothing


@pytest.mark.timeout(30)
async def test_a_client_that_asked_for_usage_still_gets_it(sim) -> None:
    body = {"model": "m", "stream": True, "max_tokens": 8, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hi"}]}
    async with live_gateway(sim, routing=MTP_ALONE) as gateway, \
            httpx.AsyncClient(timeout=10) as client:
        direct = await client.post(sim.urls["mtp"] + "/v1/chat/completions", json=body)
        relayed = await client.post(gateway.url + "/v1/chat/completions", json=body)
        assert shape(relayed.content) == shape(direct.content)
        assert shape(relayed.content)[-2][2]["completion_tokens"] == 8


CONTENT = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
           b'"delta":{"reasoning_content":null,"content":"hi"},"logprobs":null,"finish_reason":null,'
           b'"matched_stop":null}]}\n\n')
TOOL_ARGS = b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"function":{"arguments":"{}}"}}]}}]}\n\n'
USAGE = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
         b'"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}\n\n')
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("pieces", [
    [CONTENT, CONTENT, USAGE, DONE],  # each event a piece of its own, as SGLang sends them
    [CONTENT, CONTENT + USAGE + DONE],  # read together
    [CONTENT, CONTENT + USAGE, DONE],
    [CONTENT + CONTENT[:40], CONTENT[40:] + USAGE[:9], USAGE[9:] + DONE],  # cut anywhere
    [TOOL_ARGS, CONTENT, USAGE, DONE],
])
def test_the_unasked_usage_chunk_is_kept_for_the_gateway_and_never_written(pieces) -> None:
    from types import SimpleNamespace

    from gateway.apis.sse import EventFramer
    from gateway.relay.pump import _relay
    from gateway.upstream.engine.sglang import USAGE_CHUNK

    written: list[bytes] = []
    exchange = SimpleNamespace(framer=EventFramer(), recent=[])
    writer = SimpleNamespace(write=lambda data: written.append(data) and False)
    relay, _ = _relay(exchange, None, writer, None, USAGE_CHUNK)  # type: ignore[arg-type]
    for piece in pieces:
        relay(piece)
    assert b"".join(written) == b"".join(pieces).replace(USAGE, b"")
    assert b"".join(exchange.recent) == b"".join(pieces)  # the usage is the gateway's to read
