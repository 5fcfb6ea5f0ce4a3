"""Forward one request to a backend and stream the answer back, byte for byte.

`ProxyEndpoint` is a raw ASGI endpoint: no per-chunk framework layers between the upstream
read and the client write. The life of a request:

    read body -> parse once -> admit (decide + count) -> attempt on a backend
      -> [connect error, 5xx, broken before the first byte, or a stream whose first event
          is an error: retry once on the other]
      -> commit: response headers + first events to the client -> relay chunks (whole events)
      -> end: the backend's own end, or an error ending in the API's shape, or the client left
    finally: release the in-flight slot, abort upstream work the client no longer wants,
             one access-log line.
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

from gateway.apis import OPENAI, RESPONSES, api_of
from gateway.backends import BackendState
from gateway.client_io import ClientWriter, client_writer
from gateway.config import Settings
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
from gateway.inbound import (
    PUT_PATHS,
    Headers,
    Inbound,
    bearer_token,
    parse_inbound,
    upstream_headers,
)
from gateway.metrics import GatewayMetrics
from gateway.placement import prompt_tokens_from_bytes
from gateway.pool import Ask, Failure, Lease, Outcome, Pool, SessionMap, Verdict
from gateway.sse import EventFramer, split_events
from gateway.streams import ending, ends_in_error, event_error, leads_in
from gateway.turns.waiting import WaitingRoom
from gateway.upstream import Upstream, UpstreamResponse
from gateway.watchdog import CLIENT_GONE, KEEPALIVE, Watchdog

log = logging.getLogger("mtp_gateway.relay")
access = logging.getLogger("mtp_gateway.access")

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

_KEEPALIVE_COMMENT = b": keep-alive\n\n"
STORED_RESPONSES = 10_000  # response ids remembered for affinity, least recently used forgotten
RECENT_CHUNKS = 4  # kept for usage and the ending: SGLang's error, usage and [DONE] come apart
_USAGE = re.compile(rb'"prompt_tokens":\s*(\d+).*?"completion_tokens":\s*(\d+)', re.S)
_STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_SSE_CONTENT_TYPE = [(b"content-type", b"text/event-stream; charset=utf-8")]


SHUTDOWN = "shutdown"
MEMORY_TURN = "memory_turn"


class ShuttingDown(GatewayError):
    status, type, code, kind = 503, "server_error", "gateway_shutting_down", "shutdown"


class EndedByTurn(GatewayError):
    """A turns pair handed its memory over before this request finished (gateway/turns)."""

    status, type, code, kind = 503, "server_error", "memory_turn", "memory_turn"


class UpstreamStatus(UpstreamError):
    """The backend answered 5xx: OpenAI-shaped, keeping the backend's status."""

    kind = "status_5xx"

    def __init__(self, status: int, backend: str, detail: str) -> None:
        super().__init__(f"backend '{backend}' failed with HTTP {status}: {detail}")
        self.status = status


class UpstreamRefused(UpstreamError):
    """A stream whose first event is an error (SGLang's full queue or abort, in a 200).

    Nothing has gone to the client: it may be retried elsewhere. When it cannot be, the
    client gets the backend's own stream as it is: its error, in its API's shape."""

    kind = "stream_error"

    def __init__(self, status: int, backend: str, detail: str, response: UpstreamResponse,
                 head: bytes) -> None:
        super().__init__(f"backend '{backend}' refused the request in its stream "
                         f"({status}): {detail}")
        self.status = status
        self.response = response
        self.head = head


class UpstreamStreamError(UpstreamError):
    """The backend ended a stream with an error event of its own, after its first byte."""

    kind = "stream_error"


def _judged_by_retry(exc: UpstreamError) -> bool:
    """The backend answered, with an error (a 5xx, or one in its stream's first event): when
    the other server answers the same request the same way, the request is the cause."""
    return isinstance(exc, UpstreamStatus | UpstreamRefused)


def _failure(exc: UpstreamError) -> Failure:
    return Failure(exc.kind, answered=_judged_by_retry(exc))


def _as_sent(exchange: Exchange, exc: UpstreamError) -> tuple[UpstreamResponse, bytes]:
    """A refusal in a stream reaches the client as the backend sent it; the rest is raised."""
    if isinstance(exc, UpstreamRefused):
        exchange.refused = True
        return exc.response, exc.head
    raise exc


@dataclass(eq=False)
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
    writer: ClientWriter | None = None  # the server's synchronous body writer, when it has one
    framer: EventFramer = field(default_factory=EventFramer)  # whole events out, one per attempt
    last_chunks: list[bytes] = field(default_factory=list)
    refused: bool = False  # the stream relayed is the backend's own refusal
    outcome: Outcome | None = None  # how the request ended, for the lease (None: a bug)
    failure: Failure | None = None  # the last attempt's failure, with BACKEND_FAILURE
    status: int = 0  # what the client got, for the access log
    ended: str = "complete"  # how it ended, for the access log
    tokens: tuple[int, int] | None = None  # prompt and completion tokens, when usage was seen
    # While a stream waits for its first event (movable at a flip, see ProxyEndpoint.move):
    opening: asyncio.Future[tuple[UpstreamResponse, bytes]] | None = None
    moved: asyncio.Future[None] | None = None  # resolved by a planned move
    # Of the backend's bytes this attempt took, some end inside an event (the answer may have
    # begun): not movable. Whole lead-in events (Responses' response.created) say nothing yet.
    mid_event: bool = False


class ProxyEndpoint:
    """The ASGI endpoint for every proxied path. Dependencies are given, never looked up."""

    def __init__(self, get_settings: Callable[[], Settings], pool: Pool, upstream: Upstream,
                 metrics: GatewayMetrics) -> None:
        self.get_settings = get_settings
        self.pool = pool
        self.upstream = upstream
        self.metrics = metrics
        # Response id -> the backend that stored it: SGLang keeps a response (for
        # previous_response_id, GET and cancel) only on the server that made it.
        self.stored = SessionMap(STORED_RESPONSES)
        self.background: set[asyncio.Task[None]] = set()
        # Streams waiting for their first event, per backend, in arrival order: what a
        # planned move at a pair's flip can take.
        self.unstarted: dict[BackendState, dict[Exchange, None]] = {}
        self.exchanges: set[Exchange] = set()  # every request relayed now (a turn ends some)
        self.waiting: WaitingRoom | None = None  # turns pairs: arrivals wait for a turn here

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        settings = self.get_settings()
        api = api_of(scope["path"])
        try:
            if scope["method"] != "POST" and not (
                    scope["method"] == "PUT" and scope["path"] in PUT_PATHS):
                raise _method_not_allowed(scope["path"])
            headers: Headers = scope["headers"]
            self.check_client_key(headers, settings)
            body = await _read_body(receive, settings.limits.max_body_bytes,
                                    settings.timeouts.idle_s)
            inbound = parse_inbound(
                scope["path"], headers, body,
                session_headers=settings.routing.session_headers,
                allow_pin=settings.routing.allow_pin_header,
            )
            if self.pool.concurrency >= settings.limits.max_inflight:
                raise Overloaded("the gateway is at its in-flight limit; retry shortly",
                                 headers={"retry-after": "1"})
            ask = Ask(inbound.session, inbound.pin, self.stored.get(inbound.previous_response_id),
                      prompt_tokens_from_bytes(len(body)))
            admitted = self.pool.admit(ask, started)
            if self.waiting is not None and _waits_for_turn(admitted):
                admitted = await self.waiting.admit(
                    lambda: self.pool.admit(ask, time.monotonic()), _waits_for_turn)
            if not isinstance(admitted, Lease):
                raise NoBackend("no healthy backend: all are down or their circuits are open",
                                headers={"retry-after": "5"})
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.kind if exc.kind != "client" else exc.code).inc()
            await send_error(send, exc, api=api)
            if settings.log.access:
                log_access(scope["path"], None, None, exc.status, None, started, "rejected", None)
            return
        await self._serve(scope, receive, send, inbound, admitted, started, settings)

    def check_client_key(self, headers: Headers, settings: Settings) -> None:
        keys = settings.auth.api_keys
        if keys and not _key_matches(bearer_token(headers), keys):
            raise Unauthorized("invalid or missing API key")

    async def _serve(self, scope: Scope, receive: Receive, send: Send, inbound: Inbound,
                     lease: Lease, started: float, settings: Settings) -> None:
        task = asyncio.current_task()
        assert task is not None  # always inside a task under an ASGI server
        watchdog = Watchdog(settings.timeouts, task, stream=inbound.stream)
        exchange = Exchange(inbound, scope["headers"], lease, started, watchdog,
                            writer=client_writer(scope))
        listener = asyncio.create_task(_watch_disconnect(receive, watchdog))
        watchdog.start()
        self.exchanges.add(exchange)
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
            self.exchanges.discard(exchange)
            watchdog.stop()
            listener.cancel()
            if exchange.upstream is not None:
                exchange.upstream.close()
            self._end(exchange)
            backend = lease.backend.name
            if inbound.api == RESPONSES and inbound.rid and exchange.status == 200:
                self.stored.put(inbound.rid, backend)
            self.metrics.e2e.labels(backend).observe(time.monotonic() - started)
            if settings.log.access:
                ttft = None if exchange.first_byte_at is None else exchange.first_byte_at - started
                moved_from = lease.moved_from.name if lease.moved_from is not None else None
                log_access(inbound.path, backend, lease.reason, exchange.status, ttft,
                           started, exchange.ended, exchange.tokens, moved_from)

    def _end(self, exchange: Exchange) -> None:
        """The lease ends with how the request ended: the one place where failures are judged
        and circuits change. Anything not settled is the gateway's own error, never the
        backend's."""
        lease = exchange.lease
        outcome = exchange.outcome or Outcome.GATEWAY_ERROR
        if exchange.refused:  # the backend failed it, whatever happened next
            outcome = Outcome.BACKEND_FAILURE
        verdicts = lease.end(outcome, time.monotonic(), exchange.failure)
        for verdict in verdicts:
            self._count_failure(verdict)

    def _count_failure(self, verdict: Verdict) -> None:
        backend = verdict.backend
        self.metrics.upstream_errors.labels(backend.name, verdict.failure.kind).inc()
        if verdict.opened:
            log.warning("circuit for %s opened after %d failures", backend.name,
                        backend.circuit.failures)

    async def _run(self, exchange: Exchange, send: Send, settings: Settings) -> None:
        self.move_unstarted()  # no await since the admission: its flip, if it made one
        response, first = await self._attempt_with_retry(exchange, send, settings)
        if response.status >= 400:
            if exchange.committed:  # keep-alives went out: the status can no longer change
                detail = (first + await response.read())[:500].decode("utf-8", "replace")
                raise UpstreamStatus(response.status, exchange.lease.backend.name, detail)
            await self._pass_error(exchange, send, response, first)
            return
        if not exchange.inbound.stream:
            await self._relay_whole(exchange, send, response, first)
            return
        if not exchange.committed:
            await self._commit(exchange, send, response.status, response.headers, _STREAM_HEADERS)
        exchange.first_byte_at = time.monotonic()  # the first model output, keep-alives aside
        exchange.lease.first_byte(exchange.first_byte_at)
        self.metrics.observe_ttft(exchange.lease.backend.name,
                                  exchange.first_byte_at - exchange.started)
        await self._send_events(exchange, send, first)
        writer = exchange.writer
        if writer is not None and writer.usable():
            self.metrics.relayed_streams.labels("writer").inc()
            await self._pump_stream(exchange, response, writer)
        else:
            self.metrics.relayed_streams.labels("send").inc()
            await self._relay_stream(exchange, send, response)
        await self._end_stream(exchange, send)

    async def _attempt_with_retry(self, exchange: Exchange, send: Send,
                                  settings: Settings) -> tuple[UpstreamResponse, bytes]:
        """One attempt, and when it fails before anything went to the client, the routing
        decides again without the failed server. An error answer (a 5xx, or an error as a
        stream's first event) is judged by the retry when the lease ends: if the next server
        answers the same request with an error too, the request is the cause (or every queue
        is full), not a broken server, and neither circuit counts it."""
        lease = exchange.lease
        try:
            return await self._attempt(exchange, send, settings)
        except UpstreamError as exc:
            first = lease.backend
            fallback = None if exchange.committed else \
                lease.retry_elsewhere(_failure(exc), time.monotonic())
            if fallback is None:
                return self._no_retry(exchange, exc)
            self.metrics.retries.labels(first.name, fallback.name).inc()
            log.warning("retrying on %s after %s from %s", fallback.name, exc.kind, first.name)
            self.move_unstarted()  # the retry's decision may have flipped the mode
        try:
            return await self._attempt(exchange, send, settings)
        except UpstreamError as again:
            return self._no_retry(exchange, again)

    @staticmethod
    def _no_retry(exchange: Exchange, exc: UpstreamError) -> tuple[UpstreamResponse, bytes]:
        """The request ends with this failure: a refusal in a stream reaches the client as the
        backend sent it; any other failure is raised."""
        exchange.failure = _failure(exc)
        return _as_sent(exchange, exc)

    async def _attempt(self, exchange: Exchange, send: Send,
                       settings: Settings) -> tuple[UpstreamResponse, bytes]:
        """Open the upstream response up to its first body bytes.

        A stream whose first token is slow (long prefill, queue) gets SSE keep-alive comments
        meanwhile, so idle-timeout proxies between the agent and the gateway keep it open.
        Until its first event a stream can be moved (`move_unstarted`): it then opens again,
        whole, on the server the move gave its lease."""
        if not exchange.inbound.stream:
            return await self._open(exchange, settings)
        while True:
            opened = await self._open_movable(exchange, send, settings)
            if opened is not None:
                return opened

    async def _open_movable(self, exchange: Exchange, send: Send, settings: Settings
                            ) -> tuple[UpstreamResponse, bytes] | None:
        """One opening of a stream, raced against a planned move (None: it was moved). Only
        the wait for the first event races: the relay of the chunks after it is untouched."""
        opening = exchange.opening = asyncio.ensure_future(self._open(exchange, settings))
        moved = exchange.moved = asyncio.get_running_loop().create_future()
        exchange.mid_event = False
        unstarted = self.unstarted.setdefault(exchange.lease.backend, {})
        unstarted[exchange] = None
        keepalive_s = settings.timeouts.keepalive_s or None
        try:
            while True:
                await asyncio.wait((opening, moved), timeout=keepalive_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                if moved.done():
                    await _unwind(opening)  # its upstream was closed and aborted by the move
                    return None
                if opening.done():
                    return opening.result()
                if not exchange.committed:
                    await self._commit(exchange, send, 200, _SSE_CONTENT_TYPE, _STREAM_HEADERS)
                await send({"type": "http.response.body", "body": _KEEPALIVE_COMMENT,
                            "more_body": True})
        finally:
            del unstarted[exchange]
            exchange.opening = exchange.moved = None
            opening.cancel()

    def move_unstarted(self) -> None:
        """At a pair's flip to plain, streams on its MTP server that have had no byte move to
        its plain server, as many as the pool plans (`routing.move_unstarted`). The newest
        first: they are surely queued behind MTP's running cap, while the oldest may be
        prefilling already; those chosen move in arrival order, so plain queues them in it."""
        now = time.monotonic()
        for name, moves in self.pool.take_moves(now).items():
            pair = self.pool.pairs[name]
            source, target = pair.backends["mtp"], pair.backends["plain"]
            candidates = [e for e in self.unstarted.get(source, ()) if _movable(e, source, target)]
            chosen = candidates[max(0, len(candidates) - moves.not_started):]
            for exchange in chosen:
                self._move(exchange, target, now)

    def move_all_unstarted(self, source: BackendState, target: BackendState) -> int:
        """A turn: every stream on `source` that has had no byte moves to `target` (which
        holds new requests while paused: SGLang's tokenizer_manager.py:938-939)."""
        now = time.monotonic()
        chosen = [e for e in self.unstarted.get(source, ()) if _movable(e, source, target)]
        for exchange in chosen:
            self._move(exchange, target, now)
        return len(chosen)

    def end_running(self, source: BackendState, why: str) -> int:
        """A turn: every request still on `source` ends now, with an error in its API's
        shape (EndedByTurn), its upstream aborted."""
        ending = [e for e in self.exchanges if e.lease.backend is source and not e.lease.ended]
        for exchange in ending:
            exchange.watchdog.kick(MEMORY_TURN)
        return len(ending)

    def _move(self, exchange: Exchange, target: BackendState, now: float) -> None:
        """Cancel the attempt where it waits (SGLang frees its queue slot at the abort, not at
        its own disconnect check) and hand the lease to `target`; the request's task opens it
        there when it wakes."""
        source = exchange.lease.backend
        assert exchange.opening is not None and exchange.moved is not None
        exchange.opening.cancel()  # its next step is the end: nothing more is sent or read
        self._abort_upstream(exchange)
        exchange.lease.move_to(target, now)
        exchange.moved.set_result(None)
        self.metrics.moves.labels(source.name, target.name).inc()

    async def _open(self, exchange: Exchange, settings: Settings) -> tuple[UpstreamResponse, bytes]:
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
                    raise UpstreamRefused(status, backend, detail, response, head)
                return head
            exchange.mid_event = framer.holding  # only lead-ins so far: still movable, if whole

    async def _pump_stream(self, exchange: Exchange, response: UpstreamResponse,
                           writer: ClientWriter) -> None:
        """The fast path: each piece the backend sends is framed and written to the client in
        the upstream connection's own callback. This task only waits for the end, writes
        keep-alives, and waits out a slow client (the backend's socket is paused meanwhile)."""
        watchdog, feed, recent = exchange.watchdog, exchange.framer.feed, exchange.last_chunks

        def relay(chunk: bytes) -> None:
            watchdog.got_bytes()
            events = feed(chunk)
            if events:
                recent.append(events)
                if len(recent) > RECENT_CHUNKS:
                    del recent[0]
                writer.write(events)
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
        watchdog, next_chunk, feed = exchange.watchdog, response.next_chunk, exchange.framer.feed
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
            await self._send_events(exchange, send, feed(chunk))

    async def _end_stream(self, exchange: Exchange, send: Send) -> None:
        backend = exchange.lease.backend.name
        if exchange.framer.holding:
            raise UpstreamBroken(f"backend '{backend}' ended the stream in the middle of an event")
        self._count_usage(exchange)
        if exchange.refused:  # its refusal passed on as it was sent: the failure is set
            exchange.ended, exchange.outcome = "backend_error", Outcome.BACKEND_FAILURE
        elif ends_in_error(exchange.inbound.api, b"".join(exchange.last_chunks)):
            exchange.ended, exchange.outcome = "backend_error", Outcome.BACKEND_FAILURE
            exchange.failure = Failure(UpstreamStreamError.kind)
        else:
            exchange.outcome = Outcome.SUCCESS  # a whole stream, not its first byte
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.metrics.responses.labels(backend, "200").inc()

    async def _send_events(self, exchange: Exchange, send: Send, events: bytes) -> None:
        if events:
            recent = exchange.last_chunks
            recent.append(events)
            if len(recent) > RECENT_CHUNKS:
                del recent[0]
            await send({"type": "http.response.body", "body": events, "more_body": True})

    async def _relay_whole(self, exchange: Exchange, send: Send, response: UpstreamResponse,
                           first: bytes) -> None:
        body = first  # _open read it whole
        exchange.last_chunks = [body[-4096:]]
        self._count_usage(exchange)
        headers = [*response.headers, (b"content-length", str(len(body)).encode())]
        await self._commit(exchange, send, response.status, headers, [])
        exchange.first_byte_at = time.monotonic()
        await send({"type": "http.response.body", "body": body, "more_body": False})
        exchange.outcome = Outcome.SUCCESS
        self.metrics.responses.labels(exchange.lease.backend.name, str(response.status)).inc()

    async def _pass_error(self, exchange: Exchange, send: Send, response: UpstreamResponse,
                          first: bytes) -> None:
        """The backend's own 4xx answer goes to the client; SGLang's flat OpenAI errors nested
        under "error" as OpenAI clients expect (its Anthropic and Responses ones already are)."""
        body = openai_shaped(first + await response.read())
        headers = [*response.headers, (b"content-length", str(len(body)).encode())]
        await self._commit(exchange, send, response.status, headers, [])
        await send({"type": "http.response.body", "body": body, "more_body": False})
        exchange.ended = "client_error"
        exchange.outcome = Outcome.SUCCESS  # the backend is up and judged the request
        self.metrics.responses.labels(exchange.lease.backend.name, str(response.status)).inc()

    async def _commit(self, exchange: Exchange, send: Send, status: int,
                      headers: list[tuple[bytes, bytes]], extra: list[tuple[bytes, bytes]]) -> None:
        lease = exchange.lease
        exchange.committed = True
        exchange.status = status
        await send({"type": "http.response.start", "status": status, "headers": [
            *headers, *extra,
            (b"x-gateway-backend", lease.backend.name.encode()),
            (b"x-gateway-route-reason", lease.reason.encode()),
        ]})

    async def _interrupted(self, exchange: Exchange, send: Send, reason: str) -> None:
        backend = exchange.lease.backend.name
        if reason == CLIENT_GONE:
            exchange.outcome = Outcome.CLIENT_GONE
            self._abort_upstream(exchange)
            phase = "mid_stream" if exchange.first_byte_at is not None else "before_first_byte"
            self.metrics.disconnects.labels(backend, phase).inc()
            self.metrics.responses.labels(backend, "499").inc()
            exchange.ended, exchange.status = CLIENT_GONE, exchange.status or 499
        elif reason == SHUTDOWN:
            await self._failed(exchange, send, ShuttingDown("the gateway is shutting down; retry"))
        elif reason == MEMORY_TURN:
            await self._failed(exchange, send, EndedByTurn(
                f"backend '{backend}' handed its GPU memory to the other server of its pair "
                "before this request finished; retry", headers={"retry-after": "1"}))
        else:
            exc = UpstreamTimeout(f"backend '{backend}' {reason.replace('_', ' ')}", kind=reason)
            await self._failed(exchange, send, exc)

    async def _failed(self, exchange: Exchange, send: Send, exc: GatewayError) -> None:
        """End the request with an error, upstream aborted. A backend's failure when it is an
        UpstreamError; anything else (a client write, a bug, the shutdown) is the gateway's."""
        backend, inbound = exchange.lease.backend.name, exchange.inbound
        if isinstance(exc, UpstreamError):
            exchange.outcome, exchange.failure = Outcome.BACKEND_FAILURE, _failure(exc)
        else:
            exchange.outcome = Outcome.GATEWAY_ERROR
        self._abort_upstream(exchange)
        self.metrics.responses.labels(backend, str(exc.status)).inc()
        exchange.ended = exc.kind
        if not exchange.committed:
            exchange.status = exc.status
            await send_error(send, exc, extra=[(b"x-gateway-backend", backend.encode())],
                             api=inbound.api)
            return
        if inbound.stream:
            recent = b"".join(exchange.last_chunks)
            body = ending(inbound.api, exc, recent, response_id=inbound.rid, model=inbound.model)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _count_usage(self, exchange: Exchange) -> None:
        match = _USAGE.search(b"".join(exchange.last_chunks))
        if match:
            backend = exchange.lease.backend.name
            prompt, completion = int(match.group(1)), int(match.group(2))
            exchange.tokens = (prompt, completion)
            exchange.lease.output_tokens = completion  # a speed sample for the learned crossover
            self.metrics.prompt_tokens.labels(backend).inc(prompt)
            self.metrics.completion_tokens.labels(backend).inc(completion)

    def _abort_upstream(self, exchange: Exchange) -> None:
        """Stop the backend's work now instead of SGLang's own 2 s after the socket closes."""
        if exchange.upstream is not None:
            exchange.upstream.close()
            exchange.upstream = None
        for rid in exchange.inbound.abort_rids:
            task = asyncio.create_task(self._post_abort(exchange.lease.backend, rid))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    async def _post_abort(self, state: BackendState, rid: str) -> None:
        target, backend = state.target, state.name
        key = target.admin_api_key or target.api_key  # SGLang: the admin key when it has one
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        try:
            status = await self.upstream.post_json(target.url + "/abort_request",
                                                   json.dumps({"rid": rid}).encode(), headers, 5.0)
        except GatewayError as exc:
            log.info("abort of %s on %s failed: %s", rid, backend, exc.message)
            return
        if status in (401, 403):
            log.warning("abort of %s on %s refused with HTTP %d: set backends.%s.admin_api_key "
                        "to the server's --admin-api-key", rid, backend, status, backend)

    async def pass_through(self, method: str, path: str, client_headers: Headers,
                           order: list[BackendState], *, next_on_404: bool = False
                           ) -> tuple[int, list[tuple[bytes, bytes]], bytes, BackendState]:
        """A small request answered by the first backend in `order` that answers (the next
        one on a connection error or 5xx, and on 404 when asked): status, headers, body."""
        settings = self.get_settings()
        failure: GatewayError = NoBackend("no healthy backend: all are down or their "
                                          "circuits are open", headers={"retry-after": "5"})
        for index, state in enumerate(order):
            target, backend = state.target, state.name
            headers = upstream_headers(client_headers, target.api_key)
            try:
                # A backend silent for idle_s is stuck: the next one is asked.
                async with asyncio.timeout(settings.timeouts.idle_s):
                    response = await self.upstream.send(method, target.url + path, headers,
                                                        b"" if method == "POST" else None)
                    try:
                        body = await response.read()
                    finally:
                        response.close()
            except TimeoutError:
                failure = UpstreamTimeout(f"backend '{backend}' did not answer {path}",
                                          kind="timeout_total")
                continue
            except UpstreamError as exc:
                failure = exc
                continue
            last = index == len(order) - 1
            if not last and (response.status >= 500 or (next_on_404 and response.status == 404)):
                continue
            if response.status >= 500:
                failure = UpstreamStatus(response.status, backend,
                                         body[:500].decode("utf-8", "replace"))
                break
            return response.status, response.headers, openai_shaped(body), state
        raise failure


def _movable(exchange: Exchange, source: BackendState, target: BackendState) -> bool:
    """A stream still waiting on `source` for its first event that says anything: no byte of
    one has come (taken, or waiting to be read; whole lead-in events only), neither pinned
    nor bound to `source` (Lease.movable), and `target` has not failed it already."""
    opening, moved, upstream = exchange.opening, exchange.moved, exchange.upstream
    return (opening is not None and not opening.done() and moved is not None
            and not moved.done() and not exchange.mid_event
            and (upstream is None or not upstream.unread)
            and exchange.lease.backend is source and exchange.lease.movable
            and all(attempt.backend is not target for attempt in exchange.lease.attempts))


async def _unwind(opening: asyncio.Future[Any]) -> None:
    """Wait until an opening the move cancelled has let go of everything; what it raised or
    returned is dropped (its response was closed)."""
    await asyncio.wait((opening,))
    if not opening.cancelled():
        opening.exception()  # retrieved: a failure of the old attempt judges no one


def _waits_for_turn(admitted: Lease | Any) -> bool:
    return not isinstance(admitted, Lease) and admitted.decision.reason == "memory_turn"


def _key_matches(given: str | None, keys: tuple[str, ...]) -> bool:
    if given is None:
        return False
    candidate = given.encode()
    # Compare against every key so the time taken does not tell which one nearly matched.
    return any([hmac.compare_digest(candidate, key.encode()) for key in keys])


def _method_not_allowed(path: str) -> GatewayError:
    allowed = "POST, PUT" if path in PUT_PATHS else "POST"
    return MethodNotAllowed(f"method not allowed; use {allowed}", headers={"allow": allowed})


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


def log_access(path: str, backend: str | None, reason: str | None, status: int,
               ttft: float | None, started: float, ended: str,
               tokens: tuple[int, int] | None, moved_from: str | None = None) -> None:
    """One line per request, logfmt: what an operator greps for when a client complains."""
    if not access.isEnabledFor(logging.INFO):
        return
    access.info(
        "path=%s backend=%s reason=%s status=%d ttft_ms=%s duration_ms=%.1f prompt_tokens=%s "
        "completion_tokens=%s ended=%s moved_from=%s", path, backend or "-", reason or "-",
        status, "-" if ttft is None else f"{ttft * 1000:.1f}",
        (time.monotonic() - started) * 1000, "-" if tokens is None else tokens[0],
        "-" if tokens is None else tokens[1], ended, moved_from or "-")


async def send_error(send: Send, exc: GatewayError,
                     extra: list[tuple[bytes, bytes]] | None = None, api: str = OPENAI) -> None:
    body = exc.to_bytes(api)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})
