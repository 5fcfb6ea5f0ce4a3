"""The gateway's HTTP server: uvicorn, with a protocol of our own on two points.

- The request head (request line + headers) is bounded: httptools buffers a header of any
  size (a 200 MB header costs 200 MB of memory); h11 has a limit of its own.
- Each request's scope carries a `BodyWriter`, the relay's `gateway.relay.client_io.ClientWriter`:
  the relay writes SSE chunks with it straight to the connection from the upstream's
  `data_received`, with no coroutine and no ASGI message per chunk (measured in lab/results/perf/).

Both reach into uvicorn's httptools protocol (its callbacks, its request cycle's state), which
no uvicorn release promises to keep. So `check_uvicorn()` looks at what they use once, at
start, and the server takes the path it finds: the fast path; or, without the cycle state the
writer needs, the head bound alone (the relay then writes by ASGI `send`, the same bytes on the
wire); or, without the protocol's callbacks, h11, which bounds the head itself. A log line says
which. pyproject.toml bounds uvicorn to the versions the tests ran on.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from gateway.config import Settings
from gateway.relay.client_io import CLIENT_WRITER

log = logging.getLogger("mtp_gateway.server")

# What of uvicorn's httptools protocol the head bound uses (its callbacks, its state) ...
PROTOCOL_CALLBACKS = ("data_received", "connection_lost", "on_message_begin", "on_url",
                      "on_header", "on_headers_complete", "on_body", "on_message_complete",
                      "send_400_response")
PROTOCOL_STATE = ("cycle", "scope", "transport", "timeout_keep_alive_task", "logger")
# ... and what the body writer reads of a request's cycle and its flow control.
CYCLE_STATE = ("response_started", "chunked_encoding", "response_complete", "disconnected",
               "transport", "flow")
FLOW_STATE = ("write_paused", "drain")
FAST, SEND, H11 = "fast", "send", "h11"


@dataclass(frozen=True)
class HttpPath:
    """What the server does with the uvicorn it runs on (see the module docstring)."""

    name: str  # FAST, SEND (the head bound, the relay on ASGI send) or H11
    why: str  # what was missing, when not FAST

    def describe(self) -> str:
        version = f"uvicorn {uvicorn.__version__}"
        if self.name == FAST:
            return f"relay fast path: the gateway's body writer on {version} (httptools)"
        if self.name == SEND:
            return (f"relay by ASGI send, not the fast path: {version} lacks {self.why}; the "
                    f"request head is still bounded")
        return f"h11 instead of httptools ({self.why}): relay by ASGI send"


def _sets(cls: type, attributes: tuple[str, ...]) -> list[str]:
    """Which of `attributes` the class never assigns or defines (instance state is assigned
    in its code, so its source is where to look)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    return [a for a in attributes if not hasattr(cls, a) and f"self.{a} =" not in source
            and f"self.{a}:" not in source]


def check_uvicorn() -> HttpPath:
    """Once, at start: which path this uvicorn allows."""
    try:
        from uvicorn.protocols.http.flow_control import FlowControl
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    except ImportError as exc:
        return HttpPath(H11, f"no httptools protocol: {exc}")
    missing = [m for m in PROTOCOL_CALLBACKS if not callable(getattr(HttpToolsProtocol, m, None))]
    missing += _sets(HttpToolsProtocol, PROTOCOL_STATE)
    if missing:
        return HttpPath(H11, f"its httptools protocol lacks {', '.join(missing)}")
    missing = _sets(RequestResponseCycle, CYCLE_STATE) + _sets(FlowControl, FLOW_STATE)
    if missing:
        return HttpPath(SEND, ", ".join(missing))
    return HttpPath(FAST, "")


_CHUNK_HEADS = tuple(b"%x\r\n" % size for size in range(2048))  # a chunk's size line


class BodyWriter:
    """The relay's ClientWriter on uvicorn: synchronous chunked body writes for one response,
    after its head went out by ASGI send.

    It writes exactly what uvicorn's `send` writes for `http.response.body` with more_body
    (one chunked-encoding frame), and like `send`, it writes nothing once the client is gone.
    The response still ends with an ASGI send, which writes the last frame."""

    __slots__ = ("_cycle_ref", "_client_gone")

    def __init__(self, cycle: Any) -> None:
        # Weak: the cycle's scope holds this writer, and a strong reference back would make
        # every request's cycle, scope and buffers garbage that only a full GC frees (measured:
        # 25-45k objects per collection at 128 streams, and 31-57 ms pauses).
        self._cycle_ref = weakref.ref(cycle)
        self._client_gone: Callable[[], None] | None = None

    def usable(self) -> bool:
        """True once a chunked response has started and is not complete."""
        cycle = self._cycle_ref()
        return bool(cycle is not None and cycle.response_started and cycle.chunked_encoding
                    and not cycle.response_complete)

    def write(self, data: bytes) -> bool:
        """One chunked-encoding frame; True when the client's socket buffer is full."""
        cycle = self._cycle_ref()
        if cycle is None or cycle.disconnected:
            return False
        size = len(data)
        # A size line from the table, joined: 300 instructions a piece less than formatting.
        head = _CHUNK_HEADS[size] if size < len(_CHUNK_HEADS) else b"%x\r\n" % size
        cycle.transport.write(b"".join((head, data, b"\r\n")))
        return cycle.flow.write_paused is True

    async def drain(self) -> None:
        cycle = self._cycle_ref()
        if cycle is not None:
            await cycle.flow.drain()

    def on_client_gone(self, callback: Callable[[], None] | None) -> None:
        self._client_gone = callback

    def connection_lost(self) -> None:
        """The protocol's: its connection was lost with this response unfinished."""
        callback, self._client_gone = self._client_gone, None
        if callback is not None:
            callback()


def gateway_http_protocol(max_head_bytes: int, path: HttpPath | None = None,
                          ) -> tuple[type[asyncio.Protocol] | str, int]:
    """Returns (protocol, h11 limit) for uvicorn.Config(http=...), for the path `check_uvicorn`
    found (checked now when not given)."""
    path = path or check_uvicorn()
    if path.name == H11:  # h11 bounds the head itself
        return "h11", max_head_bytes
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    with_writer = path.name == FAST

    from gateway.apis.errors import BadRequest, GatewayError, HeadersTooLarge

    class GatewayHttpProtocol(HttpToolsProtocol):
        _in_head = True  # the current request's head has not ended yet
        _head_ended = False  # ... and it ended during this data_received
        _pending = 0  # bytes received while the head is incomplete: what httptools buffers
        _head_size = 0  # request line and headers as parsed
        _refused = False

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            cycle = self.cycle
            if with_writer and cycle is not None and cycle.disconnected:  # its response unfinished
                writer = (cycle.scope.get("extensions") or {}).get(CLIENT_WRITER)
                if isinstance(writer, BodyWriter):
                    writer.connection_lost()
            # uvicorn cancels the keep-alive timer only when the connection ends cleanly: a
            # client that resets it (an agent abandoning a stream) left its protocol, scope
            # and buffers alive for timeout_keep_alive (75 s), ~5 KB per aborted request.
            timer = self.timeout_keep_alive_task
            if timer is not None:
                timer.cancel()
                self.timeout_keep_alive_task = None

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            self._head_ended = False
            super().data_received(data)
            if self._refused or self._head_ended or not self._in_head:
                self._pending = 0
                return
            self._pending += len(data)
            if self._pending > max_head_bytes:  # a head still growing: stop buffering it
                self._refuse()

        def on_message_begin(self) -> None:
            self._in_head, self._head_size = True, 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._head_size += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_size += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_ended = False, True
            if self._head_size > max_head_bytes:  # a whole head that came in one read
                self._refuse()
            if not self._refused:
                super().on_headers_complete()
                cycle = self.cycle
                if with_writer and cycle is not None and cycle.scope is self.scope:
                    # Made just now (no upgrade): its task has not run yet, so the app sees
                    # the scope with the writer in it.
                    # (ASGI's types say an extension is a dict; this one is the writer itself.)
                    extensions = self.scope.setdefault("extensions", {})
                    extensions[CLIENT_WRITER] = BodyWriter(cycle)  # type: ignore[assignment]

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

        def _refuse(self) -> None:
            self._refused = True
            self.logger.warning("request head over %d bytes refused", max_head_bytes)
            if self.cycle is None or self.cycle.response_complete:  # nothing else in flight
                self._answer_and_close(b"431 Request Header Fields Too Large", HeadersTooLarge(
                    f"request line and headers exceed {max_head_bytes} bytes"))
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """Unparseable HTTP: OpenAI-shaped like every other error, not uvicorn's plain text."""
            self._answer_and_close(b"400 Bad Request", BadRequest(f"malformed HTTP request: {msg}"))

        def _answer_and_close(self, status: bytes, error: GatewayError) -> None:
            body = error.to_bytes()
            self.transport.write(
                b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, len(body), body))
            self.transport.close()

    return GatewayHttpProtocol, max_head_bytes


def uvicorn_config(app: Callable[..., Any], settings: Settings, log_level: str) -> uvicorn.Config:
    path = check_uvicorn()
    (log.info if path.name == FAST else log.warning)("%s", path.describe())
    http, h11_limit = gateway_http_protocol(settings.limits.max_header_bytes, path)
    return uvicorn.Config(
        app, host=settings.listen.host, port=settings.listen.port, log_level=log_level,
        http=http, h11_max_incomplete_event_size=h11_limit,
        access_log=False,  # a log line per request costs more than relaying it
        # A float: int() made 1.5 s one second, and any grace under 1 s "wait forever".
        timeout_graceful_shutdown=settings.timeouts.shutdown_grace_s,  # type: ignore[arg-type]
        timeout_keep_alive=75,
        # X-Forwarded-* rewriting costs per request and nothing here reads client addresses.
        proxy_headers=False,
    )


class GatewayServer(uvicorn.Server):
    """uvicorn, except that a drained gateway exits 0.

    After its graceful shutdown uvicorn re-raises the signal that stopped it, under the
    handler that was there before (the default one): the process then dies by SIGTERM
    (exit -15) although every stream was drained or ended properly."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured.clear()


