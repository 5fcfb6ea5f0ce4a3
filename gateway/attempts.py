"""The attempt and retry runner: open the backend's response up to its first body bytes, and
when that fails before anything went to the client, once more on the other server.

    attempt -> [connect error, 5xx, broken before the first byte, or a stream whose first
                event is an error: the routing decides again without the failed server]
            -> the response and its first bytes (a stream: up to its first event that decides
               anything; an answer: whole)

An error answer (a 5xx, or an error as a stream's first event) is judged by the retry when the
lease ends: if the next server answers the same request with an error too, the request is the
cause (or every queue is full), not a broken server, and neither circuit counts it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gateway.asgi import Send
from gateway.config import Settings
from gateway.endings import Endings
from gateway.errors import UpstreamBroken, UpstreamError, UpstreamRefused, UpstreamStatus
from gateway.exchange import Exchange, failure_of
from gateway.handover import Handover, unwind
from gateway.inbound import upstream_headers
from gateway.metrics import GatewayMetrics
from gateway.pump import KEEPALIVE_COMMENT
from gateway.sse import EventFramer, split_events
from gateway.streams import event_error, leads_in
from gateway.upstream import Upstream, UpstreamResponse

log = logging.getLogger("mtp_gateway.relay")

STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_SSE_CONTENT_TYPE = [(b"content-type", b"text/event-stream; charset=utf-8")]

Opened = tuple[UpstreamResponse, bytes]  # the response and its first body bytes


class Attempts:
    def __init__(self, upstream: Upstream, metrics: GatewayMetrics, handover: Handover,
                 endings: Endings) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.handover = handover
        self.endings = endings

    async def run(self, exchange: Exchange, send: Send, settings: Settings) -> Opened:
        """One attempt, and a retry elsewhere when it fails before the client got anything."""
        lease = exchange.lease
        try:
            return await self._attempt(exchange, send, settings)
        except UpstreamError as exc:
            first = lease.backend
            retry = None if exchange.committed else \
                lease.retry_elsewhere(failure_of(exc), time.monotonic())
            if retry is None or retry.backend is None:
                return self._no_retry(exchange, exc)
            fallback = retry.backend
            self.metrics.retries.labels(first.name, fallback.name).inc()
            log.warning("retrying on %s after %s from %s", fallback.name, exc.kind, first.name)
            self.handover.apply(retry.flip)  # the retry's decision may have flipped the mode
        try:
            return await self._attempt(exchange, send, settings)
        except UpstreamError as again:
            return self._no_retry(exchange, again)

    @staticmethod
    def _no_retry(exchange: Exchange, exc: UpstreamError) -> Opened:
        """The request ends with this failure: a refusal in a stream reaches the client as the
        backend sent it; any other failure is raised."""
        if not isinstance(exc, UpstreamRefused):
            raise exc
        exchange.refuse(failure_of(exc))
        assert exchange.upstream is not None  # the refusing response, still open
        return exchange.upstream, exc.head

    async def _attempt(self, exchange: Exchange, send: Send, settings: Settings) -> Opened:
        """Open the upstream response up to its first body bytes.

        A stream whose first token is slow (long prefill, queue) gets SSE keep-alive comments
        meanwhile, so idle-timeout proxies between the agent and the gateway keep it open.
        Until its first event a stream can be moved (gateway.handover): it then opens again,
        whole, on the server the move gave its lease."""
        if not exchange.inbound.stream:
            return await self._open(exchange)
        while True:
            opened = await self._open_movable(exchange, send, settings)
            if opened is not None:
                return opened

    async def _open_movable(self, exchange: Exchange, send: Send, settings: Settings
                            ) -> Opened | None:
        """One opening of a stream, raced against a planned move (None: it was moved). Only
        the wait for the first event races: the relay of the chunks after it is untouched."""
        opening = asyncio.ensure_future(self._open(exchange))
        moved = self.handover.wait_for_first_event(exchange, opening).moved
        keepalive_s = settings.timeouts.keepalive_s or None
        try:
            while True:
                await _first_of(opening, moved, keepalive_s)
                if moved.done():
                    await unwind(opening)  # its upstream was closed and aborted by the move
                    return None
                if opening.done():
                    return opening.result()
                if not exchange.committed:
                    await self.endings.commit(exchange, send, 200, _SSE_CONTENT_TYPE,
                                              STREAM_HEADERS)
                await send({"type": "http.response.body", "body": KEEPALIVE_COMMENT,
                            "more_body": True})
        finally:
            self.handover.done_waiting(exchange)
            opening.cancel()

    async def _open(self, exchange: Exchange) -> Opened:
        inbound, target = exchange.inbound, exchange.lease.backend.target
        backend = exchange.lease.backend.name
        if exchange.upstream is not None:
            exchange.upstream.close()
            exchange.upstream = None
        headers = upstream_headers(exchange.client_headers, target.api_key, inbound.headers)
        self.metrics.requests.labels(backend, exchange.lease.reason).inc()
        self.metrics.overhead.labels(backend).observe(time.monotonic() - exchange.started)
        response = await self.upstream.send("POST", target.url + inbound.path, headers, inbound.body)
        exchange.upstream = response
        if response.status >= 500:
            detail = (await response.read())[:500].decode("utf-8", "replace")
            raise UpstreamStatus(response.status, backend, detail)
        if response.status >= 400:
            return response, b""
        if not inbound.stream:
            # Read whole before anything goes to the client: a backend dying half way through
            # an answer has cost the client nothing yet, so the retry can still happen.
            body = await response.read()
            return response, body
        exchange.framer = EventFramer()
        return response, await self._first_events(exchange, response)

    async def _first_events(self, exchange: Exchange, response: UpstreamResponse) -> bytes:
        """Read a stream up to its first event that decides anything: the events before it
        go out with it. An error there is the backend refusing the request, not yet sent."""
        api, backend, framer = exchange.inbound.api, exchange.lease.backend.name, exchange.framer
        head = b""
        while True:
            chunk = await response.next_chunk()
            if not chunk:
                raise UpstreamBroken(f"backend '{backend}' ended the stream before its first event")
            exchange.watchdog.got_bytes()
            head += framer.feed(chunk)
            for event in split_events(head):
                if leads_in(api, event):
                    continue
                refusal = event_error(api, event)
                if refusal is not None:
                    status, detail = refusal
                    raise UpstreamRefused(status, backend, detail, head)
                return head
            if exchange.waiting is not None:  # only lead-ins so far: still movable, if whole
                exchange.waiting.mid_event = framer.holding


async def _first_of(a: asyncio.Future[Any], b: asyncio.Future[None], timeout_s: float | None) -> None:
    """Until `a` or `b` is done or `timeout_s` has passed: asyncio.wait's FIRST_COMPLETED for
    two, without its sets and per-call bookkeeping (every stream's opening waits here)."""
    loop = asyncio.get_running_loop()
    wake: asyncio.Future[None] = loop.create_future()

    def ready(_: object = None) -> None:
        if not wake.done():
            wake.set_result(None)

    a.add_done_callback(ready)
    b.add_done_callback(ready)
    timer = loop.call_later(timeout_s, ready) if timeout_s else None
    try:
        await wake
    finally:
        if timer is not None:
            timer.cancel()
        a.remove_done_callback(ready)
        b.remove_done_callback(ready)
