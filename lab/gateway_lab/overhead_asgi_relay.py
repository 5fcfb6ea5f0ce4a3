"""The floor of a relay on the gateway's own HTTP stack, for `mtp-gateway overhead --asgi-relay`.

Not a gateway: the gateway's stack without its logic. uvicorn with the gateway's HTTP protocol
(gateway/front/server.py: the bounded request head, the body writer), an ASGI app of a few lines, and
the gateway's upstream client (gateway/upstream/client.py); no routing, no leases, no SSE framing, no
usage, no metrics, no log line. Every piece the upstream sends goes to the client by the body
writer inside the upstream connection's `data_received`, as the gateway's fast path does.

So the overhead report splits the gateway's cost in three: the bare relay (Python on uvloop,
one recv and one send per chunk), this minus the bare relay (uvicorn, ASGI and the two HTTP
parsers), and the gateway minus this (the gateway's own work per request and per chunk).

    python -m gateway_lab.overhead_asgi_relay --upstream-port P [--port 0] [--server granian|lean]

prints `READY <port>` once it serves. `--server granian` (issue 21's "a compiled HTTP front"):
the same app on granian's Rust HTTP server (lab/gateway_lab/granian_front.py). Granian has no
body writer, so the app relays by ASGI `send`, one message a piece. `--server lean`: on the
benchmark's lean front (lab/gateway_lab/lean_front.py), with its body writer.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

import uvicorn

from gateway.front.server import gateway_http_protocol
from gateway.relay.asgi import Receive, Scope, Send
from gateway.relay.client_io import client_writer
from gateway.upstream.client import Upstream
from gateway_lab.fast_upstream import raise_nofile_limit
from gateway_lab.granian_front import free_port, serve_granian
from gateway_lab.lean_front import run_lean

_JSON = [(b"content-type", b"application/json")]


class AsgiRelay:
    """The ASGI app: the request's body to the upstream, its answer back, nothing else."""

    def __init__(self, upstream_url: str) -> None:
        self.upstream_url = upstream_url
        self.upstream = Upstream(connect_timeout_s=10.0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._relay(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.upstream.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.upstream.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        response = await self.upstream.send("POST", self.upstream_url + scope["path"], _JSON, body)
        try:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": response.headers})
            writer = client_writer(scope)
            if writer is not None and writer.usable():
                await _pump(response, writer)
            else:
                while chunk := await response.next_chunk():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            response.close()


async def _pump(response: Any, writer: Any) -> None:
    """The gateway's fast path without its per-piece work: written in the upstream's callback,
    reading paused while the client's buffer is full."""
    write = writer.write

    def sink(piece: bytes) -> None:
        if write(piece):
            response.pause_reading()

    response.pump(sink)
    while not await response.pumped():
        await writer.drain()
        response.resume_reading()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overhead_asgi_relay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--server", choices=("uvicorn", "granian", "lean"), default="uvicorn")
    args = parser.parse_args(argv)
    raise_nofile_limit()
    app = AsgiRelay(f"http://127.0.0.1:{args.upstream_port}")
    if args.server == "granian":
        serve_granian(app, "127.0.0.1", args.port or free_port())
        return 0
    if args.server == "lean":
        run_lean(app, "127.0.0.1", args.port)
        return 0
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    http, _ = gateway_http_protocol(64 * 1024)
    config = uvicorn.Config(app, loop="uvloop",
                            http=http, access_log=False, proxy_headers=False, log_level="warning",
                            timeout_keep_alive=75, backlog=4096)
    server = uvicorn.Server(config)
    sock.listen(4096)  # connections wait in the backlog until uvicorn has started
    print(f"READY {sock.getsockname()[1]}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
