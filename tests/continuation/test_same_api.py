"""Chat, completions and /generate continued as themselves (gateway/continuation/same_api.py,
through splice.splicer): each event of the continuation as the client gets it. Whole recorded
streams spliced: test_splice.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.apis import CHAT, COMPLETIONS, GENERATE
from gateway.continuation import Relayed, Seam, splicer
from gateway.continuation.events import DONE

CHAT_ID = "chatcmpl-first"


def event(value: Any) -> bytes:
    return b"data: " + json.dumps(value).encode() + b"\n\n"


def out(data: bytes) -> Any:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n"), data
    return json.loads(data[6:])


def chat(before: int = 0, *, include_usage: bool = False, **relayed: Any):
    return splicer(CHAT, CHAT, Seam(Relayed(CHAT, **relayed), before, include_usage))


def chunk(delta: dict[str, Any], finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-second", "created": 200, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **fields}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, GENERATE])
def test_the_end_an_error_and_what_is_not_json_pass_on_as_they_are(path: str):
    spliced = splicer(path, path, Seam(Relayed(path, id="first"), 3))
    assert spliced.feed(b"data: [DONE]\n\n") == DONE
    error = {"error": {"message": "The request queue is full.", "code": 503}}
    assert spliced.feed(event(error)) == b'data: {"error":{"message":"The request queue is full.",' \
                                         b'"code":503}}\n\n'
    assert spliced.feed(b"data: not json\n\n") == b"data: not json\n\n"


def test_chat_chunks_go_on_under_the_streams_first_id_and_time():
    spliced = chat(id=CHAT_ID, created=100)
    assert out(spliced.feed(event(chunk({"content": "x"})))) == {
        **chunk({"content": "x"}), "id": CHAT_ID, "created": 100}
    unknown = chat()  # the client's part carried neither: the continuation's own stay
    assert out(unknown.feed(event(chunk({"content": "x"})))) == chunk({"content": "x"})


@pytest.mark.parametrize(("delta", "finish", "kept"), [
    ({"role": "assistant", "content": ""}, None, False),  # the continuation's own start
    ({"role": "assistant"}, None, False),
    ({"role": "assistant", "content": "x"}, None, True),
    ({"role": "assistant", "reasoning_content": "x"}, None, True),
    ({"role": "assistant", "tool_calls": [{"index": 0}]}, None, True),
    ({"role": "assistant"}, "stop", True),
    ({"content": "x"}, None, True),
])
def test_only_the_continuations_role_chunk_is_dropped(delta: dict[str, Any], finish: str | None,
                                                     kept: bool):
    spliced = chat(id=CHAT_ID)
    assert bool(spliced.feed(event(chunk(delta, finish)))) is kept


def test_the_usage_counts_the_whole_answer():
    usage = {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27,
             "prompt_tokens_details": {"cached_tokens": 18}}
    spliced = chat(5, include_usage=True, id=CHAT_ID)
    assert out(spliced.feed(event({"id": "x", "choices": [], "usage": usage})))["usage"] == {
        "prompt_tokens": 15, "completion_tokens": 12, "total_tokens": 27,
        "prompt_tokens_details": {"cached_tokens": 15}}  # no more cached than the prompt
    usage["prompt_tokens_details"] = {"cached_tokens": 4}
    assert out(spliced.feed(event(chunk({}, "stop", usage=usage))))["usage"][
        "prompt_tokens_details"] == {"cached_tokens": 4}


def test_a_usage_without_its_counts_counts_what_is_known():
    spliced = chat(0, include_usage=True)
    assert out(spliced.feed(event({"choices": [], "usage": {"total_tokens": 1}})))["usage"] == {
        "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    prefix_longer = chat(5, include_usage=True)
    assert out(prefix_longer.feed(event({"choices": [], "usage": {"prompt_tokens": 3}})))[
        "usage"] == {"prompt_tokens": 0, "completion_tokens": 5, "total_tokens": 5}


def test_the_usage_chunk_is_dropped_unless_asked_for_but_a_chunks_usage_is_counted():
    spliced = chat(5, include_usage=False)
    assert spliced.feed(event({"choices": [], "usage": {"prompt_tokens": 20}})) == b""
    usage = out(spliced.feed(event(chunk({}, "stop", usage={"prompt_tokens": 20}))))["usage"]
    assert usage["prompt_tokens"] == 15


def generate(before: int, **relayed: Any):
    return splicer(GENERATE, GENERATE, Seam(Relayed(GENERATE, **relayed), before))


def test_a_generate_chunk_is_cumulative_under_the_first_id_and_prompt():
    spliced = generate(2, id="g1", text="Hello", output_ids=[1, 2], prompt_tokens=9)
    second = {"text": " world", "output_ids": [3],
              "meta_info": {"id": "g2", "prompt_tokens": 11, "completion_tokens": 1,
                            "finish_reason": None}}
    assert out(spliced.feed(event(second))) == {
        "text": "Hello world", "output_ids": [1, 2, 3],
        "meta_info": {"id": "g1", "prompt_tokens": 9, "completion_tokens": 3, "finish_reason": None}}


def test_a_generate_chunk_without_text_or_first_id_keeps_what_it_has():
    spliced = generate(2, text="Hello")
    value = out(spliced.feed(event({"text": None, "meta_info": {"id": "g2", "prompt_tokens": 11}})))
    assert value == {"text": "Hello", "output_ids": [],
                     "meta_info": {"id": "g2", "prompt_tokens": 11, "completion_tokens": 2}}


def test_a_generate_cut_by_its_length_says_the_whole_length():
    spliced = generate(2, id="g1")
    length = {"type": "length", "length": 1}
    meta = out(spliced.feed(event({"meta_info": {"completion_tokens": 1, "finish_reason": length}})))[
        "meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    stop = {"type": "stop", "matched": 2}
    meta = out(spliced.feed(event({"meta_info": {"completion_tokens": 1, "finish_reason": stop}})))[
        "meta_info"]
    assert meta["finish_reason"] == stop


def test_a_chunk_whose_choices_are_not_objects_goes_on_under_the_first_id():
    assert out(chat(id=CHAT_ID).feed(event({"id": "x", "choices": [5]}))) == {
        "id": CHAT_ID, "choices": [5]}
