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

from gateway.apis.errors import UpstreamBroken, UpstreamError, UpstreamRefused, UpstreamStatus
from gateway.apis.sse import EventFramer, split_events
from gateway.apis.streams import event_error, leads_in
from gateway.config import Settings
from gateway.metrics import GatewayMetrics
from gateway.relay.asgi import Send
from gateway.relay.endings import Endings
from gateway.relay.exchange import Exchange, failure_of
from gateway.relay.in_flight import InFlight
from gateway.relay.inbound import upstream_headers
from gateway.relay.pump import KEEPALIVE_COMMENT
from gateway.upstream.client import Upstream, UpstreamResponse

log = logging.getLogger("mtp_gateway.relay")

STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_SSE_CONTENT_TYPE = [(b"content-type", b"text/event-stream; charset=utf-8")]

Opened = tuple[UpstreamResponse, bytes]  # the response and its first body bytes


class Attempts:
    def __init__(self, upstream: Upstream, metrics: GatewayMetrics, in_flight: InFlight,
                 endings: Endings) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.in_flight = in_flight
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
            self.in_flight.apply(retry.flip)  # the retry's decision may have flipped the mode
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
        Until its first event a stream can be moved (gateway.relay.in_flight): it then opens again,
        whole, on the server the move gave its lease."""
        if not exchange.inbound.stream:
            return await self._open(exchange)
        while True:
            opened = await self._open_movable(exchange, send, settings)
            if opened is not None:
                return opened

    async def _open_movable(self, exchange: Exchange, send: Send, settings: Settings
                            ) -> Opened | None:
        """One opening of a stream, in the request's own task, which a planned move cancels
        where it waits (None: it was moved). Meanwhile keep-alive comments go out. Only the
        wait for the first event can be moved: the relay of the chunks after it is untouched."""
        waiting = self.in_flight.wait_for_first_event(exchange)
        keepalives = _KeepAlives(self.endings, exchange, send, settings.timeouts.keepalive_s)
        opened: Opened | None
        try:
            try:
                opened = await self._open(exchange)
            finally:
                self.in_flight.done_waiting(exchange)
        except asyncio.CancelledError:
            # The move's cancel and no other (a timeout, the client gone, the shutdown) is
            # the request's to go on with: its upstream was closed on the way out, and the
            # move aborted it there.
            if not (waiting.moved and waiting.task.uncancel() == 0):
                keepalives.stop()
                raise
            opened = None
        except BaseException:
            await keepalives.finish()  # one being written goes out whole: a retry may follow
            raise
        await keepalives.finish()  # one being written goes out before what follows
        return opened

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
            exchange.deadlines.got_bytes()
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


class _KeepAlives:
    """SSE keep-alive comments every `interval_s` while a stream's opening waits for its
    first event (a long prefill, a queue), so idle-timeout proxies between the agent and the
    gateway keep it open. A timer starts each write in a task of its own: the opening stays
    in the request's task, where a planned move can cancel it, and a stream whose first
    event comes sooner (almost every one) makes no task for it."""

    def __init__(self, endings: Endings, exchange: Exchange, send: Send,
                 interval_s: float) -> None:
        self._endings, self._exchange, self._send = endings, exchange, send
        self._interval_s = interval_s
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(interval_s, self._due) if interval_s else None
        self._writing: asyncio.Task[None] | None = None

    def _due(self) -> None:
        self._timer = None
        self._writing = self._loop.create_task(self._write())

    async def _write(self) -> None:
        exchange = self._exchange
        if not exchange.committed:
            await self._endings.commit(exchange, self._send, 200, _SSE_CONTENT_TYPE,
                                       STREAM_HEADERS)
        await self._send({"type": "http.response.body", "body": KEEPALIVE_COMMENT,
                          "more_body": True})
        self._timer = self._loop.call_later(self._interval_s, self._due)

    async def finish(self) -> None:
        """No more comments; one being written is awaited (what it raised, raised here)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        writing, self._writing = self._writing, None
        if writing is not None:
            await writing
            if self._timer is not None:  # the write's own next one
                self._timer.cancel()
                self._timer = None

    def stop(self) -> None:
        """No more comments, none awaited: the request's task was cancelled (it ends)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.cancel()
