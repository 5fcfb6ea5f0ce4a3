"""A stream's transcript and its bound (handoff.transcript_chunks): what the relay keeps of
the events it sent, and when that is no longer enough to continue the stream."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

from gateway.relay.continuing import TOO_LONG, Plan, plan
from gateway.relay.exchange import RECENT_CHUNKS, Exchange

CHAT = "/v1/chat/completions"


def _exchange(bound: int, pieces: int) -> Exchange:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": True}).encode()
    inbound = SimpleNamespace(path=CHAT, body=[body])
    exchange = Exchange(cast(Any, inbound), [], cast(Any, None), 0.0, cast(Any, None),
                        transcript_chunks=bound)
    for i in range(pieces):
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]}
        exchange.recent.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return exchange


def test_within_its_bound_a_stream_is_kept_whole_and_can_be_continued() -> None:
    exchange = _exchange(bound=8, pieces=8)
    exchange.bound_transcript()
    assert len(exchange.recent) == 8 and exchange.dropped == 0 and exchange.transcript_whole()
    planned = plan(exchange)
    assert isinstance(planned, Plan) and planned.relayed.text == "".join(f" w{i}" for i in range(8))


def test_beyond_its_bound_a_stream_keeps_only_its_last_pieces_and_is_not_continued() -> None:
    exchange = _exchange(bound=8, pieces=9)
    assert plan(exchange) == TOO_LONG  # decided by the count, before any piece is let go of
    last = exchange.recent[-RECENT_CHUNKS:]
    exchange.bound_transcript()
    assert exchange.recent == last and exchange.dropped == 9 - RECENT_CHUNKS
    assert exchange.relayed_pieces() == 9 and not exchange.transcript_whole()
    assert plan(exchange) == TOO_LONG
