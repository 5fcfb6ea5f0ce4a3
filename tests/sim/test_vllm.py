"""`mtp-gateway sim --engine vllm`: each shape a simulated vLLM 0.33.0 server serves, with the
vLLM source line it follows (paths under `vllm/` in the 0.33.0 wheel; docs/compat.md's vLLM
section has every row)."""

import asyncio
import dataclasses
import json
import random

import httpx
import pytest

from gateway.sim.engine import Engine
from gateway.sim.engine import Request as EngineRequest
from gateway.sim.faults import Faults
from gateway.sim.profile import load_profiles
from gateway.sim.server import SimOptions, start_sim_pair
from gateway.sim.vllm.app import VllmOptions
from gateway.sim.vllm.dynamic import dense_schedule
from gateway.sim.vllm.sleep import sleep_cost_s, wake_cost_s
from tests.sim.conftest import run_on_loop_clock, until_on_loop_clock, wait_until

SPEED = 50
MODEL = "Qwen/Qwen3.5-122B-A10B"
CHAT = [{"role": "user", "content": "Tell me about the pair of servers"}]


def vllm(**kw) -> SimOptions:
    return SimOptions(**{"speed": SPEED, "engine": "vllm", **kw})


def dev(**kw) -> SimOptions:
    return vllm(vllm=VllmOptions(dev_mode=True, enable_sleep_mode=True), **kw)


def events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def long(max_tokens: int = 2000) -> dict:
    return {"messages": CHAT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


async def test_chat_stream_bytes_are_vllms_pydantic_dumps():
    """chat/serving.py:494-507 (exclude_unset dumps), :596-625 (the role chunk with
    prompt_token_ids/prompt_text), :782-823 (content and finish chunks), :862-918 (usage);
    the id is chatcmpl-<X-Request-Id> (:320-322, serve/engine/serving.py:133-142); the
    reasoning delta is `reasoning` (generate/base/protocol.py:356-360); the model field is
    the served name whatever the request said."""
    async with start_sim_pair(vllm()) as pair, httpx.AsyncClient(timeout=10) as http:
        body = {**long(12), "stream_options": {"include_usage": True},
                "chat_template_kwargs": {"enable_thinking": True}}
        answer = await http.post(pair.urls["mtp"] + "/v1/chat/completions", json=body,
                                 headers={"x-request-id": "abc"})
    assert answer.status_code == 200
    data = events(answer.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    head = '{"id":"chatcmpl-abc","object":"chat.completion.chunk","created":'
    assert all(d.startswith(head) for d in data[:-1])
    assert data[0].endswith('"model":"Qwen/Qwen3.5-122B-A10B","choices":[{"index":0,"delta":{"role":'
                            '"assistant","content":""},"logprobs":null,"finish_reason":null}],'
                            '"prompt_token_ids":null,"prompt_text":null}')
    middle = chunks[1:-2]
    assert all(set(c["choices"][0]) == {"index", "delta", "logprobs", "finish_reason", "token_ids"}
               for c in middle)
    assert all(c["kv_transfer_params"] is None for c in middle)
    kinds = [next(iter(c["choices"][0]["delta"])) for c in middle]
    assert kinds[0] == "reasoning" and "content" in kinds and "reasoning_content" not in kinds
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "length"
    assert list(finish)[-3:] == ["stop_reason", "token_ids", "weight_versions"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert list(chunks[-1]) == ["id", "object", "created", "model", "choices", "usage"]  # exclude_none


async def test_errors_are_nested_with_vllms_types_and_params():
    """serve/engine/serving.py:49-83 (unknown model: 404 NotFoundError, param "model"),
    renderers/params.py:538-551 (a prompt over the context: 400 param "input_tokens"),
    serve/utils/api_utils.py:309-315 and exception_handling/handlers/validation.py:149-195
    (a non-JSON body: 400 "Bad Request"), anthropic/api_router.py:40-49 (Messages: the
    Anthropic envelope with the status's type)."""
    profiles = {n: dataclasses.replace(p, context_length=16) for n, p in load_profiles().items()}
    async with start_sim_pair(vllm(profiles=profiles)) as pair, httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["plain"]
        unknown = await http.post(url + "/v1/chat/completions", json={"model": "gpt-4o", "messages": CHAT})
        long_prompt = [{"role": "user", "content": "word " * 40}]
        overflow = await http.post(url + "/v1/completions", json={"prompt": "word " * 40})
        overflow_chat = await http.post(url + "/v1/chat/completions",
                                        json={"messages": long_prompt, "stream": True})
        not_json = await http.post(url + "/v1/chat/completions", content=b"{}",
                                   headers={"content-type": "text/plain"})
        messages = await http.post(url + "/v1/messages", json={"model": "claude-sonnet-4-5",
                                                               "max_tokens": 5, "messages": CHAT})
    assert unknown.status_code == 404
    assert unknown.json() == {"error": {
        "message": "The model `gpt-4o` does not exist. Valid aliases: Qwen/Qwen3.5-122B-A10B.",
        "type": "NotFoundError", "param": "model", "code": 404}}
    for answer in (overflow, overflow_chat):  # a stream is refused before its 200 too
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)
        assert error["message"].startswith("This model's maximum context length is 16 tokens.")
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "Bad Request"
    assert "object" not in not_json.json()  # never SGLang's flat error
    assert messages.status_code == 404
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "not_found_error"


async def test_max_tokens_is_clamped_not_refused():
    """serve/utils/api_utils.py:233-270 (get_max_tokens): max_tokens above what the context
    leaves is cut to it; SGLang refuses the same request with a 400."""
    profiles = {n: dataclasses.replace(p, context_length=40) for n, p in load_profiles().items()}
    async with start_sim_pair(vllm(profiles=profiles)) as pair, httpx.AsyncClient(timeout=10) as http:
        answer = await http.post(pair.urls["plain"] + "/v1/completions",
                                 json={"prompt": "one two three four", "max_tokens": 10**6,
                                       "ignore_eos": True})
    assert answer.status_code == 200
    body = answer.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 40


async def test_a_mid_stream_error_is_an_error_chunk_then_done():
    """chat/serving.py:494-507, :947-950: the ErrorResponse as a chunk after the 200, then
    [DONE], no usage chunk; the Messages converter closes the open block and ends with
    `event: error`, no message_stop (anthropic/serving.py:1228-1247)."""
    async with start_sim_pair(vllm()) as pair, httpx.AsyncClient(timeout=10) as http:
        await pair.servers["mtp"].set_faults(Faults(error_after_chunks=3))
        chat = await http.post(pair.urls["mtp"] + "/v1/chat/completions",
                               json={**long(50), "stream_options": {"include_usage": True}})
        messages = await http.post(pair.urls["mtp"] + "/v1/messages",
                                   json={"model": MODEL, "max_tokens": 50, "messages": CHAT, "stream": True,
                                         "ignore_eos": True})  # fmt: skip
    assert chat.status_code == 200
    data = events(chat.text)
    assert len(data) == 5 and data[-1] == "[DONE]"
    assert data[-2] == ('{"error":{"message":"Internal server error","type":"InternalServerError",'
                        '"param":null,"code":500}}')
    assert messages.status_code == 200
    names = [line[7:] for line in messages.text.split("\n") if line.startswith("event: ")]
    assert names[-2:] == ["content_block_stop", "error"] and "message_stop" not in names
    assert json.loads(events(messages.text)[-1])["error"]["type"] == "api_error"


RESPONSE_FIELDS = [
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object", "output",
    "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background", "max_output_tokens",
    "max_tool_calls", "previous_response_id", "prompt", "prompt_cache_options", "prompt_cache_key",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "status", "text",
    "top_logprobs", "truncation", "usage", "user", "presence_penalty", "frequency_penalty",
    "kv_transfer_params", "ec_transfer_params", "input_messages", "output_messages"]


async def test_a_response_is_vllms_responses_response_dump():
    """openai/responses/protocol.py:870-951 (ResponsesResponse's fields in order, `metrics`
    left out when None), :966-1031 (from_request: id = request_id, `resp_<hex>` by default,
    :357-364; max_output_tokens the clamped sampling value, serving.py:429-439; temperature and
    top_p SamplingParams' 1.0), :98-117 and serving.py:892-921 (usage with the per-turn lists),
    serving.py:1067-1085 (one `msg_` message item, status incomplete at the length limit,
    utils.py:103-107); `store` is not a field of the response; unknown `previous_response_id`
    is a 404 (store off, serving.py:365-371, :1206-1212) where SGLang says 400."""
    profiles = {n: dataclasses.replace(p, context_length=64) for n, p in load_profiles().items()}
    async with start_sim_pair(vllm(profiles=profiles)) as pair, httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["plain"] + "/v1/responses"
        answer = await http.post(url, json={"model": MODEL, "input": "hi", "max_output_tokens": 6,
                                            "temperature": 0, "store": True})
        clamped = await http.post(url, json={"input": "hi", "request_id": "resp_mine", "ignore_eos": True})
        previous = await http.post(url, json={"input": "hi", "previous_response_id": "resp_nowhere"})
        background = await http.post(url, json={"input": "hi", "background": True})
        unknown = await http.post(url, json={"model": "gpt-5-codex", "input": "hi",
                                             "previous_response_id": "resp_nowhere"})
        missing = await http.post(url, json={"model": MODEL})
    assert answer.status_code == 200
    body = answer.json()
    assert list(body) == RESPONSE_FIELDS
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert (body["temperature"], body["top_p"], body["max_output_tokens"]) == (0.0, 1.0, 6)
    assert (body["text"], body["top_logprobs"], body["service_tier"]) == (None, None, "auto")
    assert '"temperature":0.0,' in answer.text and '"presence_penalty":0.0,' in answer.text
    (item,) = body["output"]
    assert list(item) == ["id", "content", "role", "status", "type", "phase"]
    assert item["id"].startswith("msg_") and item["status"] == "incomplete"
    part = item["content"][0]
    assert part == {"annotations": [], "text": part["text"], "type": "output_text", "logprobs": None}
    assert body["usage"] == {
        "input_tokens": body["usage"]["input_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                 "cached_tokens_per_turn": []},
        "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": body["usage"]["input_tokens"] + 6}
    whole = clamped.json()
    assert whole["id"] == "resp_mine"
    assert whole["max_output_tokens"] == 64 - whole["usage"]["input_tokens"]
    assert previous.status_code == 404
    assert previous.json() == {"error": {
        "message": "Response with id 'resp_nowhere' not found.", "type": "invalid_request_error",
        "param": "response_id", "code": 404}}
    assert background.status_code == 400 and background.json()["error"]["param"] == "background"
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"  # the model first
    assert missing.status_code == 400
    error = missing.json()["error"]
    assert (error["type"], error["param"]) == ("Bad Request", "body.input")


def sse(text: str) -> list[tuple[str, str]]:
    """Each event's name and data line."""
    blocks = [block.split("\n") for block in text.split("\n\n") if block]
    return [(lines[0].removeprefix("event: "), lines[1].removeprefix("data: ")) for lines in blocks]


async def test_a_responses_stream_is_vllms_simple_event_sequence():
    """openai/responses/serving.py:1343-1457 (created and in_progress with the empty
    in_progress response, sequence_number from 0 by one per event, the terminal event with the
    streamed items), api_router.py:32-43 (`event: <type>` then `model_dump_json`: the openai
    SDK's event models, checked here by re-dumping each with the SDK), streaming_events.py:
    835-954 (one `msg_` item at output_index 0, content_index 0, an output_text.delta per
    engine output, text.done, content_part.done, output_item.done with the item's status);
    never [DONE]. A GenerationError mid-stream (serving.py:1405-1424) is validated as an event,
    which no StreamingResponsesResponse member (protocol.py:1052-1077) accepts: the connection
    drops."""
    types = pytest.importorskip("openai.types.responses")
    async with start_sim_pair(vllm()) as pair, httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["mtp"] + "/v1/responses"
        answer = await http.post(url, json={"model": MODEL, "input": "hi", "max_output_tokens": 12,
                                            "stream": True, "ignore_eos": True})
        await pair.servers["mtp"].set_faults(Faults(error_after_chunks=5))
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(url, json={"input": "hi", "max_output_tokens": 50, "stream": True})
    assert answer.status_code == 200
    stream = sse(answer.text)
    names = [name for name, _ in stream]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    data = [json.loads(line) for _, line in stream]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data] == names
    adapter = __import__("pydantic").TypeAdapter(types.ResponseStreamEvent)
    for _, line in stream[2:-1]:  # the SDK's own models, dumped as vLLM dumps them
        assert adapter.validate_json(line).model_dump_json(indent=None, by_alias=True) == line
    created, final = data[0]["response"], data[-1]["response"]
    assert list(created) == RESPONSE_FIELDS and list(final) == RESPONSE_FIELDS
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    assert final["id"] == created["id"] and final["status"] == "incomplete"
    item_id = data[2]["item"]["id"]
    assert item_id.startswith("msg_")
    assert all((d["item_id"], d["output_index"], d["content_index"]) == (item_id, 0, 0) for d in data[3:-2])
    text = "".join(d["delta"] for d in data[4:-4])
    assert data[-4]["text"] == text
    assert final["output"] == [data[-2]["item"]]
    assert data[-2]["item"]["status"] == "incomplete"
    assert data[-2]["item"]["content"] == [{"annotations": [], "text": text, "type": "output_text",
                                            "logprobs": None}]
    assert final["usage"]["output_tokens"] == 12


async def test_messages_stream_and_its_end():
    """anthropic/serving.py:1033-1055 (message_start at the first chunk: the chat id, null
    stop fields, the prompt tokens), :1060-1082 (message_delta with stop_sequence),
    :1224-1226 (message_stop)."""
    async with start_sim_pair(vllm()) as pair, httpx.AsyncClient(timeout=10) as http:
        answer = await http.post(pair.urls["plain"] + "/v1/messages",
                                 json={"model": MODEL, "max_tokens": 6, "messages": CHAT, "stream": True})
    names = [line[7:] for line in answer.text.split("\n") if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    data = [json.loads(d) for d in events(answer.text)]
    start = data[0]["message"]
    assert start["id"].startswith("chatcmpl-") and start["stop_sequence"] is None
    assert start["usage"]["input_tokens"] > 0
    assert data[-2]["delta"]["stop_sequence"] is None


async def test_info_endpoints_are_vllms():
    """serve/engine/protocol.py:90-121 (owned_by "vllm", permission), openai/models/
    api_router.py:20-25 (no /v1/models/{id}), instrumentator/health.py:22-33,
    sagemaker/api_router.py:91-92, instrumentator/basic.py:53-56."""
    async with start_sim_pair(vllm()) as pair, httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["mtp"]
        models = (await http.get(url + "/v1/models")).json()
        assert models["data"][0]["owned_by"] == "vllm"
        assert models["data"][0]["permission"][0]["object"] == "model_permission"
        assert (await http.get(url + "/v1/models/" + models["data"][0]["id"])).status_code == 404
        assert (await http.get(url + "/health")).status_code == 200
        assert (await http.post(url + "/ping")).status_code == 200
        assert (await http.get(url + "/version")).json() == {"version": "0.33.0"}
        assert (await http.get(url + "/v1/loads")).status_code == 404  # SGLang's, not vLLM's


async def test_metrics_have_vllms_names():
    """v1/metrics/loggers.py:499, :527-545 (running/waiting, labels model_name and engine),
    :593-615 (engine_sleep_state), v1/spec_decode/metrics.py:228-262 (counters, _total)."""
    async with start_sim_pair(vllm()) as pair, httpx.AsyncClient(timeout=10) as http:
        await http.post(pair.urls["mtp"] + "/v1/chat/completions", json={**long(20), "stream": False})
        mtp = (await http.get(pair.urls["mtp"] + "/metrics")).text
        plain = (await http.get(pair.urls["plain"] + "/metrics")).text
    label = 'engine="0",model_name="Qwen/Qwen3.5-122B-A10B"'
    assert f"vllm:num_requests_running{{{label}}} 0.0" in mtp
    assert f"vllm:num_requests_waiting{{{label}}} 0.0" in mtp
    assert f'vllm:engine_sleep_state{{{label},sleep_state="awake"}} 1.0' in mtp
    assert "vllm:spec_decode_num_drafts_total" in mtp and "vllm:spec_decode_num_accepted_tokens_total" in mtp
    assert "spec_decode" not in plain and "sglang:" not in mtp


async def test_sleep_endpoints_exist_only_in_dev_mode():
    """entrypoints/launchers/api_server/routers.py:46-53; dev/sleep/api_router.py:26-61: level
    0-2 and mode abort|wait|keep are query checks (400 otherwise)."""
    async with start_sim_pair(vllm()) as pair, httpx.AsyncClient(timeout=10) as http:
        assert (await http.post(pair.urls["mtp"] + "/sleep")).status_code == 404
        assert (await http.get(pair.urls["mtp"] + "/is_sleeping")).status_code == 404
    async with start_sim_pair(dev()) as pair, httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["plain"]
        assert (await http.get(url + "/is_sleeping")).json() == {"is_sleeping": False}
        bad_level = await http.post(url + "/sleep?level=3")
        bad_mode = await http.post(url + "/sleep?mode=retract")
        assert bad_level.status_code == bad_mode.status_code == 400
        assert bad_level.json()["error"]["param"] == "query.level"
        assert bad_mode.json()["error"]["param"] == "query.mode"
        assert (await http.get(url + "/is_sleeping")).json() == {"is_sleeping": False}


def test_sleep_abort_ends_running_streams_with_finish_reason_abort():
    """v1/engine/core.py:976-977: mode=abort finishes every request aborted; the stream ends
    with finish_reason "abort" (v1/engine/__init__.py:37), then [DONE]. On the loop's clock:
    the stream cannot end on its own before the sleep arrives."""
    run_on_loop_clock(_sleep_abort_ends_running_streams_with_finish_reason_abort)


async def _sleep_abort_ends_running_streams_with_finish_reason_abort() -> None:
    async with start_sim_pair(dev()) as pair, httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["plain"]
        async with http.stream("POST", url + "/v1/chat/completions", json=long()) as stream:
            lines = stream.aiter_lines()
            while "content" not in await anext(lines):
                pass
            asleep = await http.post(url + "/sleep?level=1&mode=abort")
            rest = [line async for line in lines]
    assert asleep.json() == {"status": "sleeping", "level": 1}
    data = events("\n".join(rest))
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"


async def test_sleep_wait_finishes_running_streams_first():
    """v1/engine/core.py:958-970: mode=wait lets the running requests step to their end, and
    /sleep answers after them."""
    async with start_sim_pair(dev()) as pair, httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["plain"]
        running = asyncio.create_task(http.post(url + "/v1/chat/completions",
                                                json={**long(60), "stream": False}))
        await wait_until(lambda: pair.servers["plain"].live.engine.num_running == 1)
        asleep = await http.post(url + "/sleep?mode=wait")
        assert running.done()
        answer = (await running).json()
    assert asleep.status_code == 200
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 60


def test_sleep_keep_recomputes_running_streams_after_the_wake():
    """core.py:1006-1008 with v1/core/sched/scheduler.py:3194-3210: mode=keep at level 1
    preempts the running requests back to waiting; after /wake_up they are computed again
    (prompt and generated tokens) and finish whole. On the loop's clock: a loaded machine
    cannot let the request finish before the sleep arrives."""
    run_on_loop_clock(_sleep_keep_recomputes_running_streams_after_the_wake)


async def _sleep_keep_recomputes_running_streams_after_the_wake() -> None:
    async with start_sim_pair(dev()) as pair, httpx.AsyncClient(timeout=10) as http:
        url, engine = pair.urls["plain"], pair.servers["plain"].live.engine
        task = asyncio.create_task(http.post(url + "/v1/chat/completions",
                                             json={**long(80), "stream": False}))
        await until_on_loop_clock(_true_when(lambda: engine.stats.generated_tokens >= 5), 10,
                                  every=0.001)
        assert (await http.post(url + "/sleep?level=1&mode=keep")).status_code == 200
        assert engine.stats.retracted_requests == 1 and engine.num_running == 0 and not task.done()
        assert (await http.post(url + "/wake_up")).json() == {"status": "awake", "tags": None}
        answer = (await task).json()
    assert answer["usage"]["completion_tokens"] == 80
    assert engine.stats.reprefill_tokens > answer["usage"]["prompt_tokens"]


def _true_when(predicate):
    async def check() -> bool:
        return bool(predicate())
    return check


async def test_arrivals_while_asleep_hang_and_health_stays_200():
    """core.py:958-970 (every pause mode queues new requests: they hang until the wake) and
    v1/engine/async_llm.py:1129-1134 (/health looks only for a dead engine)."""
    async with start_sim_pair(dev()) as pair, httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["plain"]
        await http.post(url + "/sleep")
        task = asyncio.create_task(http.post(url + "/v1/completions",
                                             json={"prompt": "hello", "max_tokens": 5}))
        live = pair.servers["plain"].live
        await wait_until(lambda: live.num_held == 1)
        # Held in front of the scheduler: nothing but the wake sends it on.
        assert not task.done() and live.engine.num_running == live.engine.num_waiting == 0
        assert (await http.get(url + "/health")).status_code == 200
        assert 'vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3.5-122B-A10B"} 1.0' in (
            await http.get(url + "/metrics")).text
        assert (await http.get(url + "/is_sleeping")).json() == {"is_sleeping": True}
        await http.post(url + "/wake_up")
        answer = await task
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5


async def test_a_second_sleep_and_a_wake_while_awake_change_nothing():
    """v1/executor/abstract.py:400-403 ("Executor is already sleeping.") and :412-415
    ("Executor is not sleeping."): both answer 200 and nothing moves."""
    async with start_sim_pair(dev()) as pair, httpx.AsyncClient(timeout=10) as http:
        url, device = pair.urls["plain"], pair.servers["plain"].saver.device
        awake = await http.post(url + "/wake_up")
        assert awake.json() == {"status": "awake", "tags": None}
        held = device.holding("plain")
        assert (await http.post(url + "/sleep")).status_code == 200
        asleep = device.holding("plain")
        assert asleep < held
        again = await http.post(url + "/sleep?level=2")
        assert again.json() == {"status": "sleeping", "level": 2}
        assert device.holding("plain") == asleep
        metrics = (await http.get(url + "/metrics")).text
        assert 'sleep_state="weights_offloaded"} 1.0' in metrics  # still the first sleep's level
        assert (await http.post(url + "/wake_up")).json()["status"] == "awake"
        assert device.holding("plain") == held


async def test_level_2_loses_the_mtp_draft():
    """vLLM issue #52479 (open): after a level-2 sleep, reload_weights reloads the target only
    (v1/worker/gpu/model_runner.py:586-600): the draft is lost. Level 1 keeps it (the drafter
    is in the weights pool, v1/worker/gpu_worker.py:594-601)."""
    async with start_sim_pair(dev()) as pair, httpx.AsyncClient(timeout=10) as http:
        url, engine = pair.urls["mtp"], pair.servers["mtp"].live.engine
        await http.post(url + "/sleep?level=1")
        await http.post(url + "/wake_up")
        assert not engine.drafts_broken
        await http.post(url + "/sleep?level=2")
        await http.post(url + "/wake_up")
        assert engine.drafts_broken


async def test_a_wake_while_the_other_holds_the_memory_fails_500_and_stays_asleep():
    """The turns shape on vLLM: plain starts, sleeps at level 1, MTP starts on what it left.
    Waking plain while MTP holds the memory fails in cuMemCreate; the engine core answers
    "Call to wake_up method failed: ..." (v1/engine/core.py:1848-1851) as the catch-all 500
    (exception_handling/handlers/exception.py:14-24) and plain is still asleep (the executor's
    tags are cleared only after success, v1/executor/abstract.py:424-435). Once MTP sleeps,
    plain wakes: a turn by sleep mode."""
    async with start_sim_pair(dev(memory="turns")) as pair, httpx.AsyncClient(timeout=10) as http:
        mtp, plain = pair.urls["mtp"], pair.urls["plain"]
        assert (await http.get(plain + "/is_sleeping")).json() == {"is_sleeping": True}
        failed = await http.post(plain + "/wake_up")
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "InternalServerError"
        assert failed.json()["error"]["message"].startswith("Call to wake_up method failed: ")
        assert (await http.get(plain + "/is_sleeping")).json() == {"is_sleeping": True}
        assert (await http.post(mtp + "/sleep")).status_code == 200
        assert (await http.post(plain + "/wake_up")).json()["status"] == "awake"
        answer = await http.post(plain + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert answer.status_code == 200
        assert pair.servers["mtp"].saver.device.free_gib >= 0


async def test_max_num_seqs_above_the_mamba_blocks_refuses_to_start():
    """config/compilation.py:1511-1531: with full CUDA graphs, max_num_seqs above the Mamba
    cache blocks stops the start; below them it is the running cap."""
    with pytest.raises(ValueError, match=r"max_num_seqs \(100000\) exceeds available Mamba cache blocks"):
        async with start_sim_pair(vllm(vllm=VllmOptions(max_num_seqs=100_000))):
            pass
    async with start_sim_pair(vllm(vllm=VllmOptions(max_num_seqs=3))) as pair:
        assert pair.servers["plain"].live.engine.profile.effective_max_running == 3


async def test_a_disconnect_frees_the_request():
    """serve/utils/api_utils.py:53-100 (with_cancellation) and v1/engine/async_llm.py:805-812:
    a client that leaves has its request aborted; there is no abort endpoint."""
    async with start_sim_pair(vllm()) as pair, httpx.AsyncClient(timeout=10) as http:
        url, engine = pair.urls["plain"], pair.servers["plain"].live.engine
        async with http.stream("POST", url + "/v1/chat/completions", json=long()) as stream:
            lines = stream.aiter_lines()
            while "content" not in await anext(lines):
                pass
            assert engine.num_running == 1
        await wait_until(lambda: engine.num_running == 0)
        assert (await http.post(url + "/abort_request", json={"rid": "x"})).status_code == 404


async def test_the_sdks_against_sim_engine_vllm():
    """The openai SDK (chat, completions, responses; a 404 and a mid-stream error raise) and
    the anthropic SDK (messages, stream and not) against the simulated vLLM server."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    async with start_sim_pair(vllm()) as pair:
        url = pair.urls["mtp"]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        chat = await client.chat.completions.create(model="Qwen/Qwen3.5-122B-A10B", messages=CHAT,
                                                    max_tokens=8)
        assert chat.choices[0].message.content and chat.id.startswith("chatcmpl-")
        text = [c.choices[0].text async for c in await client.completions.create(
            model="Qwen/Qwen3.5-122B-A10B", prompt="hi", max_tokens=5, stream=True) if c.choices]
        assert "".join(text)
        response = await client.responses.create(model="Qwen/Qwen3.5-122B-A10B", input="hi",
                                                 max_output_tokens=6)
        assert response.output_text
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=CHAT)
        await pair.servers["mtp"].set_faults(Faults(error_after_chunks=3))
        with pytest.raises(openai.APIError, match="Internal server error"):
            async for _ in await client.chat.completions.create(
                    model="Qwen/Qwen3.5-122B-A10B", messages=CHAT, max_tokens=50, stream=True):
                pass
        await pair.servers["mtp"].clear_faults()
        claude = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
        message = await claude.messages.create(model="Qwen/Qwen3.5-122B-A10B", max_tokens=8,
                                               messages=CHAT)
        assert message.content[0].type == "text"
        async with claude.messages.stream(model="Qwen/Qwen3.5-122B-A10B", max_tokens=8,
                                          messages=CHAT) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
        await client.close()
        await claude.close()


def test_a_sleep_and_a_wake_take_the_modelled_copy_time():
    """What a level-1 sleep and its wake cost (not in vLLM's source: the host buffer allocated
    at each sleep and freed at each wake as device_allocator/cumem.py:265-276, :355-360 do,
    timed with the SGLang probe's link and allocation figures), on the loop's clock."""
    run_on_loop_clock(_a_sleep_and_a_wake_take_the_modelled_copy_time)


async def _a_sleep_and_a_wake_take_the_modelled_copy_time():
    clock = asyncio.get_running_loop().time
    async with start_sim_pair(dev(speed=1)) as pair, \
            httpx.AsyncClient(timeout=60) as http:
        server = pair.servers["mtp"]
        expected_sleep = sleep_cost_s(server.saver.footprint, server.saver.options, 1)
        expected_wake = wake_cost_s(server.saver.footprint, server.saver.options, 1)
        start = clock()
        await http.post(pair.urls["mtp"] + "/sleep?level=1")
        slept = clock() - start
        start = clock()
        await http.post(pair.urls["mtp"] + "/wake_up")
        woke = clock() - start
    assert expected_sleep > 3 * expected_wake > 3  # the host buffer is allocated at every sleep
    assert slept == pytest.approx(expected_sleep, abs=0.05)
    assert woke == pytest.approx(expected_wake, abs=0.05)


async def test_the_gateway_in_front_of_sim_engine_vllm_serves_both_sdks():
    """`demo --engine vllm` (the split pair): the gateway, still on the SGLang engine module,
    relays vLLM's bytes to the openai and anthropic SDKs, passes vLLM's 404 on an unknown name
    through (serve/engine/serving.py:49-83: agents' default names need aliases), and ends with
    nothing in flight; its SGLang-only probes (/v1/loads) find nothing and it routes on its
    own counts."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    from tests.conftest import live_gateway
    from tests.test_gateway_live import settled

    async with start_sim_pair(vllm()) as pair, live_gateway(pair) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=12, stream=True, stream_options={"include_usage": True})]
        assert chunks[0].id.startswith("chatcmpl-") and chunks[-1].usage.completion_tokens == 12
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.chat.completions.create(model="gpt-5-codex", messages=CHAT, max_tokens=5)
        response = await client.responses.create(model=MODEL, input="hi", max_output_tokens=6)
        assert response.output_text and response.status == "incomplete"
        assert response.usage is not None and response.usage.output_tokens == 6
        streamed = [event async for event in await client.responses.create(
            model=MODEL, input="hi", max_output_tokens=6, stream=True)]
        assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
        assert streamed[-1].type == "response.incomplete"
        assert streamed[-1].response.output_text == "".join(
            e.delta for e in streamed if e.type == "response.output_text.delta")
        with pytest.raises(openai.NotFoundError, match="not found"):
            await client.responses.create(model=MODEL, input="hi", previous_response_id="resp_gone")
        claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="x", max_retries=0)
        async with claude.messages.stream(model=MODEL, max_tokens=8, messages=CHAT) as stream:
            final = await stream.get_final_message()
        assert final.id.startswith("chatcmpl-") and final.usage.output_tokens > 0
        with pytest.raises(anthropic.NotFoundError):
            await claude.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=CHAT)
        await settled(gateway, 0)
        await client.close()
        await claude.close()


def test_the_dynamic_schedule_is_vllms_dense_lookup():
    """v1/spec_decode/dynamic/utils.py:13-148: the first range starts at 1, a gap and the tail
    carry the previous k forward, every k is clamped to num_speculative_tokens."""
    assert dense_schedule([[1, 4, 2], [5, 512, 0]], 8, 2) == [0, 2, 2, 2, 2, 0, 0, 0, 0]
    assert dense_schedule([[1, 2, 3], [5, 6, 1]], 8, 2) == [0, 2, 2, 2, 2, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="must start at 1"):
        dense_schedule([[2, 4, 2]], 8, 2)
    with pytest.raises(ValueError, match="non-overlapping"):
        dense_schedule([[1, 4, 2], [4, 8, 1]], 8, 2)


def test_a_scheduled_mtp_server_drafts_by_the_number_of_requests():
    """v1/core/sched/scheduler.py:1709-1714: each step's k is the schedule's at the number of
    scheduled requests; at k = 0 no draft is proposed (the memory stays the MTP server's)."""
    options = vllm(vllm=VllmOptions(num_speculative_tokens=2, draft_schedule=((1, 4, 2), (5, 512, 0))))
    profile = options.resolved_profiles()["mtp"]
    engine = Engine(profile, random.Random(0))

    def decode_steps(requests: int) -> set[int]:
        for i in range(requests):
            engine.submit(EngineRequest(f"{requests}-{i}", [1, 2, 3], 40))
        seen = set()
        while (step := engine.begin_step()) is not None:
            if step.kind == "decode" and len(step.seqs) == requests:
                seen.add(step.num_steps)
            engine.finish_step(step)
        return seen

    assert decode_steps(1) == {2}
    assert decode_steps(6) == {0}
    assert profile.effective_max_running == load_profiles()["mtp"].effective_max_running
