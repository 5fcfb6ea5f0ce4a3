"""What the relay has sent of a stream, read back from the events (recorded SGLang bytes)."""

from __future__ import annotations

from gateway.continuation import read
from tests.continuation.recorded import head, payloads, recorded


def _chat_text(stream: bytes) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in payloads(stream)
                   if isinstance(c, dict) and c.get("choices"))


def test_a_chat_stream_cut_after_its_fourth_event_is_its_text_so_far():
    relayed = read("/v1/chat/completions", head("chat", 4))
    first = payloads(recorded("chat"))[0]
    assert relayed.id == first["id"] and relayed.created == first["created"]
    assert relayed.text == _chat_text(head("chat", 4)) and relayed.text
    assert not relayed.finished and not relayed.tool_calls and not relayed.reasoning


def test_a_whole_stream_is_finished():
    assert read("/v1/chat/completions", recorded("chat")).finished
    assert read("/v1/messages", recorded("messages")).finished
    assert read("/v1/responses", recorded("responses")).finished
    assert read("/generate", recorded("generate")).finished


def test_generate_keeps_sglangs_own_counts():
    relayed = read("/generate", head("generate", 3))
    last = payloads(head("generate", 3))[-1]
    assert relayed.text == last["text"] and relayed.output_ids == last["output_ids"]
    assert relayed.completion_tokens == last["meta_info"]["completion_tokens"] > 0
    assert relayed.prompt_tokens == last["meta_info"]["prompt_tokens"]


def test_messages_know_the_open_block_and_the_input_tokens():
    relayed = read("/v1/messages", head("messages", 4))
    assert relayed.open_block == (0, "text") and relayed.next_block == 1
    assert relayed.input_tokens == payloads(recorded("messages"))[0]["message"]["usage"]["input_tokens"]
    assert relayed.id.startswith("msg_") and relayed.text


def test_responses_know_the_open_item_and_the_last_sequence_number():
    relayed = read("/v1/responses", head("responses", 6))
    assert relayed.open_item == 0 and relayed.sequence == 5
    assert relayed.items[0]["type"] == "message" and relayed.id.startswith("resp_")
    assert relayed.text and relayed.response["status"] == "in_progress"


def test_tool_calls_and_reasoning_are_seen():
    assert read("/v1/chat/completions", head("chat_tool", 3)).tool_calls
    assert read("/v1/chat/completions", head("chat_thinking", 3)).reasoning
    assert read("/v1/messages", head("messages_tool", 3)).tool_calls
