"""What has been relayed of a stream, read from the events the client got.

The relay keeps a stream's events as the bytes it sent (one list append per chunk); only when
a continuation is wanted are they parsed, here. A stream that moved already is read the same
way: the client's events are one stream, whatever servers made them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.apis import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES
from gateway.continuation.events import parsed


@dataclass
class Relayed:
    """The answer so far, as the client saw it."""

    path: str
    id: str | None = None  # chat/completions/generate chunk id, Messages msg_, Responses resp_
    created: int | None = None
    model: str | None = None
    text: str = ""  # the answer's text (content) so far
    reasoning: str = ""  # reasoning text so far
    tool_calls: int = 0  # tool-call deltas, tool_use blocks, function_call items seen
    finished: bool = False  # a finish (reason, message_delta, response.completed) went out
    errored: bool = False  # an error event went out
    events: int = 0
    # /generate: SGLang's own counts ride on every chunk.
    output_ids: list[int] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    # /v1/messages: the content blocks.
    input_tokens: int | None = None  # message_start's
    open_block: tuple[int, str] | None = None  # (index, type) of the open block
    next_block: int = 0  # the index the next block gets
    # /v1/responses: the response and its output items.
    response: dict[str, Any] | None = None  # as response.created carried it
    sequence: int = -1  # the last sequence_number
    items: list[dict[str, Any]] = field(default_factory=list)  # output items, done or open
    open_item: int | None = None  # output_index of the item still open


def read(path: str, events: bytes) -> Relayed:
    """The transcript of the whole events `events` relayed on a stream of `path`."""
    relayed = Relayed(path)
    reader = _READERS[path]
    for name, _, value in parsed(events):
        relayed.events += 1
        if isinstance(value, dict):
            reader(relayed, name, value)
    return relayed


def _openai_head(relayed: Relayed, chunk: dict[str, Any]) -> bool:
    """Ids of a chat/completions chunk; False for an error event."""
    if "error" in chunk and "choices" not in chunk:
        relayed.errored = True
        return False
    if relayed.id is None:
        relayed.id, relayed.created, relayed.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
    return True


def _chat(relayed: Relayed, _: str | None, chunk: dict[str, Any]) -> None:
    if not _openai_head(relayed, chunk):
        return
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        relayed.text += delta.get("content") or ""
        relayed.reasoning += delta.get("reasoning_content") or ""
        relayed.tool_calls += len(delta.get("tool_calls") or ())
        if choice.get("finish_reason") is not None:
            relayed.finished = True


def _completions(relayed: Relayed, _: str | None, chunk: dict[str, Any]) -> None:
    if not _openai_head(relayed, chunk):
        return
    for choice in chunk.get("choices") or ():
        relayed.text += choice.get("text") or ""
        if choice.get("finish_reason") is not None:
            relayed.finished = True


def _generate(relayed: Relayed, _: str | None, chunk: dict[str, Any]) -> None:
    """Text and ids are cumulative in every chunk (incremental_streaming_output is off by
    default, http_server.py:950): the last chunk says everything."""
    if "error" in chunk and "meta_info" not in chunk:
        relayed.errored = True
        return
    meta = chunk.get("meta_info") or {}
    relayed.id = meta.get("id", relayed.id)
    relayed.text = chunk.get("text") or ""
    relayed.output_ids = list(chunk.get("output_ids") or ())
    relayed.completion_tokens = meta.get("completion_tokens")
    relayed.prompt_tokens = meta.get("prompt_tokens")
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        relayed.finished = True
        relayed.errored = reason.get("type") == "abort"


def _messages(relayed: Relayed, name: str | None, event: dict[str, Any]) -> None:
    kind = event.get("type", name)
    if kind == "message_start":
        message = event.get("message") or {}
        relayed.id, relayed.model = message.get("id"), message.get("model")
        relayed.input_tokens = (message.get("usage") or {}).get("input_tokens")
    elif kind == "content_block_start":
        block = event.get("content_block") or {}
        index = int(event.get("index", relayed.next_block))
        relayed.open_block = (index, str(block.get("type")))
        relayed.next_block = index + 1
        if block.get("type") == "tool_use":
            relayed.tool_calls += 1
        relayed.text += block.get("text") or ""
    elif kind == "content_block_delta":
        delta = event.get("delta") or {}
        relayed.text += delta.get("text") or ""
        relayed.reasoning += delta.get("thinking") or ""
    elif kind == "content_block_stop":
        relayed.open_block = None
    elif kind == "message_delta":
        relayed.finished = True
    elif kind == "error":
        relayed.errored = True


def _responses(relayed: Relayed, name: str | None, event: dict[str, Any]) -> None:
    kind = str(event.get("type", name))
    if isinstance(event.get("sequence_number"), int):
        relayed.sequence = event["sequence_number"]
    if kind in ("response.created", "response.in_progress", "response.queued"):
        response = event.get("response") or {}
        if relayed.response is None:
            relayed.response = response
            relayed.id, relayed.model = response.get("id"), response.get("model")
            relayed.created = response.get("created_at")
    elif kind == "response.output_item.added":
        item = dict(event.get("item") or {})
        relayed.open_item = int(event.get("output_index", len(relayed.items)))
        relayed.items.append(item)
        if item.get("type") == "function_call":
            relayed.tool_calls += 1
    elif kind == "response.output_text.delta":
        relayed.text += event.get("delta") or ""
    elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
        relayed.reasoning += event.get("delta") or ""
    elif kind == "response.output_item.done":
        index = int(event.get("output_index", len(relayed.items) - 1))
        if 0 <= index < len(relayed.items):
            relayed.items[index] = dict(event.get("item") or {})
        relayed.open_item = None
    elif kind in ("response.completed", "response.incomplete"):
        relayed.finished = True
    elif kind in ("response.failed", "error"):
        relayed.errored = True


_READERS = {CHAT: _chat, COMPLETIONS: _completions, GENERATE: _generate, MESSAGES: _messages,
            RESPONSES: _responses}
