"""A Responses stream continued as chat (SGLang's adapter never sets continue_final_message:
serving_responses.py:746-765), the chat chunks made Responses events as serving_responses.py's
stream makes them."""

from __future__ import annotations

import uuid
from typing import Any

from gateway.continuation.events import named_event
from gateway.continuation.seam import FromChat, Seam


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
