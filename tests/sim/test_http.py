"""The simulated servers over real sockets, seen by the openai client and by raw HTTP."""

import json
import re

import httpx
import openai
import pytest

from gateway.sim.server import SimOptions, start_sim_pair

SERVED = "Qwen/Qwen3.5-122B-A10B"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "write a short plan"}]}


def openai_client(url: str, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def events_of(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    return raw[:-2].split(b"\n\n")


def data_of(event: bytes) -> dict:
    assert event.startswith(b"data: ")
    return json.loads(event[len(b"data: ") :])


@pytest.mark.parametrize("backend", ["mtp", "plain"])
async def test_openai_stream_and_non_stream_give_the_same_text(pair, backend):
    client = openai_client(pair.urls[backend])
    whole = await client.chat.completions.create(**CHAT, max_tokens=60)
    stream = await client.chat.completions.create(**CHAT, max_tokens=60, stream=True)
    pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(whole.choices[0].message.content.split()) == whole.usage.completion_tokens
    assert re.fullmatch(r"[a-z ]+", whole.choices[0].message.content)


async def test_completions_stream_matches_non_stream_and_counts_tokens(pair):
    client = openai_client(pair.urls["plain"])
    prompt = [23066] * 100
    whole = await client.completions.create(model="m", prompt=prompt, max_tokens=40,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=40, stream=True,
                                             extra_body={"ignore_eos": True})  # fmt: skip
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (100, 40)


async def test_usage_chunk_only_when_asked(pair):
    client = openai_client(pair.urls["mtp"])
    plain = [c async for c in await client.chat.completions.create(**CHAT, max_tokens=9, stream=True)]
    assert all(c.usage is None and c.choices for c in plain)
    asked = await client.chat.completions.create(
        **CHAT, max_tokens=9, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in asked]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


async def test_sse_framing_follows_sglang(pair):
    body = {**CHAT, "max_tokens": 30, "stream": True, "rid": "a" * 32}
    async with httpx.AsyncClient() as http:
        response = await http.post(pair.urls["mtp"] + "/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response.content)
    assert events[-1] == b"data: [DONE]"
    chunks = [data_of(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"a" * 32}
    assert chunks[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    finish = chunks[-1]["choices"][0]
    assert finish["delta"] == {"reasoning_content": None} and finish["finish_reason"] in ("stop", "length")
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[1:-1])
    # MTP: some chunks carry an accepted draft plus the bonus token (two words).
    assert max(len(text.split()) for text in content) == 2
    assert b'"created":' in events[0] and b", " not in events[0]  # compact JSON


async def test_ids_are_bare_hex_without_rid(pair):
    client = openai_client(pair.urls["plain"])
    response = await client.chat.completions.create(**CHAT, max_tokens=3)
    assert re.fullmatch(r"[0-9a-f]{32}", response.id)


async def test_reasoning_and_tool_calls_are_emitted(pair):
    client = openai_client(pair.urls["plain"])
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    whole = await client.chat.completions.create(**CHAT, max_tokens=20, extra_body=thinking)
    stream = await client.chat.completions.create(**CHAT, max_tokens=20, stream=True, extra_body=thinking)
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning and reasoning == whole.choices[0].message.reasoning_content
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(reasoning.split())

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    call = await client.chat.completions.create(**CHAT, max_tokens=300, tools=tools, tool_choice="required")
    assert call.choices[0].finish_reason == "tool_calls"
    function = call.choices[0].message.tool_calls[0].function
    assert function.name == "lookup" and "text" in json.loads(function.arguments)
    stream = await client.chat.completions.create(
        **CHAT, max_tokens=300, tools=tools, tool_choice="required", stream=True
    )
    args = "".join([
        c.choices[0].delta.tool_calls[0].function.arguments
        async for c in stream
        if c.choices and c.choices[0].delta.tool_calls
    ])  # fmt: skip
    assert args == function.arguments


async def test_bad_requests_get_flat_400s(pair):
    url = pair.urls["mtp"] + "/v1/chat/completions"
    async with httpx.AsyncClient() as http:
        not_json = await http.post(url, content=b"{oops", headers={"content-type": "application/json"})
        no_type = await http.post(url, content=json.dumps(CHAT).encode())
        invalid = await http.post(url, json={"model": "m", "messages": []})
    for response in (not_json, no_type, invalid):
        assert response.status_code == 400
        body = response.json()
        assert body["object"] == "error" and body["code"] == 400 and body["param"] is None
    assert "application/json" in no_type.json()["message"]


async def test_info_endpoints(pair):
    async with httpx.AsyncClient() as http:
        info = (await http.get(pair.urls["mtp"] + "/server_info")).json()
        plain_info = (await http.get(pair.urls["plain"] + "/server_info")).json()
        models = (await http.get(pair.urls["mtp"] + "/v1/models")).json()
        missing = await http.get(pair.urls["mtp"] + "/v1/models/other")
        loads = (await http.get(pair.urls["mtp"] + "/v1/loads")).json()
    assert info["speculative_algorithm"] == "EAGLE" and plain_info["speculative_algorithm"] is None
    assert info["max_running_requests"] == 48 and info["version"] == "0.5.23"
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 24
    assert models["data"][0]["id"] == "Qwen/Qwen3.5-122B-A10B"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert loads["loads"][0]["max_running_requests"] == 24


async def test_accept_length_is_reported_after_speculation(pair):
    await openai_client(pair.urls["mtp"]).chat.completions.create(**CHAT, max_tokens=50)
    async with httpx.AsyncClient() as http:
        info = (await http.get(pair.urls["mtp"] + "/server_info")).json()
        metrics = (await http.get(pair.urls["mtp"] + "/metrics")).text
    assert 1.0 <= info["internal_states"][0]["avg_spec_accept_length"] <= 2.0
    assert re.search(r'^sglang:spec_accept_length\{engine_type="unified",model_name=', metrics, re.M)
    assert re.search(r"^sglang:num_requests_total\{.*\} 1\.0$", metrics, re.M)
    assert re.search(r"^sglang:generation_tokens_total\{.*\} 50\.0$", metrics, re.M)
    assert re.search(r"^sglang:time_to_first_token_seconds_count\{.*\} 1\.0$", metrics, re.M)


async def test_health_takes_a_scaled_second_and_ready_is_instant(pair):
    async with httpx.AsyncClient() as http:
        health = await http.get(pair.urls["plain"] + "/health")
        ready = await http.get(pair.urls["plain"] + "/ready")
    assert health.status_code == 200 and ready.status_code == 200
    assert health.elapsed.total_seconds() >= 1.0 * 0.02


async def test_anthropic_messages_stream_and_non_stream(pair):
    body = {"model": "m", "max_tokens": 25, "messages": [{"role": "user", "content": "hello"}]}
    async with httpx.AsyncClient() as http:
        whole = (await http.post(pair.urls["mtp"] + "/v1/messages", json=body)).json()
        raw = (await http.post(pair.urls["mtp"] + "/v1/messages", json={**body, "stream": True})).content
    names = [e.split(b"\n")[0] for e in events_of(raw)]
    deltas = [json.loads(e.split(b"\n")[1][6:]) for e in events_of(raw)]
    assert names[:2] == [b"event: message_start", b"event: content_block_start"]
    assert names[-3:] == [b"event: content_block_stop", b"event: message_delta", b"event: message_stop"]
    text = "".join(d["delta"]["text"] for d in deltas if d["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert whole["usage"]["output_tokens"] == deltas[-2]["usage"]["output_tokens"]


async def test_responses_api_stream_and_non_stream(pair):
    client = openai_client(pair.urls["plain"])
    whole = await client.responses.create(model=SERVED, input="hello there", max_output_tokens=300)
    stream = await client.responses.create(model=SERVED, input="hello there", max_output_tokens=300,
                                           stream=True)  # fmt: skip
    events = [e async for e in stream]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].type == "response.completed"


@pytest.mark.timeout(30)
async def test_the_root_says_sglang_is_running_behind_the_api_key():
    """http_server.py:2124-2128: GET and HEAD / are 200 (Claude Code sends HEAD / first)."""
    async with start_sim_pair(SimOptions(speed=50, api_key="sekrit")) as guarded:
        url, auth = guarded.urls["mtp"], {"Authorization": "Bearer sekrit"}
        async with httpx.AsyncClient() as http:
            denied = await http.head(url + "/")
            probed = await http.head(url + "/", headers=auth)
            answered = await http.get(url + "/", headers=auth)
        assert denied.status_code == 401
        assert probed.status_code == 200 and probed.content == b""
        assert answered.status_code == 200 and answered.json() == "SGLang is running"


async def test_api_key_guards_all_but_health_ready_metrics():
    async with start_sim_pair(SimOptions(speed=50, api_key="sekrit")) as guarded:
        url = guarded.urls["mtp"]
        async with httpx.AsyncClient() as http:
            denied = await http.get(url + "/v1/models")
            wrong = await http.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
            opened = [await http.get(url + path) for path in ("/health", "/ready", "/metrics")]
        assert denied.status_code == wrong.status_code == 401
        assert denied.json() == {"error": "Unauthorized"}
        assert all(r.status_code == 200 for r in opened)
        with pytest.raises(openai.AuthenticationError):
            await openai_client(url, "nope").models.list()
        assert (await openai_client(url, "sekrit").models.list()).data
