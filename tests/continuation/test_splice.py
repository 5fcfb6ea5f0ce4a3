"""The continuation's events spliced onto the client's stream: one stream, as one answer.

Part one is a recorded stream cut after a few events (what went out before its server
failed); part two is a recorded continuation (a chat request with continue_final_message, a
longer prompt, a longer /generate text). The client's whole stream is read back as a client
reads it."""

from __future__ import annotations

from typing import Any

from gateway.apis.sse import split_events
from gateway.continuation import Seam, read, splicer
from tests.continuation.recorded import head, payloads, recorded

CHAT = "/v1/chat/completions"


def _splice(path: str, first: str, events: int, second: str, before: int,
            continued_as: str | None = None, **seam: Any) -> tuple[bytes, bytes]:
    part1 = head(first, events)
    spliced = splicer(path, continued_as or path, Seam(read(path, part1), before, **seam))
    return part1, spliced.feed(recorded(second))


def _chat_text(chunks: list[Any]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if isinstance(c, dict) and c.get("choices"))


def test_a_continued_chat_is_one_stream_with_the_whole_usage():
    part1, part2 = _splice(CHAT, "chat", 4, "chat_continued", 5, include_usage=True)
    chunks = payloads(part1 + part2)
    first, second = payloads(part1), payloads(recorded("chat_continued"))
    assert {c["id"] for c in chunks if c != "[DONE]"} == {first[0]["id"]}
    assert {c["created"] for c in chunks if c != "[DONE]"} == {first[0]["created"]}
    roles = [c for c in chunks if c != "[DONE]" and c["choices"] and c["choices"][0]["delta"].get("role")]
    assert len(roles) == 1
    assert _chat_text(chunks) == _chat_text(first) + _chat_text(second)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c != "[DONE]" and c["choices"]
                and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1
    usage = chunks[-2]["usage"]
    sent = second[-2]["usage"]  # prompt + the 5-token prefix, completion of part two
    assert usage["prompt_tokens"] == sent["prompt_tokens"] - 5
    assert usage["completion_tokens"] == sent["completion_tokens"] + 5
    assert usage["total_tokens"] == sent["total_tokens"] and chunks[-1] == "[DONE]"


def test_the_usage_chunk_only_when_the_client_asked():
    _, part2 = _splice(CHAT, "chat", 4, "chat_continued", 5, include_usage=False)
    assert not [c for c in payloads(part2) if c != "[DONE]" and c.get("usage")]
    assert payloads(part2)[-1] == "[DONE]"


def test_a_continued_completion_keeps_its_id_and_counts_both_parts():
    part1, part2 = _splice("/v1/completions", "completions", 3, "completions_continued", 2,
                           include_usage=True)
    chunks = [c for c in payloads(part1 + part2) if c != "[DONE]"]
    assert len({c["id"] for c in chunks}) == 1
    second = payloads(recorded("completions_continued"))
    assert chunks[-1]["usage"]["completion_tokens"] == second[-2]["usage"]["completion_tokens"] + 2


def test_a_continued_generate_is_cumulative_over_both_parts():
    part1, part2 = _splice("/generate", "generate", 3, "generate_continued",
                           payloads(head("generate", 3))[-1]["meta_info"]["completion_tokens"])
    first, second = payloads(part1)[-1], payloads(recorded("generate_continued"))[-2]
    last = payloads(part2)[-2]
    assert last["text"] == first["text"] + second["text"]
    assert last["output_ids"] == first["output_ids"] + second["output_ids"]
    meta = last["meta_info"]
    assert meta["id"] == first["meta_info"]["id"]
    assert meta["prompt_tokens"] == first["meta_info"]["prompt_tokens"]
    assert meta["completion_tokens"] == (first["meta_info"]["completion_tokens"]
                                         + second["meta_info"]["completion_tokens"])
    assert payloads(part2)[-1] == "[DONE]"


def _anthropic(stream: bytes) -> list[dict[str, Any]]:
    return [p for p in payloads(stream) if p != "[DONE]"]


def test_a_continued_message_is_one_message_with_its_blocks_indexed_on():
    part1, part2 = _splice("/v1/messages", "messages", 4, "chat_continued", 3, continued_as=CHAT)
    events = _anthropic(part1 + part2)
    kinds = [e["type"] for e in events]
    assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert {e["index"] for e in events if "index" in e} == {0}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == read("/v1/messages", part1).text + _chat_text(payloads(recorded("chat_continued")))
    delta = next(e for e in events if e["type"] == "message_delta")
    completion = payloads(recorded("chat_continued"))[-2]["usage"]["completion_tokens"]
    assert delta["usage"] == {"output_tokens": completion + 3}
    assert delta["delta"]["stop_reason"] == "max_tokens"  # the recorded continuation hit its limit
    assert kinds[-2:] == ["message_delta", "message_stop"]


def test_a_message_cut_between_blocks_opens_the_next_index():
    part1 = head("messages", 4) + (b'event: content_block_stop\ndata: {"type":"content_block_stop",'
                                   b'"index":0}\n\n')
    spliced = splicer("/v1/messages", CHAT, Seam(read("/v1/messages", part1), 3))
    events = _anthropic(spliced.feed(recorded("chat_continued")))
    assert events[0] == {"type": "content_block_start", "index": 1,
                         "content_block": {"type": "text", "text": ""}}


def test_a_continued_response_goes_on_in_its_item_and_sequence():
    part1, part2 = _splice("/v1/responses", "responses", 6, "chat_continued", 4, continued_as=CHAT)
    events = _anthropic(part1 + part2)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert len(item_ids) == 1
    final = events[-1]
    assert final["type"] == "response.incomplete"  # the continuation reached its limit
    response = final["response"]
    assert response["id"] == events[0]["response"]["id"]
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    text = read("/v1/responses", part1).text + _chat_text(payloads(recorded("chat_continued")))
    assert response["output"][0]["content"][0]["text"] == text
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == text
    usage = payloads(recorded("chat_continued"))[-2]["usage"]
    assert response["usage"]["output_tokens"] == usage["completion_tokens"] + 4
    assert response["usage"]["input_tokens"] == usage["prompt_tokens"] - 4
    assert len(split_events(part2)) == len(events) - 6


def test_an_error_in_the_continuation_ends_the_stream_in_the_clients_shape():
    error = b'data: {"error": {"message": "The request queue is full.", "code": 503}}\n\n'
    seam = Seam(read("/v1/messages", head("messages", 4)), 3)
    events = _anthropic(splicer("/v1/messages", CHAT, seam).feed(error))
    assert [e["type"] for e in events] == ["content_block_stop", "error", "message_stop"]
    assert events[1]["error"]["type"] == "overloaded_error"
    seam = Seam(read("/v1/responses", head("responses", 6)), 3)
    events = _anthropic(splicer("/v1/responses", CHAT, seam).feed(error))
    assert events[-1]["type"] == "response.failed" and events[0]["sequence_number"] == 6
