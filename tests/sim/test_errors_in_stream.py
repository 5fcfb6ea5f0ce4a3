"""SGLang's errors inside an HTTP 200 (a full queue, a scheduler abort with a status), on every
API, as the official SDKs see them; and the non-stream answers to the same aborts."""

import json
import re

import anthropic
import httpx
import openai
import pytest

from gateway.sim.faults import Faults

SERVED = "Qwen/Qwen3.5-122B-A10B"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
MESSAGES = {"model": "claude-sonnet-4-5", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}


def events_of(raw: str) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of each SSE event."""
    out = []
    for block in raw.split("\n\n")[:-1]:
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


async def test_an_abort_before_the_first_token_is_an_error_inside_a_200_on_every_api(pair):
    await pair.servers["mtp"].set_faults(Faults(abort_status=503))
    url = pair.urls["mtp"]
    async with httpx.AsyncClient() as http:
        chat = await http.post(url + "/v1/chat/completions", json={**CHAT, "stream": True, "rid": "c1"})
        usage = {"include_usage": True}
        completion = await http.post(url + "/v1/completions", json={
            "model": "m", "prompt": "go", "stream": True, "rid": "p1", "stream_options": usage})
        messages = await http.post(url + "/v1/messages", json={**MESSAGES, "stream": True})
        responses = await http.post(url + "/v1/responses",
                                    json={"model": SERVED, "input": "hi", "stream": True})  # fmt: skip
    for response in (chat, completion, messages, responses):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
    error = ('data: {"error": {"object": "error", "message": "Simulated abort (sim fault).", '
             '"type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}}\n\n')  # fmt: skip
    assert chat.text == error + "data: [DONE]\n\n"
    assert re.fullmatch(re.escape(error) + r'data: {"id":"p1","object":"text_completion","created":\d+,'
                        r'"model":"m","choices":\[\],"usage":{"prompt_tokens":0,"total_tokens":0,'
                        r'"completion_tokens":0,"reasoning_tokens":0}}\n\ndata: \[DONE\]\n\n',
                        completion.text)  # fmt: skip
    # anthropic/serving.py _flush_on_error: message_start, error, message_stop; never [DONE].
    events = events_of(messages.text)
    assert [name for name, _ in events] == ["message_start", "error", "message_stop"]
    assert events[1][1] == {"type": "error", "error": {"type": "overloaded_error",
                                                       "message": "Simulated abort (sim fault)."}}
    assert events[0][1]["message"]["usage"] == {"input_tokens": 0, "output_tokens": 0}
    # serving_responses.py: created, in_progress, then response.failed with the message.
    events = events_of(responses.text)
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "response.failed"]
    failure = {"code": "server_error", "message": "Simulated abort (sim fault)."}
    assert events[2][1]["response"]["error"] == failure
    assert [data["sequence_number"] for _, data in events] == [0, 1, 2]


async def test_the_sdks_raise_on_an_in_200_error(pair):
    await pair.servers["plain"].set_faults(Faults(abort_status=503))
    base = pair.urls["plain"]
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="Simulated abort"):
        async for _ in await client.chat.completions.create(**CHAT, stream=True):
            pass
    claude = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="Simulated abort"):
        async with claude.messages.stream(**MESSAGES) as stream:
            async for _ in stream:
                pass


async def test_non_stream_aborts_get_each_apis_error(pair):
    await pair.servers["mtp"].set_faults(Faults(abort_status=503))
    url = pair.urls["mtp"]
    async with httpx.AsyncClient() as http:
        chat = await http.post(url + "/v1/chat/completions", json=CHAT)
        messages = await http.post(url + "/v1/messages", json=MESSAGES)
        responses = await http.post(url + "/v1/responses", json={"model": SERVED, "input": "hi"})
    flat = {"object": "error", "message": "Simulated abort (sim fault).", "type": "503", "param": None,
            "code": 503}  # fmt: skip
    assert (chat.status_code, chat.json()) == (503, flat)
    # 5xx messages are scrubbed on /v1/messages (anthropic/serving.py _scrub_error_message).
    assert (messages.status_code, messages.json()) == (503, {
        "type": "error", "error": {"type": "overloaded_error", "message": "Internal server error"}})
    # /v1/responses catches the HTTPException as any exception: a 400 saying "503: ...".
    assert (responses.status_code, responses.json()) == (400, {"error": {
        "message": "503: Simulated abort (sim fault).", "type": "invalid_request_error", "param": None,
        "code": 400}})  # fmt: skip


async def test_abort_count_limits_the_fault_and_a_mid_stream_abort_keeps_the_usage(pair):
    server, url = pair.servers["plain"], pair.urls["plain"]
    await server.set_faults(Faults(abort_status=503, abort_count=1))
    async with httpx.AsyncClient() as http:
        first = await http.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
        second = await http.post(url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert first.text.startswith('data: {"error"') and second.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in second.text
        await server.set_faults(Faults(error_after_chunks=3))
        usage = {"include_usage": True}
        broken = await http.post(url + "/v1/chat/completions",
                                 json={**CHAT, "stream": True, "stream_options": usage})  # fmt: skip
    events = events_of(broken.text)
    assert events[3][1]["error"]["type"] == "INTERNAL_SERVER_ERROR" and events[3][1]["error"]["code"] == 500
    assert events[4][1]["usage"]["prompt_tokens"] > 0 and events[4][1]["usage"]["completion_tokens"] >= 2
    assert events[5] == (None, "[DONE]")
