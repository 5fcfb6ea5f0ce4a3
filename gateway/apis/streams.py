"""What the relay knows about each API's event stream, and nothing per chunk.

- Which events lead in without deciding anything (`message_start` on /v1/messages,
  `response.created` / `response.in_progress` on /v1/responses): SGLang sends them before the
  first output, and before an error too.
- Whether the first event after them is an error: SGLang answers a full queue or an abort with
  a status code as HTTP 200 whose first event is the error (serving_chat.py:2565-2576;
  the Anthropic and Responses layers translate it: anthropic/serving.py:1113-1131,
  serving_responses.py:3018-3040). That is the backend refusing the request before anything
  was sent: the relay may still retry it elsewhere.
- How the gateway ends a stream it must break off (backend gone, timeout, shutdown), in the
  shape of the API, so every SDK raises instead of returning a truncated answer:
  chat/completions/generate `data: {"error": ...}` then `data: [DONE]` (serving_chat.py:
  2799-2804); Anthropic `event: error` then `event: message_stop`, closing an open content block
  first (anthropic/serving.py:978-993); Responses `event: response.failed`
  (serving_responses.py:2988-3004). The last two never send [DONE].
Only the first events and the last relayed bytes are ever parsed; the hot path stays bytes.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from gateway.apis import ANTHROPIC_API, GENERATE, OPENAI_API, RESPONSES_API
from gateway.apis.errors import ANTHROPIC_STATUS, GatewayError, anthropic_error

_LEAD_IN = {
    ANTHROPIC_API: (b"event: message_start",),
    RESPONSES_API: (b"event: response.created", b"event: response.in_progress",
                b"event: response.queued"),
}
# The one table of in-stream error events, per API: bytes every error event holds and ordinary
# events never do (but for a model's text that quotes them: the event itself is checked then).
ERROR_EVENTS = {OPENAI_API: b'{"error"', ANTHROPIC_API: b"event: error",
                RESPONSES_API: b"event: response.failed"}
GENERATE_ERROR = b'"type":"abort"'  # /generate: an abort with a status is SGLang's error there
_OPEN_BLOCK = re.compile(rb'"type":\s*"content_block_(start|delta|stop)",\s*"index":\s*(\d+)')
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')
# An error event's first line, anchored at a line start: inside JSON a newline is escaped, so
# a model that writes "event: error" in its text cannot look like one.
_ENDS_IN_ERROR = {
    ANTHROPIC_API: re.compile(rb"^event: error\r?$", re.M),
    RESPONSES_API: re.compile(rb"^event: response\.failed\r?$", re.M),
}
_OPENAI_ERROR = re.compile(rb'^data: ?\{"error"', re.M)


def error_mark(path: str, api: str) -> bytes:
    """What every error event of a stream holds (ERROR_EVENTS), for its path and API."""
    return GENERATE_ERROR if path == GENERATE else ERROR_EVENTS[api]


def leads_in(api: str, event: bytes) -> bool:
    """An event that says nothing yet about how the request goes (or a comment)."""
    return event.startswith(b":") or not event.strip() or event.startswith(_LEAD_IN.get(api, ()))


def data_of(event: bytes) -> bytes:
    """The payload of one event: its `data:` lines joined (SSE rules, one optional space)."""
    lines = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines)


def event_error(api: str, event: bytes) -> tuple[int, str] | None:
    """(status, message) when `event` reports an error in its API's form, else None."""
    if api != OPENAI_API:
        marker = ERROR_EVENTS[api]
        if not event.startswith(marker):
            return None
        payload = _json(data_of(event))
        if api == ANTHROPIC_API:
            error = _dict(payload.get("error"))
            return ANTHROPIC_STATUS.get(error.get("type", ""), 502), str(error.get("message", ""))
        error = _dict(_dict(payload.get("response")).get("error"))
        return 502, str(error.get("message") or "response failed")
    data = data_of(event).lstrip()
    if data.startswith(b'{"error"'):
        error = _dict(_json(data).get("error"))
        return _status(error.get("code")), str(error.get("message", ""))
    if b'"finish_reason":{"type":"abort"' in data and b'"status_code"' in data:
        # /generate streams SGLang's own output dicts: an abort with a status is its error.
        meta = _json(data).get("meta_info")
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(reason, dict):
            return _status(reason.get("status_code")), str(reason.get("message", ""))
    return None


def _status(code: Any) -> int:
    return code if isinstance(code, int) and 400 <= code < 600 else 502


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return _dict(value)


def _dict(value: Any) -> dict[str, Any]:
    """`value` when it is a JSON object, else an empty one (an error event's parts may be anything)."""
    return value if isinstance(value, dict) else {}


def ending(api: str, exc: GatewayError, recent: bytes, *, response_id: str | None,
           model: str | None) -> bytes:
    """The bytes that end a stream the gateway breaks off, after the whole events `recent`."""
    if api == ANTHROPIC_API:
        return _anthropic_ending(exc, recent, model)
    if api == RESPONSES_API:
        return _responses_ending(exc, recent, response_id, model)
    return b"data: " + exc.to_bytes() + b"\n\ndata: [DONE]\n\n"


def ends_in_error(api: str, recent: bytes) -> bool:
    """The stream that just ended reported an error of its own near its end. The anchored
    pattern has no literal prefix to skip ahead by (it tries every byte, ~65k instructions for
    a stream's last events): it runs only where its text is."""
    if recent.find(ERROR_EVENTS[api]) < 0:
        return False
    return (_ENDS_IN_ERROR.get(api) or _OPENAI_ERROR).search(recent) is not None


def _sse(name: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (name.encode(), json.dumps(data).encode())


def _anthropic_ending(exc: GatewayError, recent: bytes, model: str | None) -> bytes:
    out = []
    if not recent:  # only keep-alives went out: SGLang opens the message first
        out.append(_sse("message_start", {"type": "message_start", "message": {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "content": [], "model": model or "", "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}))
    blocks = _OPEN_BLOCK.findall(recent)
    if blocks and blocks[-1][0] != b"stop":  # a content block is open: strict clients want it closed
        out.append(_sse("content_block_stop", {"type": "content_block_stop",
                                               "index": int(blocks[-1][1])}))
    out.append(_sse("error", anthropic_error(exc.status, exc.message)))
    out.append(_sse("message_stop", {"type": "message_stop"}))
    return b"".join(out)


def _responses_ending(exc: GatewayError, recent: bytes, response_id: str | None,
                      model: str | None) -> bytes:
    numbers = _SEQUENCE.findall(recent)
    response = {"id": response_id or f"resp_{uuid.uuid4().hex}", "object": "response",
                "created_at": int(time.time()), "model": model or "", "status": "failed",
                "output": [], "error": {"code": "server_error", "message": exc.message},
                "incomplete_details": None, "usage": None}
    return _sse("response.failed", {"type": "response.failed", "response": response,
                                    "sequence_number": int(numbers[-1]) + 1 if numbers else 0})
