"""The next server's events, rewritten so they go on the client's stream as one.

One splicer per continued stream, fed the whole events of the continuation as they come and
returning the bytes for the client. Chat, completions and /generate continue as themselves;
a Messages or Responses stream continues as chat (SGLang's adapters never set
continue_final_message: anthropic/serving.py:577-578, serving_responses.py:746-765), and only
that part is translated to the client's events, as SGLang's own adapters translate a chat
stream (anthropic/serving.py:862-1280, serving_responses.py's stream).

Usage counts the whole answer as SGLang would have for one request: the prompt tokens of the
original request (the continuation's less the prefix it carried, `tokens_before`), the
completion tokens of both parts.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from gateway.continuation.events import (
    CHAT,
    COMPLETIONS,
    DONE,
    GENERATE,
    MESSAGES,
    RESPONSES,
    data_event,
    named_event,
    parsed,
)
from gateway.continuation.transcript import Relayed

# anthropic/serving.py:67-71 and :74-85
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "request_timeout_error", 429: "rate_limit_error",
               503: "overloaded_error"}


@dataclass(frozen=True)
class Seam:
    """Where the continuation joins the stream the client has."""

    relayed: Relayed  # the client's stream so far
    tokens_before: int  # tokens of the answer so far: the prefix the continuation carries
    include_usage: bool = False  # the client asked for the usage chunk (chat, completions)


class Splicer:
    """Continuation events in, the client's events out."""

    def __init__(self, seam: Seam) -> None:
        self.seam = seam
        self.finished = False  # the continuation's end went out (its finish, or its error)

    def feed(self, events: bytes) -> bytes:
        out = [self.event(name, data, value) for name, data, value in parsed(events)]
        return b"".join(out)

    def event(self, name: str | None, data: bytes, value: Any) -> bytes:
        raise NotImplementedError

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A chat/completions usage object counting the whole answer."""
        before = self.seam.tokens_before
        prompt = max(int(usage.get("prompt_tokens") or 0) - before, 0)
        completion = int(usage.get("completion_tokens") or 0) + before
        fixed = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            fixed["prompt_tokens_details"] = {**details,
                                              "cached_tokens": min(details["cached_tokens"], prompt)}
        return fixed


class ChatSplicer(Splicer):
    """Chat continued as chat: the continuation's role chunk dropped, its chunks under the
    first id and creation time, its usage counting the whole answer; the usage chunk kept only
    when the client asked for it (the continuation always asks, to count)."""

    def event(self, name: str | None, data: bytes, value: Any) -> bytes:
        if data == b"[DONE]":
            self.finished = True
            return DONE
        if not isinstance(value, dict) or "choices" not in value:
            if isinstance(value, dict) and "error" in value:
                self.finished = True
            return data_event(value) if value is not None else b"data: " + data + b"\n\n"
        choices = value.get("choices") or []
        if not choices and value.get("usage") and not self.seam.include_usage:
            return b""
        if any(_is_role_only(choice) for choice in choices):
            return b""
        relayed = self.seam.relayed
        value["id"] = relayed.id if relayed.id is not None else value.get("id")
        if relayed.created is not None:
            value["created"] = relayed.created
        if isinstance(value.get("usage"), dict):
            value["usage"] = self.usage(value["usage"])
        return data_event(value)


def _is_role_only(choice: Any) -> bool:
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return (isinstance(delta, dict) and delta.get("role") == "assistant"
            and not delta.get("content") and not delta.get("reasoning_content")
            and not delta.get("tool_calls") and choice.get("finish_reason") is None)


class CompletionSplicer(ChatSplicer):
    """Completions continued as completions: no role chunk; the same id, usage, [DONE]."""


class GenerateSplicer(Splicer):
    """/generate continued as /generate: text and output ids cumulative over both parts,
    meta_info under the first id with the original prompt's tokens and the completion tokens
    of both parts."""

    def event(self, name: str | None, data: bytes, value: Any) -> bytes:
        if data == b"[DONE]":
            self.finished = True
            return DONE
        if not isinstance(value, dict) or "meta_info" not in value:
            self.finished = self.finished or isinstance(value, dict) and "error" in value
            return data_event(value) if value is not None else b"data: " + data + b"\n\n"
        relayed, before = self.seam.relayed, self.seam.tokens_before
        meta = dict(value["meta_info"])
        value["text"] = relayed.text + (value.get("text") or "")
        value["output_ids"] = relayed.output_ids + list(value.get("output_ids") or ())
        meta["id"] = relayed.id if relayed.id is not None else meta.get("id")
        completion = int(meta.get("completion_tokens") or 0) + before
        meta["completion_tokens"] = completion
        if relayed.prompt_tokens is not None:
            meta["prompt_tokens"] = relayed.prompt_tokens
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "length":
            meta["finish_reason"] = {**reason, "length": completion}  # max_new_tokens, whole
        value["meta_info"] = meta
        return data_event(value)


class FromChat(Splicer):
    """A chat continuation translated to the client's API: [DONE] ends it, an error event
    ends it in the client's shape, every chunk's usage is kept to count the whole answer."""

    def __init__(self, seam: Seam) -> None:
        super().__init__(seam)
        self.finish: str | None = None
        self.usage_seen: dict[str, Any] | None = None

    def event(self, name: str | None, data: bytes, value: Any) -> bytes:
        if data == b"[DONE]":
            self.finished = True
            return self._end()
        if not isinstance(value, dict):
            return b""
        if "error" in value and "choices" not in value:
            error = value["error"] if isinstance(value["error"], dict) else {}
            self.finished = True
            return self._error(error.get("code"), str(error.get("message") or "Upstream error"))
        if isinstance(value.get("usage"), dict):
            self.usage_seen = value["usage"]
        out: list[bytes] = []
        for choice in value.get("choices") or ():
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
            out += self._choice(choice.get("delta") or {})
        return b"".join(out)

    def _choice(self, delta: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def _end(self) -> bytes:
        raise NotImplementedError

    def _error(self, code: Any, message: str) -> bytes:
        raise NotImplementedError


class MessagesSplicer(FromChat):
    """A Messages stream continued as chat: its chunks made Anthropic events as
    anthropic/serving.py:1146-1280 makes them, the content block indexes going on from the
    client's, one message_delta and message_stop at the end with the output tokens of both
    parts. No second message_start."""

    def __init__(self, seam: Seam) -> None:
        super().__init__(seam)
        relayed = seam.relayed
        self.index = relayed.open_block[0] if relayed.open_block else relayed.next_block
        self.block = relayed.open_block[1] if relayed.open_block else None

    def _choice(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta",
                                    "thinking": delta["reasoning_content"]}))
        for call in delta.get("tool_calls") or ():
            out += self._tool_call(call)
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        return out

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        function = call.get("function") or {}
        out: list[bytes] = []
        if function.get("name"):
            block = {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                     "name": function["name"], "input": {}}
            out += self._open("tool_use", block, force_new=True)
        if function.get("arguments") and self.block == "tool_use":
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": function["arguments"]}))
        return out

    def _open(self, kind: str, block: dict[str, Any], force_new: bool = False) -> list[bytes]:
        out = []
        if self.block is not None and (force_new or self.block != kind):
            out += self._close()
        if self.block is None:
            self.block = kind
            out.append(named_event("content_block_start", {
                "type": "content_block_start", "index": self.index, "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        self.index += 1
        return [named_event("content_block_stop", {"type": "content_block_stop",
                                                   "index": self.index - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta",
                                                   "index": self.index, "delta": delta})

    def _end(self) -> bytes:
        stop = STOP_REASONS.get(self.finish or "stop", "end_turn")
        completion = (self.usage_seen or {}).get("completion_tokens") or 0
        output = int(completion) + self.seam.tokens_before
        return b"".join([*self._close(), named_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop},
            "usage": {"output_tokens": output}}),
            named_event("message_stop", {"type": "message_stop"})])

    def _error(self, code: Any, message: str) -> bytes:
        """anthropic/serving.py:978-993: the open block closed, the error, message_stop."""
        error = {"type": ERROR_TYPES.get(code, "api_error"), "message": message}
        return b"".join([*self._close(), named_event("error", {"type": "error", "error": error}),
            named_event("message_stop", {"type": "message_stop"})])


class ResponsesSplicer(FromChat):
    """A Responses stream continued as chat: its chunks made Responses events, the
    sequence numbers, output indexes and the open message item going on from the client's;
    one response.completed / incomplete at the end carrying the whole response."""

    def __init__(self, seam: Seam) -> None:
        super().__init__(seam)
        relayed = seam.relayed
        self.sequence = relayed.sequence + 1
        self.items = [dict(item) for item in relayed.items]
        self.open = relayed.open_item  # the output_index of the open item
        self.text = relayed.text if self.open is not None else ""

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        value = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return named_event(kind, value)

    def _choice(self, delta: dict[str, Any]) -> list[bytes]:
        content = delta.get("content")
        if not content:
            return []
        out = self._open_message()
        self.text += content
        out.append(self._event("response.output_text.delta", {
            "item_id": self._item_id(), "output_index": self.open, "content_index": 0,
            "delta": content, "logprobs": []}))
        return out

    def _item_id(self) -> str:
        assert self.open is not None
        return str(self.items[self.open].get("id"))

    def _open_message(self) -> list[bytes]:
        if self.open is not None:
            return []
        self.open, self.text = len(self.items), ""
        item = {"id": f"msg_{uuid.uuid4().hex}", "content": [], "role": "assistant",
                "status": "in_progress", "type": "message", "phase": "final_answer"}
        self.items.append(item)
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": None}
        return [self._event("response.output_item.added", {"output_index": self.open, "item": item}),
                self._event("response.content_part.added", {
                    "item_id": item["id"], "output_index": self.open, "content_index": 0,
                    "part": part})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        index, text, item_id = self.open, self.text, self._item_id()
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [],
                                "logprobs": None}
        item = {**self.items[index], "content": [part], "status": "completed"}
        self.items[index] = item
        self.open = None
        at = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", {**at, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**at, "part": part}),
                self._event("response.output_item.done", {"output_index": index, "item": item})]

    def _end(self) -> bytes:
        """serving_responses.py: "length" is incomplete (max_output_tokens), else completed."""
        out = self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        response = self._response(status)
        response["incomplete_details"] = ({"reason": "max_output_tokens"}
                                          if status == "incomplete" else None)
        out.append(self._event(f"response.{status}", {"response": response}))
        return b"".join(out)

    def _response(self, status: str) -> dict[str, Any]:
        response = dict(self.seam.relayed.response or {})
        response.update(status=status, output=self.items)
        if self.usage_seen is not None:
            usage = self.usage(self.usage_seen)
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
            reasoning = usage.get("reasoning_tokens") or 0
            response["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": usage["total_tokens"]}
        return response

    def _error(self, code: Any, message: str) -> bytes:
        out = self._close()
        response = self._response("failed")
        response["error"] = {"code": "server_error", "message": message}
        out.append(self._event("response.failed", {"response": response}))
        return b"".join(out)


_SPLICERS: dict[tuple[str, str], type[Splicer]] = {
    (CHAT, CHAT): ChatSplicer, (COMPLETIONS, COMPLETIONS): CompletionSplicer,
    (GENERATE, GENERATE): GenerateSplicer, (MESSAGES, CHAT): MessagesSplicer,
    (RESPONSES, CHAT): ResponsesSplicer,
}


def splicer(client_path: str, continuation_path: str, seam: Seam) -> Splicer:
    """The splicer for a stream of `client_path` continued by a request to `continuation_path`."""
    return _SPLICERS[client_path, continuation_path](seam)

