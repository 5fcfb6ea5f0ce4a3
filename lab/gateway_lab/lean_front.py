"""A lean HTTP/1.1 front for ASGI apps, for `mtp-gateway overhead --lean-front`: what uvicorn's
share of the gateway's cost is, measured with the gateway itself on something smaller.

A prototype for the benchmark, not a server to deploy: one request at a time per connection
(the load generator's way), a request body by Content-Length only, no timeouts, no bounded
head, no graceful shutdown, no h11 fallback, no WebSocket. What it does keep is what the
gateway's relay uses: a scope like uvicorn's, `receive` with `http.disconnect`, `send` with
chunked or Content-Length bodies and keep-alive, and the body writer extension
(gateway.relay.client_io.CLIENT_WRITER) with flow control. Per request it makes one scope dict, one
small object and one task; per chunk the writer's `write` is one join and one transport write.

    python -m gateway_lab.lean_front --config FILE [--port P]     # the gateway on it
    python -m gateway_lab.overhead_asgi_relay --upstream-port P --server lean

print `READY <port>` once they accept connections.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools

from gateway.relay.client_io import CLIENT_WRITER

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CHUNK_HEADS = tuple(b"%x\r\n" % size for size in range(2048))
_LAST_CHUNK = b"0\r\n\r\n"


class _Exchange:
    """One request's ASGI receive and send, and its body writer."""

    __slots__ = ("conn", "body", "started", "chunked", "complete", "disconnected", "_gone",
                 "_client_gone")

    def __init__(self, conn: LeanProtocol, body: bytes) -> None:
        self.conn = conn
        self.body: bytes | None = body  # None once receive() has handed it over
        self.started = self.chunked = self.complete = self.disconnected = False
        self._gone: asyncio.Future[None] | None = None
        self._client_gone: Callable[[], None] | None = None

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        if not self.disconnected:
            self._gone = self.conn.loop.create_future()
            await self._gone
        return {"type": "http.disconnect"}

    def lost(self) -> None:
        self.disconnected = True
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)
        callback, self._client_gone = self._client_gone, None
        if callback is not None and not self.complete:
            callback()

    async def send(self, message: dict[str, Any]) -> None:
        if self.disconnected:
            return
        transport = self.conn.transport
        if message["type"] == "http.response.start":
            self.started = True
            status = message["status"]
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
            sized = False
            for name, value in message.get("headers", ()):
                sized = sized or name.lower() == b"content-length"
                lines.append(b"%s: %s\r\n" % (name, value))
            self.chunked = not sized
            lines.append(b"transfer-encoding: chunked\r\n\r\n" if self.chunked else b"\r\n")
            transport.write(b"".join(lines))
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        if self.chunked:
            if body:
                self.write(body)
            if not more:
                transport.write(_LAST_CHUNK)
        elif body:
            transport.write(body)
        if not more:
            self.complete = True
            self.conn.done(self)

    # the body writer (gateway.relay.client_io.ClientWriter)
    def usable(self) -> bool:
        return self.started and self.chunked and not self.complete

    def write(self, data: bytes) -> bool:
        if self.disconnected:
            return False
        size = len(data)
        head = _CHUNK_HEADS[size] if size < len(_CHUNK_HEADS) else b"%x\r\n" % size
        self.conn.transport.write(b"".join((head, data, b"\r\n")))
        return self.conn.paused

    async def drain(self) -> None:
        await self.conn.drained()

    def on_client_gone(self, callback: Callable[[], None] | None) -> None:
        self._client_gone = callback


class LeanProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, app: Any, loop: asyncio.AbstractEventLoop, server: tuple[str, int]) -> None:
        self.app, self.loop, self.server = app, loop, server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.current: _Exchange | None = None
        self.paused = False
        self._drain: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.current is not None:
            self.current.lost()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drained(self) -> None:
        if self.paused:
            self._drain = self.loop.create_future()
            await self._drain

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path, _, query = self.url.partition(b"?")
        exchange = self.current = _Exchange(self, b"".join(self.body))
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": self.parser.get_method().decode("ascii"),
            "scheme": "http", "path": path.decode("latin-1"), "raw_path": path,
            "query_string": query, "root_path": "", "headers": self.headers,
            "client": None, "server": self.server, "state": {},
            "extensions": {CLIENT_WRITER: exchange},
        }
        self.transport.pause_reading()  # one request at a time
        self.loop.create_task(self._run(scope, exchange))

    async def _run(self, scope: dict[str, Any], exchange: _Exchange) -> None:
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception:
            logging.getLogger("lean_front").exception("the app failed")
            self.transport.close()
            return
        if not exchange.complete:
            self.transport.close()

    def done(self, exchange: _Exchange) -> None:
        if exchange is self.current:
            self.current = None
            if self.parser.should_keep_alive():
                self.transport.resume_reading()
            else:
                self.transport.close()


async def serve_lean(app: Any, host: str, port: int) -> None:
    """Run `app`'s lifespan, then serve it until cancelled; prints `READY <port>`."""
    loop = asyncio.get_running_loop()
    lifespan: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    started: asyncio.Future[None] = loop.create_future()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set_result(None)

    await lifespan.put({"type": "lifespan.startup"})
    life = loop.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                lifespan.get, send))
    await started
    server = await loop.create_server(lambda: LeanProtocol(app, loop, (host, port)), host, port,
                                      backlog=4096)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await lifespan.put({"type": "lifespan.shutdown"})
        await life


def run_lean(app: Any, host: str, port: int) -> None:
    import uvloop

    try:
        uvloop.run(serve_lean(app, host, port))
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    from gateway_lab.granian_front import gateway_from_argv

    run_lean(*gateway_from_argv("lean_front", __doc__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
