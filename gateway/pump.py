"""The stream pump: a committed stream's events from the backend to the client, whole.

One framing step for every piece the backend sends (`_framing`): the watchdog told, whole
events cut, the last few kept for the ending and usage, the events counted. Two ways to write
them: the fast path, in the upstream connection's own callback through the server's body
writer (gateway.client_io), and ASGI `send` for servers without one. Nothing else runs per
piece: no extra call or await on either path."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.asgi import Send
from gateway.client_io import ClientWriter
from gateway.exchange import Exchange
from gateway.metrics import GatewayMetrics
from gateway.upstream import UpstreamResponse
from gateway.watchdog import KEEPALIVE

KEEPALIVE_COMMENT = b": keep-alive\n\n"
RECENT_CHUNKS = 4  # kept for usage and the ending: SGLang's error, usage and [DONE] come apart


async def pump(exchange: Exchange, send: Send, response: UpstreamResponse, first: bytes,
               writer: ClientWriter | None, metrics: GatewayMetrics) -> None:
    """Relay `first` (the events up to the first that decides anything) and the rest of the
    stream until the backend ends it."""
    watchdog, feed, recent = exchange.watchdog, exchange.framer.feed, exchange.recent
    if first:  # already framed (the attempt read it): kept, and sent by `send`
        recent.append(first)
        await send({"type": "http.response.body", "body": first, "more_body": True})
    fast = writer if writer is not None and writer.usable() else None

    def relay(chunk: bytes) -> bytes:
        """Every piece the backend sends, on either path: framed, kept, and written here on
        the fast path (returned for `send` on the other)."""
        watchdog.got_bytes()
        events = feed(chunk)
        if events:
            recent.append(events)
            if len(recent) > RECENT_CHUNKS:
                del recent[0]
            if fast is not None:
                fast.write(events)
                if fast.paused:
                    response.pause_reading()
        return events

    if fast is not None:
        metrics.relayed_streams.labels("writer").inc()
        await _by_writer(exchange, response, fast, relay)
    else:
        metrics.relayed_streams.labels("send").inc()
        await _by_send(exchange, send, response, relay)


async def _by_writer(exchange: Exchange, response: UpstreamResponse, writer: ClientWriter,
                     relay: Callable[[bytes], bytes]) -> None:
    """The fast path: each piece is framed and written to the client in the upstream
    connection's callback. This task only waits for the end, writes keep-alives, and waits out
    a slow client (the backend's socket is paused meanwhile)."""
    watchdog = exchange.watchdog
    response.pump(relay)
    while True:
        try:
            watchdog.reading = True
            ended = await response.pumped()
        except asyncio.CancelledError:
            if watchdog.reason != KEEPALIVE:
                raise
            writer.write(KEEPALIVE_COMMENT)
            watchdog.handled_keepalive()
            continue
        finally:
            watchdog.reading = False
        if ended:
            return
        await writer.drain()
        response.resume_reading()


async def _by_send(exchange: Exchange, send: Send, response: UpstreamResponse,
                   relay: Callable[[bytes], bytes]) -> None:
    """The same relay by ASGI send, for servers without the body writer."""
    watchdog, next_chunk = exchange.watchdog, response.next_chunk
    while True:
        try:
            watchdog.reading = True
            chunk = await next_chunk()
        except asyncio.CancelledError:
            if watchdog.reason != KEEPALIVE:
                raise
            await send({"type": "http.response.body", "body": KEEPALIVE_COMMENT, "more_body": True})
            watchdog.handled_keepalive()
            continue
        finally:
            watchdog.reading = False
        if not chunk:
            return
        events = relay(chunk)
        if events:
            await send({"type": "http.response.body", "body": events, "more_body": True})
