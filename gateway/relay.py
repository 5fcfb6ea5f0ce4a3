"""Forward one request to a backend and stream the answer back, byte for byte.

`ProxyEndpoint` is a raw ASGI endpoint: no per-chunk framework layers between the upstream
read and the client write. The life of a request:

    read body -> parse once -> admit (decide + count) -> attempt on a backend
      -> [connect error, 5xx, or broken before the first byte: retry once on the other]
      -> commit: response headers + first bytes to the client -> relay chunks
      -> end: [DONE] from upstream, or an SSE error event + [DONE], or the client left
    finally: release the in-flight slot, abort upstream work the client no longer wants.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.config import BackendName, Settings
from gateway.errors import (
    BadRequest,
    GatewayError,
    MethodNotAllowed,
    NoBackend,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    UpstreamBroken,
    UpstreamError,
    UpstreamTimeout,
    openai_shaped,
)
from gateway.inbound import Headers, Inbound, bearer_token, parse_inbound, upstream_headers
from gateway.load import Lease, Router
from gateway.metrics import GatewayMetrics
from gateway.monitor import CircuitBreaker
from gateway.policy import RequestFacts, other
from gateway.server import BODY_WRITER, BodyWriter
from gateway.upstream import Upstream, UpstreamResponse
from gateway.watchdog import CLIENT_GONE, KEEPALIVE, Watchdog

log = logging.getLogger("mtp_gateway.relay")

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

_KEEPALIVE_COMMENT = b": keep-alive\n\n"
_EVENT_END = b"\n\n"
_USAGE = re.compile(rb'"prompt_tokens":\s*(\d+).*?"completion_tokens":\s*(\d+)', re.S)
_STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_SSE_CONTENT_TYPE = [(b"content-type", b"text/event-stream; charset=utf-8")]


SHUTDOWN = "shutdown"


class ShuttingDown(GatewayError):
    status, type, code, kind = 503, "server_error", "gateway_shutting_down", "shutdown"


class UpstreamStatus(UpstreamError):
    """The backend answered 5xx: OpenAI-shaped, keeping the backend's status."""

    kind = "status_5xx"

    def __init__(self, status: int, backend: str, detail: str) -> None:
        super().__init__(f"backend '{backend}' failed with HTTP {status}: {detail}")
        self.status = status


@dataclass
class Exchange:
    """One request on its way through: the facts, the lease, and what has been sent."""

    inbound: Inbound
    client_headers: Headers
    lease: Lease
    started: float
    watchdog: Watchdog
    committed: bool = False  # response headers went to the client: no more retries
    upstream: UpstreamResponse | None = None
    first_byte_at: float | None = None
    writer: BodyWriter | None = None  # the server's synchronous body writer, when it has one
    tail: bytes = b""  # an unfinished SSE event held back until its end arrives
    last_chunks: list[bytes] = field(default_factory=list)


class ProxyEndpoint:
    """The ASGI endpoint for every proxied path. Dependencies are given, never looked up."""

    def __init__(self, get_settings: Callable[[], Settings], router: Router, upstream: Upstream,
                 metrics: GatewayMetrics, breaker: CircuitBreaker,
                 served_models: Callable[[], set[str]]) -> None:
        self.get_settings = get_settings
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.breaker = breaker
        self.served_models = served_models
        self.background: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        settings = self.get_settings()
        try:
            if scope["method"] != "POST":
                raise _method_not_allowed()
            headers: Headers = scope["headers"]
            self._check_client_key(headers, settings)
            body = await _read_body(receive, settings.limits.max_body_bytes,
                                    settings.timeouts.idle_s)
            inbound = parse_inbound(
                scope["path"], headers, body,
                session_headers=settings.routing.session_headers,
                allow_pin=settings.routing.allow_pin_header,
            )
            self._check_model(inbound)
            if self.router.concurrency >= settings.limits.max_inflight:
                raise Overloaded("the gateway is at its in-flight limit; retry shortly",
                                 headers={"retry-after": "1"})
            admitted = self.router.admit(
                RequestFacts(self.router.sessions.get(inbound.session), inbound.pin), started)
            if not isinstance(admitted, Lease):
                raise NoBackend("no healthy backend: both are down or their circuits are open",
                                headers={"retry-after": "5"})
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.kind if exc.kind != "client" else exc.code).inc()
            await send_error(send, exc)
            return
        await self._serve(scope, receive, send, inbound, admitted, started, settings)

    def _check_client_key(self, headers: Headers, settings: Settings) -> None:
        keys = settings.auth.api_keys
        if keys and not _key_matches(bearer_token(headers), keys):
            raise Unauthorized("invalid or missing API key")

    def _check_model(self, inbound: Inbound) -> None:
        served = self.served_models()
        if inbound.model and served and inbound.model not in served:
            exc = BadRequest(f"The model '{inbound.model}' does not exist")
            exc.status, exc.code = 404, "model_not_found"
            raise exc

    async def _serve(self, scope: Scope, receive: Receive, send: Send, inbound: Inbound,
                     lease: Lease, started: float, settings: Settings) -> None:
        task = asyncio.current_task()
        assert task is not None  # always inside a task under an ASGI server
        watchdog = Watchdog(settings.timeouts, task, stream=inbound.stream)
        exchange = Exchange(inbound, scope["headers"], lease, started, watchdog,
                            writer=(scope.get("extensions") or {}).get(BODY_WRITER))
        listener = asyncio.create_task(_watch_disconnect(receive, watchdog))
        watchdog.start()
        try:
            await self._run(exchange, send, settings)
        except asyncio.CancelledError:
            # Ours (timeout, client gone) or the server's at the end of a graceful shutdown:
            # either way the client gets a proper ending and the backend an abort.
            task.uncancel()
            await self._interrupted(exchange, send, watchdog.reason or SHUTDOWN)
        except GatewayError as exc:
            await self._failed(exchange, send, exc)
        except Exception:  # a bug: still end the response properly and keep serving
            log.exception("unexpected error relaying %s", inbound.path)
            await self._failed(exchange, send, GatewayError("internal gateway error"))
        finally:
            watchdog.stop()
            listener.cancel()
            if exchange.upstream is not None:
                exchange.upstream.close()
            lease.release()
            self.router.remember_session(inbound.session, lease.backend)
            self.metrics.e2e.labels(lease.backend).observe(time.monotonic() - started)

    async def _run(self, exchange: Exchange, send: Send, settings: Settings) -> None:
        response, first = await self._attempt_with_retry(exchange, send, settings)
        if response.status >= 400:
            if exchange.committed:  # keep-alives went out: the status can no longer change
                detail = (first + await response.read())[:500].decode("utf-8", "replace")
                raise UpstreamStatus(response.status, exchange.lease.backend, detail)
            await self._pass_error(exchange, send, response, first)
            return
        if not exchange.inbound.stream:
            await self._relay_whole(exchange, send, response, first)
            return
        if not exchange.committed:
            await self._commit(exchange, send, response.status, response.headers, _STREAM_HEADERS)
        await self._send_chunk(exchange, send, first)
        writer = exchange.writer
        if writer is not None and writer.usable():
            await self._pump_stream(exchange, response, writer)
        else:
            await self._relay_stream(exchange, send, response)
        await self._end_stream(exchange, send)

    async def _attempt_with_retry(self, exchange: Exchange, send: Send,
                                  settings: Settings) -> tuple[UpstreamResponse, bytes]:
        lease = exchange.lease
        try:
            return await self._attempt(exchange, send, settings)
        except UpstreamError as exc:
            first, fallback = lease.backend, other(lease.backend)
            if exchange.committed or not self.router.health[fallback].accepting:
                self._count_failure(first, exc)
                raise
            self.metrics.retries.labels(first, fallback).inc()
            log.warning("retrying on %s after %s from %s", fallback, exc.kind, first)
            lease.move_to(fallback)
            # A 5xx is judged by the retry: if the other server fails the same request with a
            # 5xx too, the request is the cause (or both queues are full), not a broken server.
            # Counted against neither circuit, or a few such requests would open both and
            # turn every client away with 503s.
            first_to_blame = True
            try:
                return await self._attempt(exchange, send, settings)
            except UpstreamStatus as again:
                if isinstance(exc, UpstreamStatus):
                    first_to_blame = False
                    self._count_failure(fallback, again, against_circuit=False)
                raise
            finally:
                self._count_failure(first, exc, against_circuit=first_to_blame)

    async def _attempt(self, exchange: Exchange, send: Send,
                       settings: Settings) -> tuple[UpstreamResponse, bytes]:
        """Open the upstream response up to its first body bytes.

        A stream whose first token is slow (long prefill, queue) gets SSE keep-alive comments
        meanwhile, so idle-timeout proxies between the agent and the gateway keep it open."""
        opening = self._open(exchange, settings)
        keepalive_s = settings.timeouts.keepalive_s
        if not exchange.inbound.stream or keepalive_s <= 0:
            return await opening
        waiting = asyncio.ensure_future(opening)
        try:
            while not (await asyncio.wait({waiting}, timeout=keepalive_s))[0]:
                if not exchange.committed:
                    await self._commit(exchange, send, 200, _SSE_CONTENT_TYPE, _STREAM_HEADERS)
                await send({"type": "http.response.body", "body": _KEEPALIVE_COMMENT,
                            "more_body": True})
            return waiting.result()
        finally:
            waiting.cancel()

    async def _open(self, exchange: Exchange, settings: Settings) -> tuple[UpstreamResponse, bytes]:
        inbound, backend = exchange.inbound, exchange.lease.backend
        if exchange.upstream is not None:
            exchange.upstream.close()
            exchange.upstream = None
        target = settings.backends.get(backend)
        headers = upstream_headers(exchange.client_headers, target.api_key)
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
            self.breaker.success(backend)
            return response, body
        first = await response.next_chunk()
        if not first:
            raise UpstreamStatus(502, backend, "stream ended before any data")
        exchange.watchdog.got_bytes()
        self.breaker.success(backend)
        return response, first

    async def _pump_stream(self, exchange: Exchange, response: UpstreamResponse,
                           writer: BodyWriter) -> None:
        """The fast path: each piece the backend sends is framed and written to the client in
        the upstream connection's own callback. This task only waits for the end, writes
        keep-alives, and waits out a slow client (the backend's socket is paused meanwhile)."""
        watchdog, frame = exchange.watchdog, self._frame

        def relay(chunk: bytes) -> None:
            watchdog.got_bytes()
            framed = frame(exchange, chunk)
            if framed:
                writer.write(framed)
                if writer.paused:
                    response.pause_reading()

        response.pump(relay)
        while True:
            try:
                watchdog.reading = True
                ended = await response.pumped()
            except asyncio.CancelledError:
                if watchdog.reason != KEEPALIVE:
                    raise
                writer.write(_KEEPALIVE_COMMENT)
                watchdog.handled_keepalive()
                continue
            finally:
                watchdog.reading = False
            if ended:
                return
            await writer.drain()
            response.resume_reading()

    async def _relay_stream(self, exchange: Exchange, send: Send, response: UpstreamResponse) -> None:
        """The same relay by ASGI send, for servers without the body writer."""
        watchdog, next_chunk = exchange.watchdog, response.next_chunk
        while True:
            try:
                watchdog.reading = True
                chunk = await next_chunk()
            except asyncio.CancelledError:
                if watchdog.reason != KEEPALIVE:
                    raise
                await send({"type": "http.response.body", "body": _KEEPALIVE_COMMENT,
                            "more_body": True})
                watchdog.handled_keepalive()
                continue
            finally:
                watchdog.reading = False
            if not chunk:
                return
            watchdog.got_bytes()
            await self._send_chunk(exchange, send, chunk)

    async def _end_stream(self, exchange: Exchange, send: Send) -> None:
        if exchange.tail:
            raise UpstreamBroken(f"backend '{exchange.lease.backend}' ended the stream "
                                 "in the middle of an event")
        self._count_usage(exchange)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.metrics.responses.labels(exchange.lease.backend, "200").inc()

    async def _send_chunk(self, exchange: Exchange, send: Send, chunk: bytes) -> None:
        framed = self._frame(exchange, chunk)
        if framed:
            await send({"type": "http.response.body", "body": framed, "more_body": True})

    def _frame(self, exchange: Exchange, chunk: bytes) -> bytes:
        """What of `chunk` can go to the client now: whole SSE events only."""
        if exchange.first_byte_at is None:  # the first model output, keep-alives aside
            exchange.first_byte_at = time.monotonic()
            self.metrics.observe_ttft(exchange.lease.backend,
                                      exchange.first_byte_at - exchange.started)
        if exchange.tail:
            chunk, exchange.tail = exchange.tail + chunk, b""
        if not chunk.endswith(_EVENT_END):
            # Hold back a partial event so a later error event never lands inside it.
            cut = chunk.rfind(_EVENT_END) + 2
            chunk, exchange.tail = chunk[:cut], chunk[cut:]
            if not chunk:
                return chunk
        last = exchange.last_chunks
        last.append(chunk)
        if len(last) > 2:
            del last[0]
        return chunk

    async def _relay_whole(self, exchange: Exchange, send: Send, response: UpstreamResponse,
                           first: bytes) -> None:
        body = first  # _open read it whole
        exchange.last_chunks = [body[-4096:]]
        self._count_usage(exchange)
        headers = [*response.headers, (b"content-length", str(len(body)).encode())]
        await self._commit(exchange, send, response.status, headers, [])
        exchange.first_byte_at = time.monotonic()
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self.metrics.responses.labels(exchange.lease.backend, str(response.status)).inc()

    async def _pass_error(self, exchange: Exchange, send: Send, response: UpstreamResponse,
                          first: bytes) -> None:
        """The backend's own 4xx answer goes to the client, in OpenAI's error shape."""
        body = openai_shaped(first + await response.read())
        headers = [*response.headers, (b"content-length", str(len(body)).encode())]
        await self._commit(exchange, send, response.status, headers, [])
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self.metrics.responses.labels(exchange.lease.backend, str(response.status)).inc()

    async def _commit(self, exchange: Exchange, send: Send, status: int,
                      headers: list[tuple[bytes, bytes]], extra: list[tuple[bytes, bytes]]) -> None:
        lease = exchange.lease
        exchange.committed = True
        await send({"type": "http.response.start", "status": status, "headers": [
            *headers, *extra,
            (b"x-gateway-backend", lease.backend.encode()),
            (b"x-gateway-route-reason", lease.reason.encode()),
        ]})

    async def _interrupted(self, exchange: Exchange, send: Send, reason: str) -> None:
        backend = exchange.lease.backend
        if reason == CLIENT_GONE:
            self._abort_upstream(exchange)
            phase = "mid_stream" if exchange.first_byte_at is not None else "before_first_byte"
            self.metrics.disconnects.labels(backend, phase).inc()
            self.metrics.responses.labels(backend, "499").inc()
        elif reason == SHUTDOWN:
            await self._failed(exchange, send, ShuttingDown("the gateway is shutting down; retry"))
        else:
            exc = UpstreamTimeout(f"backend '{backend}' {reason.replace('_', ' ')}", kind=reason)
            await self._failed(exchange, send, exc)

    async def _failed(self, exchange: Exchange, send: Send, exc: GatewayError) -> None:
        """End the request with an error: counted against the backend once, upstream aborted."""
        backend = exchange.lease.backend
        if isinstance(exc, UpstreamError) and not exc.counted:
            self._count_failure(backend, exc)
        self._abort_upstream(exchange)
        self.metrics.responses.labels(backend, str(exc.status)).inc()
        if not exchange.committed:
            await send_error(send, exc, extra=[(b"x-gateway-backend", backend.encode())])
            return
        if exchange.inbound.stream:
            prefix = b"\n\n" if exchange.tail else b""
            await send({"type": "http.response.body", "body": prefix + exc.sse_event(),
                        "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _count_failure(self, backend: BackendName, exc: GatewayError, *,
                       against_circuit: bool = True) -> None:
        exc.counted = True  # whatever path it ends by, a failure is counted once
        self.metrics.upstream_errors.labels(backend, exc.kind).inc()
        if against_circuit:
            self.breaker.failure(backend)

    def _count_usage(self, exchange: Exchange) -> None:
        match = _USAGE.search(b"".join(exchange.last_chunks))
        if match:
            backend = exchange.lease.backend
            self.metrics.prompt_tokens.labels(backend).inc(int(match.group(1)))
            self.metrics.completion_tokens.labels(backend).inc(int(match.group(2)))

    def _abort_upstream(self, exchange: Exchange) -> None:
        """Stop the backend's work now instead of SGLang's own 2 s after the socket closes."""
        if exchange.upstream is not None:
            exchange.upstream.close()
            exchange.upstream = None
        rid = exchange.inbound.rid
        if rid is None:
            return
        task = asyncio.create_task(self._post_abort(exchange.lease.backend, rid))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _post_abort(self, backend: BackendName, rid: str) -> None:
        target = self.get_settings().backends.get(backend)
        headers = [(b"authorization", f"Bearer {target.api_key}".encode())] if target.api_key else []
        try:
            await self.upstream.post_json(target.url + "/abort_request",
                                          json.dumps({"rid": rid}).encode(), headers, 5.0)
        except GatewayError as exc:
            log.info("abort of %s on %s failed: %s", rid, backend, exc.message)


def _key_matches(given: str | None, keys: tuple[str, ...]) -> bool:
    if given is None:
        return False
    candidate = given.encode()
    # Compare against every key so the time taken does not tell which one nearly matched.
    return any([hmac.compare_digest(candidate, key.encode()) for key in keys])


def _method_not_allowed() -> GatewayError:
    return MethodNotAllowed("method not allowed; use POST", headers={"allow": "POST"})


async def _read_body(receive: Receive, limit: int, idle_s: float) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(idle_s):  # a half-sent body must not hold a task forever
                message = await receive()
        except TimeoutError:
            # The rest of the body may still come: the connection cannot carry another request.
            raise RequestTimeout(f"the request body stopped arriving for {idle_s} s",
                                 headers={"connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise BadRequest("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _watch_disconnect(receive: Receive, watchdog: Watchdog) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            watchdog.kick(CLIENT_GONE)
            return


async def send_error(send: Send, exc: GatewayError,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = exc.to_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})
