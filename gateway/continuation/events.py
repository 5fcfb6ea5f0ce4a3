"""SSE event helpers shared by the continuation modules: payloads in, events out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from gateway.apis.sse import split_events
from gateway.apis.streams import data_of

DONE = b"data: [DONE]\n\n"



def parsed(events: bytes) -> Iterator[tuple[str | None, bytes, Any]]:
    """(event name, raw data, JSON value or None) of each whole event in `events`."""
    for event in split_events(events):
        if event.startswith(b":") or not event.strip():
            continue
        name = None
        if event.startswith(b"event:"):
            name = event.split(b"\n", 1)[0][6:].strip().decode("utf-8", "replace")
        data = data_of(event).strip()
        yield name, data, _json(data)


def _json(data: bytes) -> Any:
    if not data or data == b"[DONE]":
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def dumps(value: Any) -> str:
    """Compact JSON, as SGLang's pydantic dumps are (no spaces, UTF-8 kept)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def data_event(value: Any) -> bytes:
    return b"data: " + dumps(value).encode() + b"\n\n"


def named_event(name: str, value: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(value).encode() + b"\n\n"
