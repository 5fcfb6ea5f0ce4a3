"""The request that continues a stream on the next server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.continuation import continuation, read
from gateway.continuation.convert import Unconvertible, messages_as_chat, responses_as_chat
from tests.continuation.recorded import head

CHAT = "/v1/chat/completions"
_USER = [{"role": "user", "content": "hello there"}]


def _sent(path: str, body: dict[str, Any], name: str, events: int, before: int,
          **extra: Any) -> tuple[str, dict[str, Any], str]:
    relayed = read(path, head(name, events))
    made = continuation(path, body, relayed, before, "rid-2", **extra)
    return made.path, json.loads(made.body), relayed.text


def test_chat_continues_the_final_assistant_message_with_the_limit_less_what_was_generated():
    body = {"model": "m", "messages": _USER, "max_tokens": 12, "stream": True, "rid": "rid-1",
            "stop": ["END"], "min_tokens": 2}
    path, sent, text = _sent(CHAT, body, "chat", 4, 5)
    assert path == CHAT and sent["messages"] == [*_USER, {"role": "assistant", "content": text}]
    assert sent["continue_final_message"] is True  # without it the message becomes a user one
    assert sent["max_tokens"] == 7 and sent["min_tokens"] == 0 and sent["stop"] == ["END"]
    assert sent["rid"] == "rid-2" and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}


def test_a_clients_own_prefill_goes_on():
    prefill = {"role": "assistant", "content": "Sure:"}
    body = {"messages": [*_USER, prefill], "continue_final_message": True,
            "max_completion_tokens": 12}
    _, sent, text = _sent(CHAT, body, "chat", 4, 5)
    assert sent["messages"][-1] == {"role": "assistant", "content": "Sure:" + text}
    assert sent["max_completion_tokens"] == 7


def test_completions_append_the_text_to_the_prompt():
    _, sent, text = _sent("/v1/completions", {"prompt": "once upon", "max_tokens": 12},
                          "completions", 3, 2)
    assert sent["prompt"] == "once upon" + text and sent["max_tokens"] == 10
    _, ids, _ = _sent("/v1/completions", {"prompt": [1, 2], "max_tokens": 12}, "completions", 3,
                      2, prefix_ids=[7, 8])
    assert ids["prompt"] == [1, 2, 7, 8]
    with pytest.raises(Unconvertible):
        _sent("/v1/completions", {"prompt": [1, 2]}, "completions", 3, 2)


def test_generate_appends_sglangs_own_output_and_counts_its_tokens():
    relayed = read("/generate", head("generate", 3))
    made = continuation("/generate", {"text": "once upon", "sampling_params": {}}, relayed, 0, "r")
    sent = json.loads(made.body)
    assert sent["text"] == "once upon" + relayed.text and sent["stream"] is True
    assert sent["sampling_params"]["max_new_tokens"] == 128 - relayed.completion_tokens
    ids = continuation("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 20}},
                       relayed, 0, "r")
    assert json.loads(ids.body)["input_ids"] == [5, 6, *relayed.output_ids]


def test_messages_continue_as_chat_as_sglangs_adapter_converts_them():
    body = {"model": "m", "max_tokens": 12, "system": [{"type": "text", "text": "be brief"}],
            "stop_sequences": ["END"], "temperature": 0.5,
            "messages": [
                {"role": "user", "content": "read it"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "reading"},
                    {"type": "tool_use", "id": "call_1", "name": "read", "input": {"p": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "42"}]}],
            "tools": [{"name": "read", "input_schema": {"type": "object"}},
                      {"type": "web_search_20250305", "name": "web_search"}]}
    path, sent, text = _sent("/v1/messages", body, "messages", 4, 3)
    assert path == CHAT and sent["continue_final_message"] is True
    assert sent["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": "reading", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "read", "arguments": '{"p": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": text}]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "read", "description": "", "parameters": {"type": "object"}}}]
    assert sent["tool_choice"] == "auto" and sent["stop"] == ["END"] and sent["max_tokens"] == 9
    assert sent["temperature"] == 0.5


def test_responses_continue_as_chat():
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "instructions": "be brief", "max_output_tokens": 12}
    path, sent, text = _sent("/v1/responses", body, "responses", 6, 2)
    assert path == CHAT and sent["max_tokens"] == 10 and sent["tool_choice"] == "none"
    assert sent["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                {"role": "assistant", "content": text}]
    assert responses_as_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_shapes_the_conversion_does_not_cover_are_refused():
    with pytest.raises(Unconvertible):
        messages_as_chat({"messages": [{"role": "user", "content": [{"type": "document"}]}]})
    with pytest.raises(Unconvertible):
        responses_as_chat({"input": [{"type": "function_call", "name": "f"}]})
