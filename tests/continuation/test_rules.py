"""Each stream that cannot be continued faithfully, and why (SGLang 0.5.23's source in
gateway/continuation/rules.py and docs/compat.md)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.continuation import Relayed, read, refusal
from gateway.continuation import rules as r
from tests.continuation.recorded import head, recorded

CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSG, RESP = "/v1/messages", "/v1/responses"
_USER = [{"role": "user", "content": "hello there"}]


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": _USER, "stream": True, **extra}


def test_a_plain_stream_of_each_api_can_be_continued():
    assert refusal(CHAT, _chat(max_tokens=12), read(CHAT, head("chat", 4))) is None
    assert refusal(CMPL, {"prompt": "once upon"}, read(CMPL, head("completions", 3))) is None
    assert refusal(GEN, {"text": "once upon"}, read(GEN, head("generate", 3))) is None
    messages = {"model": "m", "max_tokens": 12, "messages": _USER}
    assert refusal(MSG, messages, read(MSG, head("messages", 4))) is None
    assert refusal(RESP, {"input": "hello there"}, read(RESP, head("responses", 6))) is None


@pytest.mark.parametrize(("path", "body", "reason"), [
    (CHAT, _chat(n=2), r.SAMPLES),
    (GEN, {"text": "x", "sampling_params": {"n": 3}}, r.SAMPLES),
    (CMPL, {"prompt": ["a", "b"]}, r.BATCH),
    (GEN, {"text": ["a", "b"]}, r.BATCH),
    (CHAT, _chat(logprobs=True), r.LOGPROBS),
    (CMPL, {"prompt": "a", "logprobs": 0}, r.LOGPROBS),
    (GEN, {"text": "a", "return_logprob": True}, r.LOGPROBS),
    (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), r.GRAMMAR),
    (CHAT, _chat(regex="[a-z]+"), r.GRAMMAR),
    (CHAT, _chat(tool_choice="required"), r.GRAMMAR),
    (GEN, {"text": "a", "sampling_params": {"json_schema": "{}"}}, r.GRAMMAR),
    (MSG, {"messages": _USER, "tool_choice": {"type": "any"}}, r.GRAMMAR),
    (RESP, {"input": "a", "text": {"format": {"type": "json_object"}}}, r.GRAMMAR),
    (CHAT, _chat(stop_regex="x+"), r.STOP_REGEX),
    (CMPL, {"prompt": "a", "echo": True}, r.ECHO),
    (RESP, {"input": "a", "previous_response_id": "resp_1"}, r.STORED_HISTORY),
    (CHAT, _chat(messages=[*_USER, {"role": "assistant", "content": "so"}]), r.ASSISTANT_LAST),
    (MSG, {"messages": [*_USER, {"role": "assistant", "content": "so"}]}, r.ASSISTANT_LAST),
    (MSG, {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, r.SHAPE),
    (MSG, {"messages": _USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, r.SHAPE),
    (RESP, {"input": "a", "tools": [{"type": "function", "name": "f"}]}, r.SHAPE),
    (CMPL, {"prompt": "a", "best_of": 2}, r.SAMPLES),
    (GEN, {"input_ids": [[1, 2], [3]]}, r.BATCH),
    (CHAT, _chat(top_logprobs=2), r.LOGPROBS),
    (RESP, {"input": "a", "top_logprobs": 2}, r.LOGPROBS),
    (RESP, {"input": "a", "include": ["message.output_text.logprobs"]}, r.LOGPROBS),
    (MSG, {"messages": _USER, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     r.GRAMMAR),
    (MSG, {"messages": _USER, "tool_choice": {"type": "tool", "name": "f"}}, r.GRAMMAR),
    (RESP, {"input": "a", "tool_choice": "required"}, r.GRAMMAR),
    (RESP, {"input": "a", "tool_choice": {"type": "function", "name": "f"}}, r.GRAMMAR),
    (RESP, {"input": "a", "conversation": "conv_1"}, r.STORED_HISTORY),
    (RESP, {"input": [*_USER, {"role": "assistant", "content": "so"}]}, r.ASSISTANT_LAST),
    (MSG, {"messages": _USER, "output_config": {"effort": "high"}}, r.SHAPE),  # no format: no grammar
])
def test_what_the_request_asks_decides(path: str, body: dict[str, Any], reason: str):
    clean = read(path, b"")
    assert refusal(path, body, clean) == reason


@pytest.mark.parametrize(("path", "body"), [
    (GEN, {"input_ids": [1, 2, 3]}),  # one prompt of token ids, not a batch
    (CHAT, _chat(response_format={"type": "text"})),
    (RESP, {"input": "a", "text": {"format": {"type": "text"}}}),
    (RESP, {"input": "a", "tool_choice": "auto"}),
    (CHAT, _chat(messages=[*_USER, {"role": "assistant", "content": "so"}],
                 continue_final_message=True)),  # the client's own prefix, continued as such
    (CHAT, _chat(stop=[7, ""])),  # only non-empty strings are stop strings
])
def test_what_the_request_allows_is_continued(path: str, body: dict[str, Any]):
    assert refusal(path, body, read(path, b"")) is None


def test_a_tool_call_begun_is_not_continued():
    """The prefix is the final message's content only (serving_chat.py:540-545)."""
    assert refusal(CHAT, _chat(), read(CHAT, head("chat_tool", 3))) == r.TOOL_CALL
    assert refusal(MSG, {"messages": _USER}, read(MSG, head("messages_tool", 3))) == r.TOOL_CALL


def test_reasoning_is_not_continued():
    assert refusal(CHAT, _chat(), read(CHAT, head("chat_thinking", 3))) == r.REASONING


def test_a_stream_that_finished_or_failed_is_not_continued():
    assert refusal(CHAT, _chat(), read(CHAT, recorded("chat"))) == r.FINISHED
    error = b'data: {"error": {"message": "boom", "code": 503}}\n\n'
    assert refusal(CHAT, _chat(), read(CHAT, head("chat", 2) + error)) == r.ERRORED


def test_a_stop_string_that_may_span_the_seam_is_not_continued():
    """SGLang matches stop strings in the output only (schedule_batch.py:1819-1828)."""
    relayed = read(CHAT, head("chat", 4))
    tail = relayed.text[-3:]
    assert refusal(CHAT, _chat(stop=[tail + "zz"]), relayed) == r.STOP_AT_SEAM
    assert refusal(CHAT, _chat(stop=["zz" + tail]), relayed) is None  # cannot begin before the seam
    assert refusal(MSG, {"messages": _USER, "stop_sequences": [tail[-1] + "q"]},
                   Relayed(MSG, text=relayed.text)) == r.STOP_AT_SEAM
