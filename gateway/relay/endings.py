"""How a proxied request ends: the response's head (`commit`), each way it can end (a whole
answer, the backend's own 4xx, a stream's end, an error ending in the API's shape, the client
gone), the usage it reported, and the lease's end with its verdicts."""

from __future__ import annotations

import logging
import re
import time

from gateway.apis.errors import (
    EndedByTurn,
    GatewayError,
    ShuttingDown,
    UpstreamBroken,
    UpstreamError,
    UpstreamStreamError,
    UpstreamTimeout,
    openai_shaped,
)
from gateway.apis.streams import ending, ends_in_error
from gateway.metrics import GatewayMetrics
from gateway.relay.aborts import Aborts
from gateway.relay.asgi import RawHeaders, Send, send_error
from gateway.relay.deadlines import CLIENT_GONE
from gateway.relay.exchange import Exchange, failure_of
from gateway.relay.pump import last_events
from gateway.routing.lease import Failure, Outcome
from gateway.upstream.client import UpstreamResponse

log = logging.getLogger("mtp_gateway.relay")

# Why a request was interrupted, beside the watchdog's reasons: the server's shutdown, and a
# turns pair handing its memory over (InFlight.end_running).
SHUTDOWN, MEMORY_TURN = "shutdown", "memory_turn"
_USAGE = re.compile(rb'"prompt_tokens":\s*(\d+).*?"completion_tokens":\s*(\d+)', re.S)


class Endings:
    def __init__(self, metrics: GatewayMetrics, aborts: Aborts) -> None:
        self.metrics = metrics
        self.aborts = aborts

    async def commit(self, exchange: Exchange, send: Send, status: int, headers: RawHeaders,
                     extra: RawHeaders) -> None:
        """The response's head goes to the client: no retry after this."""
        lease = exchange.lease
        exchange.committed = True
        exchange.status = status
        await send({"type": "http.response.start", "status": status, "headers": [
            *headers, *extra,
            (b"x-gateway-backend", lease.backend.name.encode()),
            (b"x-gateway-route-reason", lease.reason.encode()),
        ]})

    async def whole(self, exchange: Exchange, send: Send, response: UpstreamResponse,
                    body: bytes) -> None:
        """A non-streamed answer, read whole by the attempt."""
        exchange.recent = [body[-4096:]]
        self.count_usage(exchange)
        headers = [*response.headers, (b"content-length", str(len(body)).encode())]
        await self.commit(exchange, send, response.status, headers, [])
        exchange.first_byte_at = time.monotonic()
        await send({"type": "http.response.body", "body": body, "more_body": False})
        exchange.settle(Outcome.SUCCESS)
        self.metrics.responses.labels(exchange.lease.backend.name, str(response.status)).inc()

    async def client_error(self, exchange: Exchange, send: Send, response: UpstreamResponse,
                           first: bytes) -> None:
        """The backend's own 4xx answer goes to the client; SGLang's flat OpenAI errors nested
        under "error" as OpenAI clients expect (its Anthropic and Responses ones already are)."""
        body = openai_shaped(first + await response.read())
        headers = [*response.headers, (b"content-length", str(len(body)).encode())]
        await self.commit(exchange, send, response.status, headers, [])
        await send({"type": "http.response.body", "body": body, "more_body": False})
        exchange.settle(Outcome.SUCCESS, "client_error")  # the backend is up and judged it
        self.metrics.responses.labels(exchange.lease.backend.name, str(response.status)).inc()

    async def end_stream(self, exchange: Exchange, send: Send) -> None:
        """The backend ended the stream: whole, or with an error event of its own."""
        backend = exchange.lease.backend.name
        if exchange.framer.holding:
            raise UpstreamBroken(f"backend '{backend}' ended the stream in the middle of an event")
        self.count_usage(exchange)
        if exchange.refused:  # its refusal passed on as it was sent: the failure is set
            exchange.settle(Outcome.BACKEND_FAILURE, "backend_error")
        elif ends_in_error(exchange.inbound.api, last_events(exchange)):
            exchange.settle(Outcome.BACKEND_FAILURE, "backend_error",
                            Failure(UpstreamStreamError.kind))
        else:
            exchange.settle(Outcome.SUCCESS)  # a whole stream, not its first byte
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.metrics.responses.labels(backend, "200").inc()

    async def interrupted(self, exchange: Exchange, send: Send, reason: str) -> None:
        """The request's task was cancelled: the client left, a timeout, or the shutdown."""
        backend = exchange.lease.backend.name
        if reason == CLIENT_GONE:
            exchange.settle(Outcome.CLIENT_GONE, CLIENT_GONE)
            self.aborts.abort(exchange)
            phase = "mid_stream" if exchange.first_byte_at is not None else "before_first_byte"
            self.metrics.disconnects.labels(backend, phase).inc()
            self.metrics.responses.labels(backend, "499").inc()
            exchange.status = exchange.status or 499
        elif reason == SHUTDOWN:
            await self.failed(exchange, send, ShuttingDown("the gateway is shutting down; retry"))
        elif reason == MEMORY_TURN:
            await self.failed(exchange, send, EndedByTurn(
                f"backend '{backend}' handed its GPU memory to the other server of its pair "
                "before this request finished; retry", headers={"retry-after": "1"}))
        else:
            exc = UpstreamTimeout(f"backend '{backend}' {reason.replace('_', ' ')}", kind=reason)
            await self.failed(exchange, send, exc)

    async def failed(self, exchange: Exchange, send: Send, exc: GatewayError) -> None:
        """End the request with an error, upstream aborted. A backend's failure when it is an
        UpstreamError; anything else (a client write, a bug, the shutdown) is the gateway's."""
        backend, inbound = exchange.lease.backend.name, exchange.inbound
        if isinstance(exc, UpstreamError):
            exchange.settle(Outcome.BACKEND_FAILURE, exc.kind, failure_of(exc))
        else:
            exchange.settle(Outcome.GATEWAY_ERROR, exc.kind)
        self.aborts.abort(exchange)
        self.metrics.responses.labels(backend, str(exc.status)).inc()
        if not exchange.committed:
            exchange.status = exc.status
            await send_error(send, exc, extra=[(b"x-gateway-backend", backend.encode())],
                             api=inbound.api)
            return
        if inbound.stream:
            recent = last_events(exchange)
            body = ending(inbound.api, exc, recent, response_id=inbound.rid, model=inbound.model)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def count_usage(self, exchange: Exchange) -> None:
        """The usage the backend reported, in its last events: for the access log, the
        token counters and the learned crossover's speed sample."""
        match = _USAGE.search(last_events(exchange))
        if match:
            backend = exchange.lease.backend.name
            prompt, completion = int(match.group(1)), int(match.group(2))
            exchange.tokens = (prompt, completion)
            exchange.lease.output_tokens = completion  # a speed sample for the learned crossover
            self.metrics.prompt_tokens.labels(backend).inc(prompt)
            self.metrics.completion_tokens.labels(backend).inc(completion)

    def end_lease(self, exchange: Exchange) -> None:
        """The lease ends with how the request ended: the one place where failures are judged
        and circuits change. Anything not settled is the gateway's own error, never the
        backend's."""
        outcome = exchange.outcome or Outcome.GATEWAY_ERROR
        if exchange.refused:  # the backend failed it, whatever happened next
            outcome = Outcome.BACKEND_FAILURE
        for verdict in exchange.lease.end(outcome, time.monotonic(), exchange.failure):
            backend = verdict.backend
            self.metrics.upstream_errors.labels(backend.name, verdict.failure.kind).inc()
            if verdict.opened:
                log.warning("circuit for %s opened after %d failures", backend.name,
                            backend.circuit.failures)
