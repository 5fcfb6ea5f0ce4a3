"""What every splicer shares (gateway/continuation/seam.py), seen through the splicers that
translate a chat continuation (Messages, Responses): what is no chunk, a chunk of usage alone,
an error of either shape. The usage's arithmetic: test_same_api.py."""

from __future__ import annotations

import json
from typing import Any

from gateway.apis import CHAT, MESSAGES, RESPONSES
from gateway.continuation import Relayed, Seam, splicer
from gateway.continuation.events import named_event


def event(value: Any) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


def messages(before: int = 0):
    return splicer(MESSAGES, CHAT, Seam(Relayed(MESSAGES, id="msg_1"), before))


def stop() -> bytes:
    return named_event("message_stop", {"type": "message_stop"})


def test_what_is_not_a_json_object_adds_nothing():
    for spliced in (messages(), splicer(RESPONSES, CHAT, Seam(Relayed(RESPONSES), 0))):
        assert spliced.feed(b"data: not json\n\ndata: [1, 2]\n\n") == b""


def test_a_chunk_of_usage_alone_is_counted_at_the_end():
    spliced = messages(3)
    assert spliced.feed(event({"id": "x", "usage": {"completion_tokens": 7}})) == b""
    assert spliced.feed(b"data: [DONE]\n\n") == named_event("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": 10}}) + stop()


def test_the_first_text_opens_a_block_and_carries_its_delta_in_one_piece():
    assert messages().feed(event({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})) == (
        named_event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
        + named_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": "Hi"}}))


def test_an_error_of_either_shape_ends_the_stream_with_its_message_or_a_default():
    said = messages().feed(event({"error": {"message": "The request queue is full.", "code": 503}}))
    assert said == named_event("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "The request queue is full."}}) + stop()
    bare = messages().feed(event({"error": "boom"}))
    assert bare == named_event("error", {"type": "error", "error": {
        "type": "api_error", "message": "Upstream error"}}) + stop()


def test_a_chunk_that_carries_an_error_field_beside_its_choices_is_a_chunk():
    chunk = {"id": "c", "error": None, "choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    said = messages().feed(event(chunk))
    assert b"event: content_block_delta" in said and b"event: error" not in said
