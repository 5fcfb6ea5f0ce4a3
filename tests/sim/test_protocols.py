"""What each API accepts and answers, as SGLang 0.5.23 does (docs/compat.md has the sources):
model names, the stream flag, error envelopes, rids, tool-call ids."""

import json
import re

import anthropic
import httpx
import openai
import pytest

from gateway.sim.faults import Faults
from gateway.sim.server import SimOptions, start_sim_pair
from tests.sim.conftest import wait_until

SERVED = "Qwen/Qwen3.5-122B-A10B"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
MESSAGES = {"model": "claude-sonnet-4-5", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
LORA_OFF = "LoRA adapter 'latest' was requested, but LoRA is not enabled."


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


async def test_model_names_are_not_checked_but_lora_syntax_is(pair):
    client = oai(pair.urls["plain"])
    for name in ("claude-haiku-4-5-20251001", "gpt-4o", SERVED, "whatever"):
        answer = await client.chat.completions.create(**{**CHAT, "model": name})
        assert answer.model == name
    claude = anthropic.AsyncAnthropic(base_url=pair.urls["plain"], api_key="x", max_retries=0)
    message = await claude.messages.create(**MESSAGES)
    assert message.model == "claude-sonnet-4-5" and message.content[0].type == "text"
    # "name:tag" asks for a LoRA adapter, and this server has none: 400 before the stream on chat...
    with pytest.raises(openai.BadRequestError, match=LORA_OFF):
        await client.chat.completions.create(**{**CHAT, "model": "qwen3:latest"}, stream=True)
    # ... but an error inside the 200 on /v1/messages (its stream is not kick-started).
    async with httpx.AsyncClient() as http:
        raw = await http.post(pair.urls["plain"] + "/v1/messages",
                              json={**MESSAGES, "model": "qwen3:latest", "stream": True})  # fmt: skip
    assert raw.status_code == 200
    assert raw.text.split("\n\n")[1].startswith('event: error\ndata: {"type":"error","error":'
                                                 '{"type":"invalid_request_error","message":"LoRA adapter')


async def test_responses_checks_the_model(pair):
    client = oai(pair.urls["mtp"])
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model="gpt-4o", input="hi")
    assert caught.value.body == {"message": "The model 'gpt-4o' does not exist",
                                 "type": "invalid_request_error", "param": "model", "code": 404}  # fmt: skip
    answer = await client.responses.create(model=SERVED, input="hi", max_output_tokens=300)
    assert answer.status == "completed" and answer.output_text
    async with httpx.AsyncClient() as http:  # no model: whatever is loaded
        unnamed = await http.post(pair.urls["mtp"] + "/v1/responses", json={"input": "hi"})
    assert unnamed.status_code == 200 and unnamed.json()["model"] == SERVED


async def test_messages_errors_use_the_anthropic_envelope(pair):
    url = pair.urls["mtp"] + "/v1/messages"
    async with httpx.AsyncClient() as http:
        no_max = await http.post(url, json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        bad_tool = await http.post(url, json={**MESSAGES, "tools": [{"name": "ls", "input_schema": {}}],
                                              "tool_choice": {"type": "tool", "name": "rm"}})  # fmt: skip
    for response in (no_max, bad_tool):
        assert response.status_code == 400
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert "tool_choice references tool 'rm'" in bad_tool.json()["error"]["message"]


@pytest.mark.parametrize("value", [True, "true", "True", 1, "1", "yes", "on"])
async def test_stream_flag_is_read_as_pydantic_reads_a_bool(pair, value):
    async with httpx.AsyncClient() as http:
        url = pair.urls["plain"] + "/v1/chat/completions"
        response = await http.post(url, json={**CHAT, "stream": value})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")


async def test_stream_flag_refusals(pair):
    url = pair.urls["plain"]
    async with httpx.AsyncClient() as http:
        chat_null = await http.post(url + "/v1/chat/completions", json={**CHAT, "stream": None})
        chat_two = await http.post(url + "/v1/chat/completions", json={**CHAT, "stream": 2})
        messages_null = await http.post(url + "/v1/messages", json={**MESSAGES, "stream": None})
        messages_bad = await http.post(url + "/v1/messages", json={**MESSAGES, "stream": "sure"})
    assert chat_null.status_code == chat_two.status_code == 400
    assert chat_null.json()["type"] == "Bad Request"
    assert messages_null.status_code == 200 and messages_null.json()["type"] == "message"
    assert messages_bad.status_code == 400 and messages_bad.json()["type"] == "error"


async def test_messages_take_no_rid(pair):
    server = pair.servers["plain"]
    body = {**MESSAGES, "max_tokens": 100_000, "stream": True, "rid": "mine"}
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", pair.urls["plain"] + "/v1/messages", json=body) as response:
            lines = response.aiter_lines()
            await anext(lines)
            assert "mine" not in server.live.engine
            await http.post(pair.urls["plain"] + "/abort_request", json={"rid": "mine"})
            assert server.live.engine.num_running == 1


async def test_responses_request_id_is_the_rid_and_the_id(pair):
    server = pair.servers["mtp"]
    body = {"model": SERVED, "input": "go on", "max_output_tokens": 100_000, "stream": True,
            "request_id": "resp_mine", "ignore_eos": True}  # fmt: skip
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", pair.urls["mtp"] + "/v1/responses", json=body) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            assert "resp_mine" in server.live.engine
            await http.post(pair.urls["mtp"] + "/abort_request", json={"rid": "resp_mine"})
            await wait_until(lambda: server.live.engine.num_running == 0)
    assert first == "event: response.created"


async def test_tool_call_ids_are_fresh_per_call(pair):
    client = oai(pair.urls["plain"])
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    ids = set()
    for rid in ("gateway-0001", "gateway-0002", "gateway-0003"):  # rids sharing a prefix
        answer = await client.chat.completions.create(
            **{**CHAT, "max_tokens": 300}, tools=tools, tool_choice="required", extra_body={"rid": rid})
        ids.add(answer.choices[0].message.tool_calls[0].id)
    assert len(ids) == 3 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert answer.choices[0].message.content == ""  # serving_chat: "" rather than null
    json.loads(answer.choices[0].message.tool_calls[0].function.arguments)


async def test_responses_store_is_off_by_default_as_in_sglang(pair):
    client = oai(pair.urls["plain"])
    with pytest.raises(openai.BadRequestError, match="Response store is disabled"):
        await client.responses.create(model=SERVED, input="again", previous_response_id="resp_x")
    async with httpx.AsyncClient() as http:
        got = await http.get(pair.urls["plain"] + "/v1/responses/resp_x")
    assert got.status_code == 400 and got.json()["error"]["param"] == "response_id"


async def test_stored_responses_live_on_the_server_that_made_them():
    async with start_sim_pair(SimOptions(speed=50, enable_response_store=True)) as pair:
        mtp, plain = oai(pair.urls["mtp"]), oai(pair.urls["plain"])
        first = await mtp.responses.create(model=SERVED, input="plan a trip", max_output_tokens=300)
        follow = await mtp.responses.create(model=SERVED, input="shorter", previous_response_id=first.id,
                                            max_output_tokens=300, stream=True)  # fmt: skip
        events = [event async for event in follow]
        assert events[-1].type == "response.completed"
        assert events[-1].response.previous_response_id == first.id
        assert (await mtp.responses.retrieve(first.id)).output_text == first.output_text
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{first.id}' not found"):
            await plain.responses.create(model=SERVED, input="shorter", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            await plain.responses.retrieve(first.id)
        cancelled = await mtp.responses.cancel(first.id)  # finished: returned as it is
        assert cancelled.status == "completed"
        with pytest.raises(openai.BadRequestError, match="Expected an ID that begins with 'resp'"):
            await mtp.responses.retrieve("msg_1")


async def test_count_tokens_matches_the_input_tokens_of_the_answer(pair):
    claude = anthropic.AsyncAnthropic(base_url=pair.urls["mtp"], api_key="x", max_retries=0)
    body = {"model": "claude-sonnet-4-5", "system": "be brief",
            "messages": [{"role": "user", "content": "list the files"}]}  # fmt: skip
    counted = await claude.messages.count_tokens(**body)
    answer = await claude.messages.create(**body, max_tokens=20)
    assert counted.input_tokens == answer.usage.input_tokens > 0


TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": {"type": "object"}}]


async def test_an_agent_runs_its_tool_loop_on_messages(pair):
    """tool_use when the user spoke last (auto) or a tool is forced; a text answer once the
    tool result is in; stream and non-stream agree."""
    claude = anthropic.AsyncAnthropic(base_url=pair.urls["mtp"], api_key="x", max_retries=0)
    turn = [{"role": "user", "content": "what is in setup.py?"}]
    body = {"model": "claude-sonnet-4-5", "max_tokens": 400, "tools": TOOLS}
    first = await claude.messages.create(**body, messages=turn)
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "read_file" and isinstance(call.input, dict)
    assert call.id.startswith("call_")
    async with claude.messages.stream(**body, messages=turn, tool_choice={"type": "any"}) as stream:
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == call.input
    assert streamed.content[-1].id != call.id
    turn += [{"role": "assistant", "content": [c.model_dump() for c in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "x=1"}]}]
    answer = await claude.messages.create(**body, messages=turn)
    assert answer.stop_reason == "end_turn" and [c.type for c in answer.content] == ["text"]
    none = await claude.messages.create(**body, messages=turn[:1], tool_choice={"type": "none"})
    assert none.content[0].type == "text"


async def test_messages_thinking_blocks_and_stream_shape(pair):
    """message_start waits for the first content and carries the prompt tokens; a thinking
    block, then a text block, each opened and closed; message_delta has no stop_sequence."""
    body = {**MESSAGES, "max_tokens": 400, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    async with httpx.AsyncClient() as http:
        raw = (await http.post(pair.urls["plain"] + "/v1/messages", json={**body, "stream": True})).text
    blocks = [block.split("\n") for block in raw.split("\n\n")[:-1]]
    events = [(lines[0][7:], json.loads(lines[1][6:])) for lines in blocks]
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    start = events[0][1]["message"]
    assert start["content"] == [] and "stop_reason" not in start
    assert start["usage"]["input_tokens"] > 0 and start["usage"]["output_tokens"] == 0
    blocks = [data["content_block"]["type"] for name, data in events if name == "content_block_start"]
    assert blocks == ["thinking", "text"]
    assert names.count("content_block_stop") == 2
    assert names[-2:] == ["message_delta", "message_stop"]
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn"}
    claude = anthropic.AsyncAnthropic(base_url=pair.urls["plain"], api_key="x", max_retries=0)
    whole = await claude.messages.create(**body)
    assert [c.type for c in whole.content] == ["thinking", "text"]
    deltas = [d["delta"] for _, d in events if d["type"] == "content_block_delta"]
    thinking = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
    assert thinking == whole.content[0].thinking
    assert events[-2][1]["usage"] == {"output_tokens": whole.usage.output_tokens}


async def test_messages_and_responses_streams_answer_before_the_first_token(pair):
    """No kick-start on these two (anth:_handle_streaming, http:2066): the 200 head, and the
    Responses' created/in_progress events, come while the request still waits in the queue."""
    server = pair.servers["plain"]
    await server.set_faults(Faults(slow_factor=1000.0))  # no token soon
    body = {"model": SERVED, "input": "hi", "stream": True}
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", pair.urls["plain"] + "/v1/responses", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            assert [await anext(lines) for _ in range(2)][0] == "event: response.created"
            assert server.live.engine.stats.generated_tokens == 0
        url = pair.urls["plain"] + "/v1/messages"
        async with http.stream("POST", url, json={**MESSAGES, "stream": True}) as r:
            assert r.status_code == 200 and server.live.engine.stats.generated_tokens == 0


async def test_n_choices_each_a_request_with_a_random_rid(pair):
    """n > 1: each sample gets a fresh rid (tokenizer_manager regenerate_rid), so the client's
    rid names nothing; a stream carries each choice's chunks under its own id, the finish chunks
    and usage after the last output; the prompt is counted once."""
    client = oai(pair.urls["plain"])
    whole = await client.chat.completions.create(**{**CHAT, "max_tokens": 300}, n=3,
                                                 extra_body={"rid": "mine"})  # fmt: skip
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) == 3 and whole.id != "mine"
    lengths = sum(len(c.message.content.split()) for c in whole.choices)
    prompt = (await client.chat.completions.create(**CHAT)).usage.prompt_tokens
    assert whole.usage.completion_tokens == lengths and whole.usage.prompt_tokens == prompt
    async with httpx.AsyncClient() as http:
        raw = (await http.post(pair.urls["plain"] + "/v1/chat/completions", json={
            **CHAT, "n": 2, "rid": "mine", "stream": True, "stream_options": {"include_usage": True}})).text
    chunks = [json.loads(block[6:]) for block in raw.split("\n\n")[:-2]]
    content = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    ids = {c["choices"][0]["index"]: c["id"] for c in content}
    assert sorted(ids) == [0, 1] and len(set(ids.values())) == 2 and "mine" not in ids.values()
    finishes = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["index"] for c in finishes] == [0, 1]
    assert len({c["id"] for c in finishes}) == 1 and chunks[-1]["id"] == finishes[0]["id"]
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt and chunks[-1]["choices"] == []


async def test_a_stream_of_n_choices_is_aborted_whole_when_its_client_leaves(pair):
    engine = pair.servers["plain"].live.engine
    body = {"model": "m", "prompt": "go", "max_tokens": 100_000, "ignore_eos": True, "stream": True,
            "n": 3}  # fmt: skip
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", pair.urls["plain"] + "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            await anext(lines)
            assert engine.num_running + engine.num_waiting == 3
        await wait_until(lambda: engine.num_running + engine.num_waiting == 0)


async def test_messages_stream_bytes_are_sglangs_pydantic_dumps(pair):
    """model_dump_json(exclude_none=True) of anthropic/protocol.py's events: compact, no nulls
    (no stop_reason in message_start, no stop_sequence in message_delta), event name = type."""
    body = {**MESSAGES, "max_tokens": 5, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient() as http:
        raw = (await http.post(pair.urls["plain"] + "/v1/messages", json=body)).text
    def event(name: str, data: str) -> str:
        return f"event: {name}\ndata: {data}\n\n"
    expected = (
        event("message_start", '{"type":"message_start","message":{"id":"msg_[0-9a-f]{32}","type":"message",'
              '"role":"assistant","content":\\[\\],"model":"claude-sonnet-4-5",'
              '"usage":{"input_tokens":\\d+,"output_tokens":0}}}')
        + event("content_block_start", '{"type":"content_block_start","index":0,'
                '"content_block":{"type":"text","text":""}}')
        + "(" + event("content_block_delta", '{"type":"content_block_delta","index":0,'
                      '"delta":{"type":"text_delta","text":"[a-z ]+"}}') + ")+"
        + event("content_block_stop", '{"type":"content_block_stop","index":0}')
        + event("message_delta", '{"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
                '"usage":{"output_tokens":5}}')
        + event("message_stop", '{"type":"message_stop"}')
    )  # fmt: skip
    assert re.fullmatch(expected, raw), raw


# protocol.py ResponsesResponse
RESPONSES_FIELDS = {"id", "object", "created_at", "model", "output", "status", "usage",
                    "parallel_tool_calls", "tool_choice", "tools", "error", "incomplete_details",
                    "instructions", "max_output_tokens", "previous_response_id", "reasoning", "store",
                    "temperature", "text", "top_p", "truncation", "user", "metadata"}  # fmt: skip


async def test_responses_function_calls_and_the_body_fields(pair):
    client = oai(pair.urls["mtp"])
    tools = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    called = await client.responses.create(model=SERVED, input="find it", tools=tools, max_output_tokens=400)
    call = called.output[-1]
    assert call.type == "function_call" and call.name == "lookup" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments), dict)
    follow = [{"role": "user", "content": "find it"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "found"}]  # fmt: skip
    answer = await client.responses.create(model=SERVED, input=follow, tools=tools, max_output_tokens=400)
    assert answer.output[-1].type == "message" and answer.output_text
    stream = await client.responses.create(model=SERVED, input="find it", tools=tools, max_output_tokens=400,
                                           tool_choice="required", stream=True)  # fmt: skip
    events = [event async for event in stream]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-1].response.output[-1].arguments
    async with httpx.AsyncClient() as http:
        url = pair.urls["mtp"] + "/v1/responses"
        raw = (await http.post(url, json={"model": SERVED, "input": "x"})).json()
    assert set(raw) == RESPONSES_FIELDS
    assert raw["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}


async def test_responses_reasoning_item_and_its_tokens(pair):
    client = oai(pair.urls["plain"])
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    answer = await client.responses.create(model=SERVED, input="think first", max_output_tokens=400,
                                           extra_body=thinking)  # fmt: skip
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    reasoning = answer.output[0].content[0].text
    assert answer.usage.output_tokens_details.reasoning_tokens == len(reasoning.split()) > 0


async def test_context_overflow_is_raised_where_sglang_raises_it(pair):
    """tokenizer_manager's length checks raise inside generate_request: a 400 before a
    kick-started chat stream, but an error inside the 200 of a Messages stream; non-stream
    Messages keeps the chat handler's error type."""
    url = pair.urls["plain"]
    too_many = 262_144  # the profile's context: prompt + max_tokens no longer fits
    async with httpx.AsyncClient() as http:
        chat = await http.post(url + "/v1/chat/completions",
                               json={**CHAT, "max_tokens": too_many, "stream": True})  # fmt: skip
        messages = {**MESSAGES, "max_tokens": too_many}
        streamed = await http.post(url + "/v1/messages", json={**messages, "stream": True})
        whole = await http.post(url + "/v1/messages", json=messages)
    message = "Requested token count exceeds the model's maximum context length of 262144 tokens."
    assert chat.status_code == 400 and chat.json()["type"] == "BadRequestError"
    assert chat.json()["message"].startswith(message)
    assert streamed.status_code == 200
    assert [b.split("\n")[0] for b in streamed.text.split("\n\n")[:-1]] == [
        "event: message_start", "event: error", "event: message_stop"]
    assert whole.status_code == 400
    error = whole.json()["error"]
    assert error["type"] == "BadRequestError" and error["message"].startswith(message)
