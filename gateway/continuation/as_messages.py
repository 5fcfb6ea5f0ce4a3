"""A Messages stream continued as chat (SGLang's adapter never sets continue_final_message:
anthropic/serving.py:577-578), the chat chunks made Anthropic events as SGLang's own adapter
makes them (anthropic/serving.py:862-1280)."""

from __future__ import annotations

import uuid
from typing import Any

from gateway.continuation.events import named_event
from gateway.continuation.seam import FromChat, Seam

# anthropic/serving.py:67-71 and :74-85
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "request_timeout_error", 429: "rate_limit_error",
               503: "overloaded_error"}


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
