"""A Responses stream continued as chat (gateway/continuation/as_responses.py, through
splice.splicer): the chat deltas made Responses events, sequence numbers, output indexes and
the open message item going on from the client's; one final event with the whole response."""

from __future__ import annotations

import json
from typing import Any

from gateway.apis import CHAT, RESPONSES
from gateway.apis.sse import split_events
from gateway.continuation import Relayed, Seam, splicer
from gateway.continuation.events import parsed

RESPONSE = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "m"}


def event(value: Any) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


def delta(finish: str | None = None, **fields: Any) -> bytes:
    return event({"id": "c", "choices": [{"index": 0, "delta": fields, "finish_reason": finish}]})


def said(stream: bytes) -> list[Any]:
    """Each event's payload; each event is a whole named event of its own."""
    assert all(e.startswith(b"event: response.") for e in split_events(stream)), stream
    return [value for _, _, value in parsed(stream)]


def part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def test_text_after_the_clients_items_opens_a_message_and_the_end_carries_it_whole():
    before = [{"id": "fc_1", "type": "function_call", "status": "completed"}]
    spliced = splicer(RESPONSES, CHAT, Seam(Relayed(RESPONSES, response=RESPONSE, sequence=4,
                                                    items=before), 2))
    opened = said(spliced.feed(delta(content="Hi")))
    item = opened[0]["item"]
    assert item == {"id": item["id"], "content": [], "role": "assistant", "status": "in_progress",
                    "type": "message", "phase": "final_answer"} and item["id"].startswith("msg_")
    at = {"item_id": item["id"], "output_index": 1, "content_index": 0}
    assert opened == [
        {"type": "response.output_item.added", "output_index": 1, "item": item, "sequence_number": 5},
        {"type": "response.content_part.added", **at, "part": part(""), "sequence_number": 6},
        {"type": "response.output_text.delta", **at, "delta": "Hi", "logprobs": [],
         "sequence_number": 7}]
    assert said(spliced.feed(delta(content=""))) == []
    usage = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
             "prompt_tokens_details": {"cached_tokens": 3}, "reasoning_tokens": 1}
    spliced.feed(event({"id": "c", "choices": [], "usage": usage}))
    done = {**item, "content": [part("Hi")], "status": "completed"}
    assert said(spliced.feed(delta("stop") + b"data: [DONE]\n\n")) == [
        {"type": "response.output_text.done", **at, "text": "Hi", "logprobs": [], "sequence_number": 8},
        {"type": "response.content_part.done", **at, "part": part("Hi"), "sequence_number": 9},
        {"type": "response.output_item.done", "output_index": 1, "item": done, "sequence_number": 10},
        {"type": "response.completed", "sequence_number": 11, "response": {
            **RESPONSE, "status": "completed", "output": [*before, done], "incomplete_details": None,
            "usage": {"input_tokens": 18, "input_tokens_details": {"cached_tokens": 3,
                                                                   "cache_write_tokens": 0},
                      "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 1},
                      "total_tokens": 25}}}]


def open_message() -> Relayed:
    item = {"id": "msg_0", "content": [], "role": "assistant", "status": "in_progress",
            "type": "message"}
    return Relayed(RESPONSES, response=RESPONSE, sequence=7, items=[item], open_item=0, text="Hel")


def test_the_open_message_goes_on_and_a_length_finish_is_incomplete():
    spliced = splicer(RESPONSES, CHAT, Seam(open_message(), 3))
    at = {"item_id": "msg_0", "output_index": 0, "content_index": 0}
    assert said(spliced.feed(delta(content="lo"))) == [
        {"type": "response.output_text.delta", **at, "delta": "lo", "logprobs": [],
         "sequence_number": 8}]
    end = said(spliced.feed(delta("length") + b"data: [DONE]\n\n"))
    assert end[0] == {"type": "response.output_text.done", **at, "text": "Hello", "logprobs": [],
                      "sequence_number": 9}
    assert end[-1]["type"] == "response.incomplete" and end[-1]["sequence_number"] == 12
    response = end[-1]["response"]
    assert response["status"] == "incomplete" and "usage" not in response
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["content"] == [part("Hello")]


def test_an_error_closes_the_open_message_and_fails_the_response():
    spliced = splicer(RESPONSES, CHAT, Seam(open_message(), 0))
    end = said(spliced.feed(event({"error": {"message": "boom", "code": 503}})))
    assert [e["type"] for e in end] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.failed"]
    assert end[-1] == {"type": "response.failed", "sequence_number": 11, "response": {
        **RESPONSE, "status": "failed",
        "output": [{**open_message().items[0], "content": [part("Hel")], "status": "completed"}],
        "error": {"code": "server_error", "message": "boom"}}}


def test_an_error_with_no_open_message_is_the_failed_response_alone():
    spliced = splicer(RESPONSES, CHAT, Seam(Relayed(RESPONSES, response=RESPONSE, sequence=2), 0))
    assert said(spliced.feed(event({"error": {"message": "boom"}}))) == [
        {"type": "response.failed", "sequence_number": 3, "response": {
            **RESPONSE, "status": "failed", "output": [],
            "error": {"code": "server_error", "message": "boom"}}}]


def test_a_usage_without_details_counts_no_cached_and_no_reasoning_tokens():
    for usage in ({"prompt_tokens": 4, "completion_tokens": 1},
                  {"prompt_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": {}}):
        spliced = splicer(RESPONSES, CHAT, Seam(Relayed(RESPONSES, response=RESPONSE), 0))
        spliced.feed(event({"id": "c", "choices": [], "usage": usage}))
        response = said(spliced.feed(b"data: [DONE]\n\n"))[-1]["response"]
        assert response["usage"] == {
            "input_tokens": 4, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}
