"""The real `anthropic` and `openai` SDKs through the gateway, in front of the simulated pair
(issue 10's Done-when): every API served, a crash after the first byte raises in both SDKs, a
full queue in SGLang's in-200 form is served by the other server, a disconnect frees the
backend's slot, and tool calls keep their own ids."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.sim.faults import Faults
from gateway.sim.server import SimOptions, start_sim_pair
from tests.conftest import LiveGateway, live_gateway
from tests.live import wait_until
from tests.test_gateway_live import settled

SERVED = "Qwen/Qwen3.5-122B-A10B"
CLAUDE = "claude-sonnet-4-5-20250929"
USER = [{"role": "user", "content": "list the files here"}]
ANTHROPIC_TOOLS = [{"name": "ls", "description": "list files",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


def claude(gateway: LiveGateway) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway.url, api_key="x", max_retries=0)


def oai(gateway: LiveGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.timeout(60)
async def test_anthropic_sdk_messages_tools_thinking_and_count_tokens(sim) -> None:
    async with live_gateway(sim) as gateway:
        client = claude(gateway)
        body: dict[str, Any] = {"model": CLAUDE, "max_tokens": 400, "messages": USER,
                                "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"},
                                "thinking": {"type": "enabled", "budget_tokens": 1024}}
        whole = await client.messages.create(**body)
        kinds = [block.type for block in whole.content]
        assert "thinking" in kinds and "tool_use" in kinds, kinds
        assert whole.stop_reason == "tool_use" and whole.model == CLAUDE
        async with client.messages.stream(**body) as stream:
            streamed = await stream.get_final_message()
        assert [b.type for b in streamed.content] == kinds
        uses = [b for b in (*whole.content, *streamed.content) if b.type == "tool_use"]
        assert len({use.id for use in uses}) == len(uses) == 2  # fresh per call
        background = await client.messages.create(model="claude-3-5-haiku-20241022", max_tokens=20,
                                                  messages=USER)  # Claude Code's side calls
        assert background.content[0].type == "text" and background.content[0].text
        counted = await client.messages.count_tokens(model=CLAUDE, messages=USER)
        answered = await client.messages.create(model=CLAUDE, max_tokens=5, messages=USER)
        assert counted.input_tokens == answered.usage.input_tokens > 0
        await settled(gateway, 0)


@pytest.mark.timeout(60)
async def test_openai_sdk_chat_completions_responses_and_models() -> None:
    options = SimOptions(speed=50, enable_response_store=True)
    async with start_sim_pair(options) as pair, live_gateway(pair) as gateway:
        client = oai(gateway)
        assert (await client.models.retrieve(SERVED)).id == SERVED
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-4o")
        other_name = await client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=8)
        assert other_name.model == "gpt-4o" and other_name.choices[0].message.content
        text = await client.completions.create(model=SERVED, prompt="Once", max_tokens=8)
        with pytest.raises(openai.NotFoundError):  # only /v1/responses checks, on the backend
            await client.responses.create(model="gpt-4o", input="hi")
        assert text.choices[0].text
        first = await client.responses.create(model=SERVED, input="plan a trip",
                                              max_output_tokens=300)
        assert first.status == "completed" and first.output_text
        gateway.runtime.apply_routing(gateway.runtime.settings.model_copy(update={
            "routing": gateway.runtime.settings.routing.model_copy(update={"policy": "plain-only"})}))
        follow = await client.responses.create(model=SERVED, input="shorter", stream=True,
                                               previous_response_id=first.id, max_output_tokens=300)
        events = [event async for event in follow]  # served by the server that stored `first`
        assert events[-1].type == "response.completed"
        assert events[-1].response.previous_response_id == first.id
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        async with client.responses.stream(model=SERVED, input="again", max_output_tokens=300) as s:
            assert (await s.get_final_response()).status == "completed"
        await client.close()
        await settled(gateway, 0)


@pytest.mark.timeout(60)
async def test_aliased_agent_names_reach_the_served_model_in_both_sdks(sim) -> None:
    """models.aliases (issue 29): Codex's default name, which SGLang's /v1/responses refuses
    (404, serving_responses.py:297), and Claude Code's claude-* names are served; the answers
    name the served model (SGLang echoes the request's `model`, now the served name). A name no
    alias matches still gets the engine's own 404, word for word."""
    direct = openai.AsyncOpenAI(base_url=sim.urls["mtp"] + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as engine:
        await direct.responses.create(model="gpt-4o", input="hi")
    await direct.close()
    models = {"aliases": {"gpt-5-codex": SERVED, "claude-*": SERVED}, "list_aliases": True}
    async with live_gateway(sim, models=models) as gateway:
        client = oai(gateway)
        with pytest.raises(openai.NotFoundError) as relayed:
            await client.responses.create(model="gpt-4o", input="hi")
        assert relayed.value.body == engine.value.body
        codex = await client.responses.create(model="gpt-5-codex", input="hi", max_output_tokens=300)
        assert codex.status == "completed" and codex.output_text and codex.model == SERVED
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model=CLAUDE, messages=USER, max_tokens=8, stream=True)]
        assert {chunk.model for chunk in chunks} == {SERVED}
        text = await client.completions.create(model="gpt-5-codex", prompt="Once", max_tokens=8)
        assert text.model == SERVED and text.choices[0].text
        listed = [card.id async for card in client.models.list()]
        assert listed == [SERVED, "gpt-5-codex"]  # a pattern is not a name: not listed
        assert (await client.models.retrieve("claude-opus-4-1")).id == "claude-opus-4-1"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-4o")
        await client.close()
        anthropic_client = claude(gateway)
        message = await anthropic_client.messages.create(model=CLAUDE, max_tokens=20, messages=USER)
        assert message.model == SERVED and message.content[0].type == "text"
        async with anthropic_client.messages.stream(model="claude-haiku-4-5", max_tokens=20,
                                                    messages=USER) as stream:
            assert (await stream.get_final_message()).model == SERVED
        counted = await anthropic_client.messages.count_tokens(model=CLAUDE, messages=USER)
        assert counted.input_tokens == message.usage.input_tokens > 0
        await settled(gateway, 0)


@pytest.mark.timeout(60)
async def test_aliases_serve_the_agents_default_names_on_vllm_which_checks_every_name() -> None:
    """vLLM refuses a name it does not serve on every API (404, serve/engine/serving.py:49-83);
    with aliases the CLIs' defaults (Codex gpt-6.2-sol, Claude Code claude-opus-4-8) are
    served, and vLLM's own 404 still answers a name no alias matches."""
    options = SimOptions(speed=50, engine="vllm")
    models = {"aliases": {"claude-*": SERVED, "gpt-*": SERVED}}
    async with start_sim_pair(options) as pair, live_gateway(pair, models=models) as gateway:
        client = oai(gateway)
        codex = await client.responses.create(model="gpt-6.2-sol", input="hi", max_output_tokens=20)
        assert codex.output_text and codex.model == SERVED
        chat = await client.chat.completions.create(model="claude-opus-4-8", messages=USER, max_tokens=5)
        assert chat.model == SERVED and chat.choices[0].message.content
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.chat.completions.create(model="o3", messages=USER, max_tokens=5)
        await client.close()
        async with claude(gateway).messages.stream(model="claude-opus-4-8", max_tokens=8,
                                                   messages=USER) as stream:
            assert (await stream.get_final_message()).usage.output_tokens > 0
        await settled(gateway, 0)


@pytest.mark.timeout(60)
async def test_a_crash_after_the_first_byte_raises_in_both_sdks(sim) -> None:
    for server in sim.servers.values():  # wherever the request goes, it dies mid-answer
        await server.set_faults(Faults(crash_after_chunks=6))
    async with live_gateway(sim, monitor={"circuit_failures": 100}) as gateway:
        client = oai(gateway)
        with pytest.raises(openai.APIError):
            async for _ in await client.chat.completions.create(
                    model=SERVED, messages=USER, max_tokens=200, stream=True):
                pass
        with pytest.raises(openai.APIError):
            async for _ in await client.completions.create(model=SERVED, prompt="Once",
                                                           max_tokens=200, stream=True):
                pass
        with pytest.raises(anthropic.APIError):
            async with claude(gateway).messages.stream(model=CLAUDE, max_tokens=200,
                                                       messages=USER) as stream:
                async for _ in stream:
                    pass
        with pytest.raises(RuntimeError, match="response.completed"):
            async with client.responses.stream(model=SERVED, input="hi",
                                               max_output_tokens=200) as stream:
                await stream.get_final_response()
        raw = await client.responses.create(model=SERVED, input="hi", max_output_tokens=200,
                                            stream=True)
        last = [event async for event in raw][-1]
        assert last.type == "response.failed" and last.response.error.message
        await client.close()
        await settled(gateway, 0)


async def backend_of(gateway: LiveGateway, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=20) as http:
        return await http.post(gateway.url + path, json=body)


STREAMS = {
    "/v1/chat/completions": {"model": SERVED, "messages": USER, "max_tokens": 20, "stream": True},
    "/v1/messages": {"model": CLAUDE, "messages": USER, "max_tokens": 20, "stream": True},
    "/v1/responses": {"model": SERVED, "input": "hi", "max_output_tokens": 20, "stream": True},
}


@pytest.mark.timeout(60)
async def test_a_full_queue_in_a_200_is_served_by_the_other_server_and_both_full_raise(sim) -> None:
    await sim.servers["mtp"].set_faults(Faults(abort_status=503))
    async with live_gateway(sim) as gateway, httpx.AsyncClient() as http:
        for path, body in STREAMS.items():
            served = await backend_of(gateway, path, body)
            assert served.status_code == 200 and served.headers["x-gateway-backend"] == "plain"
            assert b"Simulated abort" not in served.content, path
        metrics = (await http.get(gateway.url + "/metrics")).text
        assert 'gateway_upstream_errors_total{backend="mtp",kind="stream_error"} 3.0' in metrics
        await sim.servers["plain"].set_faults(Faults(abort_status=503))
        with pytest.raises(openai.APIError, match="Simulated abort"):
            async for _ in await oai(gateway).chat.completions.create(**{
                    k: v for k, v in STREAMS["/v1/chat/completions"].items() if k != "stream"},
                    stream=True):
                pass
        with pytest.raises(anthropic.APIStatusError, match="Simulated abort"):
            async with claude(gateway).messages.stream(model=CLAUDE, max_tokens=20,
                                                       messages=USER) as stream:
                async for _ in stream:
                    pass
        failed = await backend_of(gateway, "/v1/responses", STREAMS["/v1/responses"])
        assert b"event: response.failed" in failed.content and b"[DONE]" not in failed.content
        await settled(gateway, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_a_disconnect_frees_the_backend_slot_at_once(path: str) -> None:
    """Read from the simulator's /v1/loads, at speed 1: a gateway that kept the upstream stream open would
    leave the slot taken until the generation ended (5,000 tokens). /v1/responses: the gateway aborts
    the request_id it set. /v1/messages: no rid SGLang reads by default; the gateway closes the upstream
    connection at once, and SGLang aborts a stream whose connection closed
    (tokenizer_manager.py:958)."""
    body = {**STREAMS[path], "max_tokens": 5000, "max_output_tokens": 5000}
    body.pop("max_output_tokens" if path == "/v1/messages" else "max_tokens")
    async with start_sim_pair(SimOptions(speed=1)) as pair, live_gateway(pair) as gateway, \
            httpx.AsyncClient() as http:
        async with http.stream("POST", gateway.url + path, json=body) as response:
            chunks = response.aiter_raw()
            head = b""
            while b"delta" not in head:  # generating: the slot is taken
                head += await chunks.__anext__()
            left = time.monotonic()

        async def running() -> int:
            loads = (await http.get(pair.urls["mtp"] + "/v1/loads")).json()["loads"]
            return sum(rank["num_running_reqs"] + rank["num_waiting_reqs"] for rank in loads)

        while await running():
            # 1.5 s is a margin for a loaded CI machine; measured 4-35 ms (docs/compat.md).
            assert time.monotonic() - left < 1.5, "the upstream stream outlived its client"
            await asyncio.sleep(0.005)
        await settled(gateway, 0)


@pytest.mark.timeout(60)
async def test_three_tool_calls_through_the_gateway_carry_three_ids(sim) -> None:
    async with live_gateway(sim) as gateway:
        client = oai(gateway)
        ids = set()
        for _ in range(3):
            answer = await client.chat.completions.create(
                model=SERVED, messages=USER, max_tokens=300, tools=OPENAI_TOOLS,
                tool_choice="required")
            ids.update(call.id for call in answer.choices[0].message.tool_calls or [])
        assert len(ids) == 3, ids
        await client.close()
        await wait_until(lambda: gateway.pool.concurrency == 0)
