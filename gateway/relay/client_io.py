"""How the relay writes a stream to its client: the one interface it knows.

Every server can take ASGI `send` messages. The gateway's own HTTP protocol (gateway/front/server.py)
also puts a `ClientWriter` in each request's scope: synchronous writes straight to the
connection, from the upstream connection's own callback, with no coroutine and no ASGI message
per chunk (measured in lab/results/perf/). The relay depends on this module only, never on the server's
internals; under a server without the writer (or when server.py found uvicorn's internals
changed at start) the scope has none and the relay uses `send`: the same bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

CLIENT_WRITER = "mtp_gateway.client_writer"  # the scope extension's key


class ClientWriter(Protocol):
    """Chunked body writes for one response whose head went out by ASGI send; the response
    still ends with an ASGI send. An exception raised here is the gateway's own failure."""

    def usable(self) -> bool:
        """True once a chunked response has started and is not complete."""

    def write(self, data: bytes) -> bool:
        """One body piece, now; nothing once the client is gone. True when the client's socket
        buffer is full: stop feeding it until `drain()` (one call per piece, not two)."""

    async def drain(self) -> None:
        """Until the client's socket takes more."""

    def on_client_gone(self, callback: Callable[[], None] | None) -> None:
        """`callback` is called (once, from the connection's own callback) when the client's
        connection is lost before the response completed; None: no longer. What an ASGI
        receive of http.disconnect says, without a task per request awaiting it."""


def client_writer(scope: Mapping[str, Any]) -> ClientWriter | None:
    """The request's writer, when its server provides one."""
    return (scope.get("extensions") or {}).get(CLIENT_WRITER)
