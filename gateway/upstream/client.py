"""The upstream HTTP/1.1 client: kept-alive connections to the backends, parsed by httptools.

Why a small client of our own instead of aiohttp (before) or httpx: the relay needs one thing
neither offers, a response body delivered by callback, so each SSE chunk goes from the
backend's socket to the client's socket inside one `data_received` call, with no future, no
task wake-up and no coroutine chain per chunk. Measured with `mtp-gateway overhead` (figures in
lab/results/perf/): that, plus a request path without aiohttp's per-request machinery, is what brings
the gateway under the issue's CPU-per-chunk targets. httptools (the parser uvicorn already uses)
does the HTTP parsing; this module only keeps connections and maps failures to the gateway's
error tree. Backends are SGLang servers: plain HTTP/1.1 answers with Content-Length or chunked
bodies, no redirects, no compression asked for.

One module of ~480 lines on purpose: the connection pool, the request writer and the response
delivered by callback share one connection's state (its parser, its transport, whether it may
be kept), which has one owner here; split, each part would reach into the others' fields.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from gateway.apis.errors import (
    GatewayError,
    RelayError,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamTimeout,
    let_go,
)

Header = tuple[bytes, bytes]
Sink = Callable[[bytes], object]  # what it returns is dropped

# Response headers that describe one hop, or that the gateway sets itself.
_SKIP_RESPONSE_HEADERS = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"content-length", b"content-encoding", b"date", b"server",
    b"www-authenticate", b"set-cookie",
})
# SGLang's uvicorn closes a connection idle for 5 s: drop ours a little before it does.
IDLE_EXPIRY_S = 4.0
MAX_IDLE_PER_ORIGIN = 512
BUFFER_HIGH_WATER = 256 * 1024  # unread body bytes held before reading from the backend pauses


def client_headers(raw: Sequence[Header]) -> list[Header]:
    """The backend's response headers that may go on to the client: not the hop-by-hop ones,
    nor those the backend's Connection header names (RFC 9110 7.6.1)."""
    skip = _SKIP_RESPONSE_HEADERS
    for name, value in raw:
        if name.lower() == b"connection":
            skip = skip | {token.strip().lower() for token in value.split(b",")}
    return [(name.lower(), value) for name, value in raw if name.lower() not in skip]


@dataclass(frozen=True, slots=True)
class Origin:
    host: str
    port: int
    tls: bool
    host_header: bytes


@functools.lru_cache(maxsize=256)
def _target(url: str) -> tuple[Origin, bytes]:
    """(origin, request target) of a backend URL: parsed once per backend and path."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamConnectError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    origin = Origin(parts.hostname, parts.port or (443 if tls else 80), tls,
                    parts.netloc.rpartition("@")[2].encode("idna"))
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return origin, path.encode("ascii")


def _request_head(method: bytes, path: bytes, origin: Origin, headers: Sequence[Header],
                  body_length: int | None) -> bytes:
    lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method, path, origin.host_header)]
    for name, value in headers:
        if b"\r" in value or b"\n" in value:  # never let a value start a header of its own
            raise UpstreamConnectError(f"header {name.decode('latin-1')} has a line break")
        lines.append(b"%s: %s\r\n" % (name, value))
    if body_length is not None:
        lines.append(b"content-length: %d\r\n" % body_length)
    lines.append(b"\r\n")
    return b"".join(lines)


class UpstreamResponse:
    """One response: status and headers, then the body by `next_chunk()`, `read()` or `pump()`.

    Data arrives in the connection's callbacks. Without a sink it is buffered for the reader;
    with one (`pump`), every piece goes straight to the sink, in the same callback."""

    __slots__ = ("status", "headers", "_raw_headers", "_connection", "_loop", "_head_done",
                 "_buffer", "_buffered", "_waiter", "_done", "_error", "_sink", "_paused", "_framed")

    def __init__(self, connection: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.headers: list[Header] = []
        self._raw_headers: list[Header] = []
        self._connection: _Connection | None = connection
        self._loop = loop
        self._head_done = False
        self._buffer: list[bytes] = []
        self._buffered = 0  # bytes in _buffer
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: GatewayError | None = None
        self._sink: Sink | None = None
        self._paused = False
        self._framed = False  # Content-Length or chunked: the end is not the connection's end

    # --- the reader's side ------------------------------------------------------------------

    async def next_chunk(self) -> bytes:
        """The bytes that have arrived (b"" at the end): no re-chunking, no decoding."""
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        buffer = self._buffer
        data = buffer[0] if len(buffer) == 1 else b"".join(buffer)
        buffer.clear()
        self._buffered = 0
        self.resume_reading()
        return data

    @property
    def unread(self) -> bool:
        """Body bytes have arrived that no reader took yet (read before the first byte only:
        a planned move must not discard what the backend already sent)."""
        return bool(self._buffer)

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def pump(self, sink: Sink) -> None:
        """From now on hand every body piece to `sink`, synchronously, as it arrives (what is
        buffered first). A sink that raises fails the response."""
        buffered, self._buffer, self._buffered = self._buffer, [], 0
        self._sink = sink
        self.resume_reading()  # the sink decides from here on
        for data in buffered:
            self._deliver(data)

    async def pumped(self) -> bool:
        """While pumping: wait until the body ends (True; raises the response's error) or
        reading was paused for backpressure (False)."""
        while True:
            if self._error is not None:
                raise self._error
            if self._done:
                return True
            if self._paused:
                return False
            await self._wait()

    def pause_reading(self) -> None:
        """The client is not keeping up: stop reading from the backend (TCP pushes back)."""
        if self._connection is not None and not self._done and not self._paused:
            self._paused = True
            self._connection.transport.pause_reading()
            self._wake()

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            if self._connection is not None:
                self._connection.transport.resume_reading()

    def interrupt(self, error: GatewayError) -> None:
        """Fail the response now with `error`: its reader (or pump) wakes and raises it, and
        nothing more is handed to the sink (a hand-off taking the stream elsewhere)."""
        self._fail(error)

    def close(self) -> None:
        """Done with this response. Unfinished, its connection is dropped: the backend sees
        the stream end and stops generating."""
        connection, self._connection = self._connection, None
        self._sink = None
        if connection is not None and not self._done:
            connection.drop()
        if self._error is None and not self._done:
            self._error = UpstreamBroken("response closed")
        let_go(self._error)  # raised by this response's frames, it holds them and they hold it

    # --- the connection's side --------------------------------------------------------------

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            self._framed = True

    def _headers_complete(self, status: int) -> None:
        self.status = status
        self.headers = client_headers(self._raw_headers)
        self._head_done = True
        self._wake()

    def _deliver(self, data: bytes) -> None:
        sink = self._sink
        if sink is None:
            self._hold(data)
            return
        try:
            sink(data)
        except Exception as exc:  # a bug in the sink: fail this response, not the connection's loop
            self._sink_failed(exc)

    def _hold(self, data: bytes) -> None:
        """A body piece for the reader (no sink)."""
        self._buffer.append(data)
        self._buffered += len(data)
        if self._buffered > BUFFER_HIGH_WATER:  # the reader is slow: let TCP hold the rest
            self.pause_reading()
        self._wake()

    def _sink_failed(self, exc: Exception) -> None:
        # The gateway's own failure, not the backend's: kept out of its circuit.
        self._fail(RelayError(f"relaying the stream failed: {exc!r}"))
        self.close()

    def _complete(self) -> None:
        self._done = True
        self._sink = None  # it closes over this response: no cycle left for the GC to find
        connection, self._connection = self._connection, None  # the pool's again, or closed
        if self._paused and connection is not None:  # paused by the sink on the last piece
            self._paused = False
            connection.transport.resume_reading()
        self._wake()

    def _fail(self, error: GatewayError) -> None:
        if not self._done and self._error is None:
            self._error = error
        self._sink = None
        self._wake()

    def _connection_ended(self) -> None:
        if self._head_done and not self._framed:  # a body delimited by the connection's end
            self._complete()
        elif self._head_done:
            self._fail(UpstreamBroken("backend closed the connection in the middle of the response"))
        else:
            self._fail(UpstreamConnectError("backend closed the connection before answering"))


class _Connection(asyncio.Protocol):
    """One kept-alive TCP connection to a backend, with one response in flight at most."""

    def __init__(self, pool: _Pool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # connection_made
        self.parser: httptools.HttpResponseParser  # from connection_made to connection_lost
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0

    def start(self, request: Sequence[bytes | memoryview],
              loop: asyncio.AbstractEventLoop) -> UpstreamResponse:
        response = self.response = UpstreamResponse(self, loop)
        self.transport.writelines(request)
        return response

    def drop(self) -> None:
        self.response = None
        if not self.closed:
            self.closed = True
            self.transport.abort()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: this connection cannot be trusted
            self.drop()
            return
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # httptools.HttpParserError, or an answer nobody asked for
            if self.response is not None:
                self.response._fail(UpstreamBroken(f"malformed response from backend: {exc!r}"))
            self.drop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        # The parser holds this protocol's callbacks: a cycle that only the garbage collector
        # would free, and the gateway runs it seldom (`cli.tune_process`). For the same
        # reason the parser is made only once connected: a connection refused never is.
        del self.parser
        response, self.response = self.response, None
        if response is not None:
            response._connection_ended()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response._header(name, value)  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        self.response._headers_complete(self.parser.get_status_code())  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        # UpstreamResponse._deliver inlined: one Python call less on every piece of a stream.
        response = self.response
        if response is None:  # the sink closed it during this very feed
            return
        sink = response._sink
        if sink is None:
            response._hold(body)
            return
        try:
            sink(body)
        except Exception as exc:  # a bug in the sink: fail this response, not the connection's loop
            response._sink_failed(exc)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        if response is None:
            return
        # Reusable only when the whole request went out too (a backend may answer early).
        keep = self.parser.should_keep_alive() and not self.transport.get_write_buffer_size()
        response._complete()
        if keep:
            self.pool.release(self)
        else:
            self.drop()


class _Pool:
    """Idle kept-alive connections per origin, most recently used first."""

    def __init__(self) -> None:
        self.idle: dict[Origin, list[_Connection]] = {}
        self.every: set[_Connection] = set()

    def take(self, origin: Origin, now: float) -> _Connection | None:
        idle = self.idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < IDLE_EXPIRY_S:
                return connection
            connection.drop()
        return None

    def release(self, connection: _Connection) -> None:
        if connection.closed:
            return
        idle = self.idle.setdefault(connection.origin, [])
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            connection.drop()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        self.every.discard(connection)
        idle = self.idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        for connection in list(self.every):
            connection.drop()
        self.idle.clear()


class Upstream:
    """The client for the backends. Created and closed by the app's lifespan."""

    def __init__(self, *, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._pool = _Pool()
        self._tls: ssl.SSLContext | None = None
        self._started = False

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        self._pool.close()
        self._started = False

    async def send(self, method: str, url: str, headers: Sequence[Header],
                   body: bytes | Sequence[bytes | memoryview] | None) -> UpstreamResponse:
        """Send a request and wait for the response's status and headers (timeouts other than
        connecting are the caller's: cancel the task). A kept-alive connection the backend
        closed just as it was reused is retried once on a new one."""
        if not self._started:
            raise RuntimeError("Upstream used before start()")
        origin, path = _target(url)
        parts = () if body is None else (body,) if isinstance(body, bytes) else tuple(body)
        length = None if body is None else sum(map(len, parts))
        request = (_request_head(method.encode("ascii"), path, origin, headers, length), *parts)
        loop = asyncio.get_running_loop()
        connection = self._pool.take(origin, time.monotonic())
        if connection is not None:
            try:
                return await self._exchange(connection, request, loop)
            except UpstreamConnectError:
                pass  # closed before answering: on a reused connection, try a new one
        connection = await self._connect(origin, loop)
        return await self._exchange(connection, request, loop)

    async def _exchange(self, connection: _Connection, request: Sequence[bytes | memoryview],
                        loop: asyncio.AbstractEventLoop) -> UpstreamResponse:
        response = connection.start(request, loop)
        try:
            while not response._head_done:
                if response._error is not None:
                    raise response._error
                await response._wait()
        except BaseException:
            response.close()
            raise
        return response

    async def _connect(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> _Connection:
        tls = self._tls_context() if origin.tls else None
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self._pool, origin), origin.host, origin.port, ssl=tls)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"connecting to {origin.host}:{origin.port} timed out",
                                  kind="timeout_connect") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to backend {origin.host}:{origin.port}: "
                                       f"{exc.strerror or exc}") from exc
        self._pool.every.add(connection)
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def request(self, method: str, url: str, headers: Sequence[Header], body: bytes | None,
                      timeout_s: float) -> tuple[int, bytes]:
        """A small control-plane call (probe, abort): (status, body), within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.send(method, url, headers, body)
                try:
                    return response.status, await response.read()
                finally:
                    response.close()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{url} did not answer within {timeout_s} s",
                                  kind="timeout_total") from exc

    async def post_json(self, url: str, body: bytes, headers: Sequence[Header],
                        timeout_s: float) -> int:
        headers = [(b"content-type", b"application/json"), *headers]
        status, _ = await self.request("POST", url, headers, body, timeout_s)
        return status

    async def get_json(self, url: str, headers: Sequence[Header], timeout_s: float) -> object:
        status, body = await self.request("GET", url, headers, None, timeout_s)
        if status != 200:
            raise UpstreamConnectError(f"{url} answered {status}")
        return json.loads(body)
