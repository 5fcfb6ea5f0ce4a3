"""The floor of a relay in Python on uvloop, for `mtp-gateway overhead --bare-relay`.

Not a gateway: no routing, no parsing of the answer, no SSE framing, no metrics, no log. A
client's request goes whole to a kept-alive upstream connection, and every piece the upstream
sends goes to the client as it came, in the upstream connection's `data_received`: one recv
and one send per chunk, the least any relay does. What it costs per chunk is what Python on
uvloop costs before any gateway logic: if it is above sglang-router's, no Python relay on this
stack reaches the router, and the remedy is a compiled relay loop, not less Python.

    python -m gateway_lab.overhead_bare_relay --upstream-port P [--port 0]

prints `READY <port>`. One request at a time per client connection, as the load generator
sends them; the upstream's answers end with the chunked terminator (`0\\r\\n\\r\\n`) or a
content-length body, as the fake upstream sends them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from gateway_lab.fast_upstream import raise_nofile_limit

_LAST = b"0\r\n\r\n"


class UpstreamSide(asyncio.Protocol):
    """One kept-alive connection to the upstream, lent to one client request at a time."""

    def __init__(self, relay: BareRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.client: ClientSide | None = None
        self.tail = b""  # the last bytes seen, for a terminator split across reads
        self.length = -1  # content-length body left, or -1 (chunked)
        self.head_done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def lend(self, client: ClientSide, request: bytes) -> None:
        self.client, self.tail, self.length, self.head_done = client, b"", -1, False
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None or client.transport is None:
            return
        client.transport.write(data)  # as it came: the whole per-chunk work
        if not self.head_done:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                return  # the fake upstream writes its head in one piece
            self.head_done = True
            head = data[:end].lower()
            at = head.find(b"content-length:")
            if at >= 0:
                self.length = int(head[at + 15:].split(b"\r\n", 1)[0]) - (len(data) - end - 4)
                if self.length <= 0:
                    self._done()
                return
            data = data[end + 4:]
        if self.length >= 0:
            self.length -= len(data)
            if self.length <= 0:
                self._done()
            return
        tail = self.tail + data[-5:]
        if tail.endswith(_LAST):
            self._done()
        else:
            self.tail = tail[-5:]

    def _done(self) -> None:
        client, self.client = self.client, None
        self.relay.idle.append(self)
        if client is not None:
            client.answered()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.relay.idle:
            self.relay.idle.remove(self)
        if self.client is not None and self.client.transport is not None:
            self.client.transport.close()


class ClientSide(asyncio.Protocol):
    """One client connection: a request at a time, whole, then the upstream's answer."""

    def __init__(self, relay: BareRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
        if len(self.buf) < end + 4 + length:
            return
        request, self.buf = self.buf[:end + 4 + length], self.buf[end + 4 + length:]
        self.busy = True
        self.relay.send(self, request)

    def answered(self) -> None:
        self.busy = False
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


class BareRelay:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.idle: list[UpstreamSide] = []
        self.loop = asyncio.get_running_loop()

    def send(self, client: ClientSide, request: bytes) -> None:
        if self.idle:
            self.idle.pop().lend(client, request)
            return
        self.loop.create_task(self._connect_and_send(client, request))

    async def _connect_and_send(self, client: ClientSide, request: bytes) -> None:
        _, upstream = await self.loop.create_connection(lambda: UpstreamSide(self), "127.0.0.1",
                                                        self.upstream_port)
        upstream.lend(client, request)


async def _serve(args: argparse.Namespace) -> None:
    relay = BareRelay(args.upstream_port)
    server = await relay.loop.create_server(lambda: ClientSide(relay), "127.0.0.1", args.port,
                                            backlog=4096)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overhead_bare_relay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    raise_nofile_limit()
    try:
        import uvloop

        uvloop.run(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
