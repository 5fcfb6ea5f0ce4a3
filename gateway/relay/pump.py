"""The stream pump: a committed stream's events from the backend to the client, whole.

One framing step for every piece the backend sends (`relay` in `_relay`): whole events cut
and kept (a continuation's transcript; the ending and usage read the last few; their count is
the lease's output_chunks, and what the deadlines compares at its looks). Two ways to write
them: the fast path, in the upstream connection's own callback through the server's body
writer (gateway.relay.client_io), and ASGI `send` for servers without one. Nothing else runs per
piece: no extra call or await on either path."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.apis.errors import UpstreamStreamError
from gateway.apis.sse import split_events
from gateway.apis.streams import error_mark, event_error
from gateway.metrics import GatewayMetrics
from gateway.relay.asgi import Send
from gateway.relay.client_io import ClientWriter
from gateway.relay.deadlines import KEEPALIVE
from gateway.relay.exchange import RECENT_CHUNKS, Exchange
from gateway.upstream.client import UpstreamResponse
from gateway.upstream.engine.seam import engine_of

KEEPALIVE_COMMENT = b": keep-alive\n\n"


def last_events(exchange: Exchange) -> bytes:
    """The last events sent: where a stream's usage and error are."""
    return b"".join(exchange.recent[-RECENT_CHUNKS:])


# What SGLang's adapters send just before their error event, closing the open block or item
# (anthropic/serving.py:978-993; the Responses stream's done events): part of the error.
_CLOSING = (b"event: content_block_stop", b"event: response.output_text.done",
            b"event: response.content_part.done", b"event: response.output_item.done")


def _before_error(exchange: Exchange, events: bytes, response: UpstreamResponse) -> bytes:
    """The events before the backend's own error event, if one is among them: the stream
    fails with it (a backend failure, that a continuation may repair) and nothing after it is
    relayed."""
    if exchange.stream_error is not None:
        return b""
    api, kept = exchange.inbound.api, list[bytes]()
    for event in split_events(events):
        error = event_error(api, event)
        if error is not None:
            while kept and kept[-1].startswith(_CLOSING):
                kept.pop()
            name = exchange.lease.backend.name
            exchange.stream_error = UpstreamStreamError(f"backend '{name}' failed the stream: "
                                                        f"{error[1]}")
            response.interrupt(exchange.stream_error)
            return b"".join(kept)
        kept.append(event)
    return events


async def pump(exchange: Exchange, send: Send, response: UpstreamResponse, first: bytes,
               writer: ClientWriter | None, metrics: GatewayMetrics,
               stop_at_error: bool = False) -> None:
    """Relay `first` (the events up to the first that decides anything) and the rest of the
    stream until the backend ends it. `stop_at_error`: the backend's own error event is not
    relayed; the response fails with it instead (the stream may be continued elsewhere).
    The pieces that carried events, kept in `exchange.recent`, are the lease's `output_chunks`:
    MTP's recent accept length is tokens per chunk, SGLang sending one chunk per decode step
    (events the backend sent apart but the gateway read together, when it fell behind, count
    as one)."""
    recent = exchange.recent
    mark = error_mark(exchange.inbound.path, exchange.inbound.api) if stop_at_error else None
    if mark is not None and first.find(mark) >= 0:  # the attempt may have read it all at once
        first = _before_error(exchange, first, response)
    unasked = (engine_of(exchange.lease.backend).USAGE_CHUNK if exchange.inbound.usage_asked
               and not exchange.lease.backend.usage_by_default else None)
    if first:  # already framed (the attempt read it): kept, and sent by `send`
        recent.append(first)
        if unasked is not None and first.find(unasked) >= 0:
            first = _without(first, unasked)
        await send({"type": "http.response.body", "body": first, "more_body": True})
    if exchange.stream_error is not None:  # in `first`: nothing after it is relayed
        exchange.lease.output_chunks = exchange.relayed_pieces()
        return
    fast = writer if writer is not None and writer.usable() else None
    relay, progress = _relay(exchange, response, fast, mark, unasked)
    exchange.deadlines.follow(progress)
    try:
        if fast is not None:
            metrics.relayed_streams.labels("writer").inc()
            await _by_writer(exchange, response, fast, relay)
        else:
            metrics.relayed_streams.labels("send").inc()
            await _by_send(exchange, send, response, relay)
    finally:
        exchange.deadlines.follow(None)
        exchange.lease.output_chunks = exchange.relayed_pieces()


# Which pieces can hold the usage chunk, by their fourth byte from the end: "}" (125) in the
# usage chunk ("...}}\n\n": its usage object closes the event, serving_chat.py:2797), "E" (69)
# in "[DONE]\n\n" after it; a content chunk has "]" ("...}]}\n\n", chat, sse_utils.py:52-110)
# or "l" ("usage":null}, completions).


def _without(events: bytes, unasked: bytes) -> bytes:
    """The events but the usage chunk the gateway asked for and the client did not: the client
    gets what the server would have sent it (once a stream, at its end)."""
    return b"".join(event for event in split_events(events) if event.find(unasked) < 0)


def _relay(exchange: Exchange, response: UpstreamResponse, fast: ClientWriter | None,
           mark: bytes | None, unasked: bytes | None = None
           ) -> tuple[Callable[[bytes], bytes], Callable[[], int]]:
    """The per-piece step and the watchdog's count of pieces. Every instruction here runs for
    every piece of every stream (lab/results/perf/instructions.md counts them): names bound once,
    no Python call but the framer's, and no clock read (the deadlines compares the count)."""
    feed, recent = exchange.framer.feed, exchange.recent
    write = fast.write if fast is not None else None
    held = 0  # pieces that completed no event: the backend's bytes all the same

    def relay(chunk: bytes) -> bytes:
        """Every piece the backend sends, on either path: framed, kept, and written here on
        the fast path (returned for `send` on the other)."""
        nonlocal held
        events = feed(chunk)
        if not events:
            held += 1
            return events
        # partition, not find (its argument parsing) nor `in` (which first tries its operand
        # as an integer, building and dropping a TypeError): 1,000 instructions a piece less.
        if mark is not None and events.partition(mark)[1]:
            events = _before_error(exchange, events, response)
            if not events:
                return events
        recent.append(events)  # all kept: a continuation's transcript
        if write is not None and write(events):
            response.pause_reading()  # the client's buffer is full: until it drains
        return events

    def progress() -> int:
        """The pieces so far, read at the watchdog's looks: where the transcript is bounded
        too, at no cost per piece."""
        exchange.bound_transcript()
        return exchange.relayed_pieces() + held

    if unasked is None:
        return relay, progress
    hidden = unasked

    def relay_unasked(chunk: bytes) -> bytes:
        """`relay`, for a stream whose usage chunk the client did not ask for: kept in
        `recent` (the learner's sample, the access log), not sent. A step of its own, so
        the other streams pay nothing for it."""
        nonlocal held
        events = feed(chunk)
        if not events:
            held += 1
            return events
        if mark is not None and events.partition(mark)[1]:
            events = _before_error(exchange, events, response)
            if not events:
                return events
        recent.append(events)
        # Only a piece that ends as the usage chunk or as [DONE] can hold it: one byte read
        # (~440 instructions a piece, where a search of every piece cost ~1,400 and endswith
        # ~1,300: callgrind over 20,000 pieces).
        try:
            last = events[-4]
        except IndexError:  # a piece of a few bytes: never the usage chunk
            last = 0
        if (last == 125 or last == 69) and events.partition(hidden)[1]:  # "}" or "E"
            events = _without(events, hidden)
        if write is not None and events and write(events):
            response.pause_reading()
        return events

    return relay_unasked, progress


async def _by_writer(exchange: Exchange, response: UpstreamResponse, writer: ClientWriter,
                     relay: Callable[[bytes], bytes]) -> None:
    """The fast path: each piece is framed and written to the client in the upstream
    connection's callback. This task only waits for the end, writes keep-alives, and waits out
    a slow client (the backend's socket is paused meanwhile)."""
    deadlines = exchange.deadlines
    response.pump(relay)
    while True:
        try:
            deadlines.reading = True
            ended = await response.pumped()
        except asyncio.CancelledError:
            if deadlines.reason != KEEPALIVE:
                raise
            writer.write(KEEPALIVE_COMMENT)
            deadlines.handled_keepalive()
            continue
        finally:
            deadlines.reading = False
        if ended:
            return
        await writer.drain()
        response.resume_reading()


async def _by_send(exchange: Exchange, send: Send, response: UpstreamResponse,
                   relay: Callable[[bytes], bytes]) -> None:
    """The same relay by ASGI send, for servers without the body writer."""
    deadlines, next_chunk = exchange.deadlines, response.next_chunk
    while True:
        try:
            deadlines.reading = True
            chunk = await next_chunk()
        except asyncio.CancelledError:
            if deadlines.reason != KEEPALIVE:
                raise
            await send({"type": "http.response.body", "body": KEEPALIVE_COMMENT, "more_body": True})
            deadlines.handled_keepalive()
            continue
        finally:
            deadlines.reading = False
        if not chunk:
            return
        events = relay(chunk)
        if events:
            await send({"type": "http.response.body", "body": events, "more_body": True})
