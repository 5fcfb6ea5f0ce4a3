"""Streams recorded from the simulator (SGLang 0.5.23's bytes), in tests/data/continuation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.apis.sse import split_events
from gateway.apis.streams import data_of

DATA = Path(__file__).parent.parent / "data" / "continuation"


def recorded(name: str) -> bytes:
    return (DATA / f"{name}.sse").read_bytes()


def head(name: str, events: int) -> bytes:
    """The first `events` events of a recorded stream: what went out before the seam."""
    return b"".join(split_events(recorded(name))[:events])


def payloads(stream: bytes) -> list[Any]:
    """The JSON payload of each event ([DONE] as the string)."""
    out: list[Any] = []
    for event in split_events(stream):
        data = data_of(event)
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out
