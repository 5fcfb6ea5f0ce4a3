"""A Messages stream continued as chat (gateway/continuation/as_messages.py, through
splice.splicer): each chat delta made the Anthropic events SGLang's adapter makes
(anthropic/serving.py:1146-1280), block indexes going on from the client's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.apis import CHAT, MESSAGES
from gateway.continuation import Relayed, Seam, splicer
from gateway.continuation.events import parsed


def event(value: Any) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


def delta(finish: str | None = None, **fields: Any) -> bytes:
    return event({"id": "c", "choices": [{"index": 0, "delta": fields, "finish_reason": finish}]})


def said(stream: bytes) -> list[tuple[str | None, Any]]:
    return [(name, value) for name, _, value in parsed(stream)]


def start(index: int, block: dict[str, Any]) -> tuple[str, Any]:
    return "content_block_start", {"type": "content_block_start", "index": index,
                                   "content_block": block}


def change(index: int, what: dict[str, Any]) -> tuple[str, Any]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": what}


def stop(index: int) -> tuple[str, Any]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


def call(index: int, *, id: str | None = None, name: str | None = None,
         arguments: str | None = None) -> dict[str, Any]:
    function = {k: v for k, v in (("name", name), ("arguments", arguments)) if v is not None}
    return {"index": index, **({"id": id} if id else {}), "function": function}


def test_thinking_text_and_tool_calls_each_their_block_in_order():
    spliced = splicer(MESSAGES, CHAT, Seam(Relayed(MESSAGES, next_block=1), 2))
    assert said(spliced.feed(delta(reasoning_content="hm"))) == [
        start(1, {"type": "thinking", "thinking": ""}),
        change(1, {"type": "thinking_delta", "thinking": "hm"})]
    assert said(spliced.feed(delta(reasoning_content=" so"))) == [
        change(1, {"type": "thinking_delta", "thinking": " so"})]
    assert said(spliced.feed(delta(content="Hi"))) == [
        stop(1), start(2, {"type": "text", "text": ""}), change(2, {"type": "text_delta", "text": "Hi"})]
    first = call(0, id="call_1", name="f", arguments='{"a"')
    assert said(spliced.feed(delta(tool_calls=[first]))) == [
        stop(2), start(3, {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}),
        change(3, {"type": "input_json_delta", "partial_json": '{"a"'})]
    assert said(spliced.feed(delta(tool_calls=[call(0, arguments=": 1}")]))) == [
        change(3, {"type": "input_json_delta", "partial_json": ": 1}"})]
    second = call(1, id="call_2", name="g")  # a tool_use block after a tool_use block: a new one
    assert said(spliced.feed(delta(tool_calls=[second]))) == [
        stop(3), start(4, {"type": "tool_use", "id": "call_2", "name": "g", "input": {}})]
    spliced.feed(event({"id": "c", "choices": [], "usage": {"completion_tokens": 9}}))
    assert said(spliced.feed(delta("tool_calls") + b"data: [DONE]\n\n")) == [
        stop(4), ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                                    "usage": {"output_tokens": 11}}),
        ("message_stop", {"type": "message_stop"})]


def test_a_tool_call_without_an_id_gets_one_and_arguments_outside_its_block_are_dropped():
    spliced = splicer(MESSAGES, CHAT, Seam(Relayed(MESSAGES), 0))
    assert spliced.feed(delta(tool_calls=[call(0, arguments="{}")])) == b""
    (name, value), = said(spliced.feed(delta(tool_calls=[call(0, name="f")])))
    assert value["content_block"]["id"].startswith("toolu_") and len(value["content_block"]["id"]) > 10


@pytest.mark.parametrize(("finish", "reason"), [
    (None, "end_turn"), ("stop", "end_turn"), ("length", "max_tokens"),
    ("tool_calls", "tool_use"), ("abort", "end_turn")])
def test_the_stop_reason_is_sglangs_for_the_finish(finish: str | None, reason: str):
    spliced = splicer(MESSAGES, CHAT, Seam(Relayed(MESSAGES), 0))
    spliced.feed(delta(finish, content="x"))
    end = said(spliced.feed(b"data: [DONE]\n\n"))
    assert end[-2] == ("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason},
                                         "usage": {"output_tokens": 0}})


def test_an_error_closes_the_open_block_and_unknown_codes_are_api_errors():
    spliced = splicer(MESSAGES, CHAT, Seam(Relayed(MESSAGES, open_block=(2, "text"), next_block=3), 0))
    assert said(spliced.feed(event({"error": {"message": "boom", "code": 500}}))) == [
        stop(2), ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}}),
        ("message_stop", {"type": "message_stop"})]


def test_one_delta_with_reasoning_text_and_two_tool_calls_says_each():
    spliced = splicer(MESSAGES, CHAT, Seam(Relayed(MESSAGES), 0))
    calls = [call(0, id="call_1", name="f"), call(1, id="call_2", name="g")]
    assert said(spliced.feed(delta(reasoning_content="hm", tool_calls=calls, content="Hi"))) == [
        start(0, {"type": "thinking", "thinking": ""}),
        change(0, {"type": "thinking_delta", "thinking": "hm"}),
        stop(0), start(1, {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}),
        stop(1), start(2, {"type": "tool_use", "id": "call_2", "name": "g", "input": {}}),
        stop(2), start(3, {"type": "text", "text": ""}), change(3, {"type": "text_delta", "text": "Hi"})]


def test_a_message_cut_inside_its_thinking_goes_on_in_that_block():
    spliced = splicer(MESSAGES, CHAT, Seam(Relayed(MESSAGES, open_block=(0, "thinking"),
                                                   next_block=1), 0))
    assert said(spliced.feed(delta(reasoning_content="hm"))) == [
        change(0, {"type": "thinking_delta", "thinking": "hm"})]
