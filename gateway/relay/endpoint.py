"""Forward one request to a backend and stream the answer back, byte for byte.

`ProxyEndpoint` is a raw ASGI endpoint: no per-chunk framework layers between the upstream
read and the client write. The life of a request, each step in its own module:

    admit (gateway.relay.admission: body, parse, key, in-flight limit, the pool's decision)
      -> attempt on a backend, retry once on the other (gateway.relay.attempts); until its first
         event a stream can be moved at a pair's flip (gateway.relay.in_flight)
      -> commit: response headers + first events to the client -> relay chunks, whole events
         (gateway.relay.pump)
      -> end: the backend's own end, or an error ending in the API's shape, or the client left
         (gateway.relay.endings)
    finally: release the in-flight slot, abort upstream work the client no longer wants
             (gateway.relay.aborts), one access-log line (gateway.access_log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.access_log import log_access
from gateway.apis import RESPONSES_API, api_of
from gateway.apis.errors import GatewayError, UpstreamStatus, let_go
from gateway.config import Settings
from gateway.metrics import GatewayMetrics
from gateway.relay.aborts import Aborts
from gateway.relay.admission import admit
from gateway.relay.asgi import Receive, Scope, Send, send_error
from gateway.relay.attempts import STREAM_HEADERS, Attempts
from gateway.relay.client_io import ClientWriter, client_writer
from gateway.relay.deadlines import CLIENT_GONE, Deadlines
from gateway.relay.endings import SHUTDOWN, Endings
from gateway.relay.exchange import Exchange
from gateway.relay.in_flight import InFlight
from gateway.relay.inbound import Inbound
from gateway.routing.lease import Lease
from gateway.routing.pool import Pool
from gateway.routing.sessions import ResponseStore
from gateway.turns.waiting import WaitingRoom
from gateway.upstream.client import Upstream

log = logging.getLogger("mtp_gateway.relay")


class ProxyEndpoint:
    """The ASGI endpoint for every proxied path. Dependencies are given, never looked up."""

    def __init__(self, get_settings: Callable[[], Settings], pool: Pool, upstream: Upstream,
                 metrics: GatewayMetrics, responses: ResponseStore) -> None:
        self.get_settings = get_settings
        self.pool = pool
        self.metrics = metrics
        self.responses = responses
        self.aborts = Aborts(upstream)
        self.in_flight = InFlight(metrics, self.aborts)
        self.endings = Endings(metrics, self.aborts)
        self.attempts = Attempts(upstream, metrics, self.in_flight, self.endings)
        self.waiting: WaitingRoom | None = None  # turns pairs: arrivals wait for a turn here

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        settings = self.get_settings()
        try:
            inbound, lease = await admit(scope, receive, settings, self.pool, self.responses,
                                         started, self.waiting)
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.kind if exc.kind != "client" else exc.code).inc()
            await send_error(send, exc, api=api_of(scope["path"]))
            if settings.log.access:
                log_access(scope["path"], None, None, exc.status, None, started, "rejected", None)
            return
        await self._serve(scope, receive, send, inbound, lease, started, settings)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, inbound: Inbound,
                     lease: Lease, started: float, settings: Settings) -> None:
        task = asyncio.current_task()
        assert task is not None  # always inside a task under an ASGI server
        deadlines = Deadlines(settings.timeouts, task, stream=inbound.stream)
        exchange = Exchange(inbound, scope["headers"], lease, started, deadlines,
                            transcript_chunks=settings.handoff.transcript_chunks)
        writer = client_writer(scope)
        listener = None
        if writer is not None:  # the server says when the client is gone
            writer.on_client_gone(deadlines.client_gone)
        else:
            listener = asyncio.create_task(_watch_disconnect(receive, deadlines))
        deadlines.start()
        self.in_flight.exchanges.add(exchange)
        try:
            await self._run(exchange, send, writer, settings)
        except asyncio.CancelledError:
            # Ours (timeout, client gone) or the server's at the end of a graceful shutdown:
            # either way the client gets a proper ending and the backend an abort.
            task.uncancel()
            await self.endings.interrupted(exchange, send, deadlines.reason or SHUTDOWN)
        except GatewayError as exc:
            await self.endings.failed(exchange, send, exc)
            let_go(exc)
        except Exception:  # a bug: still end the response properly and keep serving
            log.exception("unexpected error relaying %s", inbound.path)
            await self.endings.failed(exchange, send, GatewayError("internal gateway error"))
        finally:
            self.in_flight.exchanges.discard(exchange)
            deadlines.stop()
            if listener is not None:
                listener.cancel()
            elif writer is not None:  # the callback holds the request's task: let it go
                writer.on_client_gone(None)
            if exchange.upstream is not None:
                exchange.upstream.close()
            self.endings.end_lease(exchange)
            if lease.circuit_changed and self.waiting is not None:  # arrivals may wait on it
                self.waiting.changed()
            backend = lease.backend.name
            if inbound.api == RESPONSES_API and inbound.rid and exchange.status == 200:
                self.responses.remember(inbound.rid, backend)
            self.metrics.e2e.labels(backend).observe(time.monotonic() - started)
            if settings.log.access:
                ttft = None if exchange.first_byte_at is None else exchange.first_byte_at - started
                moved_from = lease.moved_from.name if lease.moved_from is not None else None
                log_access(inbound.path, backend, lease.reason, exchange.status, ttft,
                           started, exchange.ended, exchange.tokens, moved_from,
                           exchange.continued_from)

    async def _run(self, exchange: Exchange, send: Send, writer: ClientWriter | None,
                   settings: Settings) -> None:
        self.in_flight.apply(exchange.lease.flip)  # the moves its admission caused, if any
        response, first = await self.attempts.run(exchange, send, settings)
        endings = self.endings
        if response.status >= 400:
            if exchange.committed:  # keep-alives went out: the status can no longer change
                detail = (first + await response.read())[:500].decode("utf-8", "replace")
                raise UpstreamStatus(response.status, exchange.lease.backend.name, detail)
            await endings.client_error(exchange, send, response, first)
            return
        if not exchange.inbound.stream:
            await endings.whole(exchange, send, response, first)
            return
        if not exchange.committed:
            await endings.commit(exchange, send, response.status, response.headers, STREAM_HEADERS)
        exchange.first_byte_at = time.monotonic()  # the first model output, keep-alives aside
        exchange.lease.first_byte(exchange.first_byte_at)
        self.metrics.observe_ttft(exchange.lease.backend.name,
                                  exchange.first_byte_at - exchange.started)
        await self.in_flight.relay_stream(exchange, send, response, first, writer, settings)
        await endings.end_stream(exchange, send)


async def _watch_disconnect(receive: Receive, deadlines: Deadlines) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            deadlines.kick(CLIENT_GONE)
            return
