"""The upstream client against scripted raw-socket backends: framing, keep-alive, failures."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.apis.errors import UpstreamBroken, UpstreamConnectError, UpstreamTimeout
from gateway.upstream.client import Upstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD_200_CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Backend:
    """A TCP server running `handler` per connection, counting connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_peer = asyncio.Event()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_peer.set()
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_peer.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def backend(script: Callable[[Backend, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                  ) -> AsyncIterator[tuple[Backend, str, Upstream]]:
    fake = Backend(lambda reader, writer: script(fake, reader, writer))
    server = await asyncio.start_server(fake._serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream = Upstream(connect_timeout_s=2)
    await upstream.start()
    try:
        yield fake, f"http://127.0.0.1:{port}", upstream
    finally:
        await upstream.close()
        server.close()


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def answer_forever(fake: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         body: bytes = b'{"ok":true}') -> None:
    while await fake.read_request(reader) is not None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))


@pytest.mark.timeout(10)
async def test_kept_alive_connection_carries_sequential_requests() -> None:
    async with backend(answer_forever) as (fake, url, upstream):
        for _ in range(5):
            status, body = await upstream.request("POST", url + "/x", [], b"{}", 2)
            assert (status, body) == (200, b'{"ok":true}')
        assert fake.connections == 1 and len(fake.requests) == 5


@pytest.mark.timeout(10)
async def test_request_bytes_are_exact() -> None:
    async with backend(answer_forever) as (fake, url, upstream):
        await upstream.request("POST", url + "/v1/chat/completions?a=1",
                               [(b"content-type", b"application/json"), (b"x-session-id", b"s1")],
                               b'{"m":1}', 2)
    port = url.rsplit(":", 1)[1]
    assert fake.requests == [
        b"POST /v1/chat/completions?a=1 HTTP/1.1\r\nhost: 127.0.0.1:" + port.encode()
        + b"\r\ncontent-type: application/json\r\nx-session-id: s1\r\ncontent-length: 7\r\n\r\n"
        b'{"m":1}']


@pytest.mark.timeout(10)
async def test_a_header_value_with_a_line_break_is_refused_not_sent() -> None:
    async with backend(answer_forever) as (fake, url, upstream):
        with pytest.raises(UpstreamConnectError, match="line break"):
            await upstream.send("POST", url, [(b"x-a", b"1\r\nx-injected: 1")], b"")
    assert fake.requests == []


@pytest.mark.timeout(10)
async def test_chunked_stream_is_delivered_in_order_and_connection_reused() -> None:
    events = [b"data: %d\n\n" % i for i in range(50)]

    async def script(fake: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await fake.read_request(reader) is not None:
            writer.write(HEAD_200_CHUNKED)
            for event in events:  # some in one TCP segment, some apart
                writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                if event.endswith(b"7\n\n"):
                    await writer.drain()
                    await asyncio.sleep(0.001)
            writer.write(b"0\r\n\r\n")

    async with backend(script) as (fake, url, upstream):
        response = await upstream.send("POST", url, [], b"{}")
        assert response.status == 200
        assert response.headers == [(b"content-type", b"text/event-stream")]  # hop headers gone
        assert await response.read() == b"".join(events)
        pumped: list[bytes] = []
        second = await upstream.send("POST", url, [], b"{}")
        second.pump(pumped.append)
        assert await second.pumped() is True
        assert b"".join(pumped) == b"".join(events)
        assert fake.connections == 1


@pytest.mark.timeout(10)
async def test_a_body_ended_by_closing_the_connection_is_complete() -> None:
    async def script(fake: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async with backend(script) as (fake, url, upstream):
        assert await upstream.request("GET", url, [], None, 2) == (200, b"all of it")
        assert await upstream.request("GET", url, [], None, 2) == (200, b"all of it")
        assert fake.connections == 2  # "connection: close" is honoured


@pytest.mark.timeout(10)
async def test_backend_closing_an_idle_connection_costs_the_next_request_nothing() -> None:
    """SGLang's uvicorn closes idle connections after 5 s; a request that races the close is
    sent again on a new connection instead of failing."""
    async def script(fake: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if fake.connections == 1:
            # Keep-alive by the headers, then gone without a word once the next request arrives.
            await reader.read(1)
            writer.transport.abort()
            return
        while await fake.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async with backend(script) as (fake, url, upstream):
        assert await upstream.request("POST", url, [], b"{}", 2) == (200, b"ok")
        assert await upstream.request("POST", url, [], b"{}", 2) == (200, b"ok")
        assert fake.connections == 2


@pytest.mark.timeout(10)
async def test_broken_stream_and_malformed_answers_raise_mapped_errors() -> None:
    async def script(fake: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await fake.read_request(reader)
        assert request is not None
        if b"/broken" in request:
            writer.write(HEAD_200_CHUNKED + b"9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            writer.transport.abort()
        elif b"/garbage" in request:
            writer.write(b"SPDY/9 banana\r\n\r\n")
        elif b"/silent" in request:
            writer.transport.abort()

    async with backend(script) as (_, url, upstream):
        response = await upstream.send("POST", url + "/broken", [], b"")
        assert await response.next_chunk() == b"data: 1\n\n"
        with pytest.raises(UpstreamBroken, match="middle of the response"):
            await response.next_chunk()
        with pytest.raises(UpstreamBroken, match="malformed"):
            await upstream.send("POST", url + "/garbage", [], b"")
        with pytest.raises(UpstreamConnectError, match="before answering"):
            await upstream.send("POST", url + "/silent", [], b"")


@pytest.mark.timeout(10)
async def test_unreachable_backend_is_a_connect_error() -> None:
    upstream = Upstream(connect_timeout_s=1)
    await upstream.start()
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await upstream.send("POST", f"http://127.0.0.1:{port}/", [], b"")
    with pytest.raises(UpstreamTimeout):
        # Nobody answers a control-plane call within its budget: a timeout, connection dropped.
        async with backend(lambda fake, reader, writer: asyncio.sleep(30)) as (fake, url, other):
            await other.request("GET", url, [], None, 0.2)
    await upstream.close()


@pytest.mark.timeout(10)
async def test_closing_an_unfinished_response_drops_the_connection() -> None:
    """The backend must see the end of the stream, or it keeps generating for nobody."""
    async def script(fake: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake.read_request(reader)
        writer.write(HEAD_200_CHUNKED + b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        if not await reader.read(1):
            fake.closed_by_peer.set()

    async with backend(script) as (fake, url, upstream):
        response = await upstream.send("POST", url, [], b"")
        assert await response.next_chunk() == b"data: 1\n\n"
        response.close()
        await asyncio.wait_for(fake.closed_by_peer.wait(), 5)
        with pytest.raises(UpstreamBroken):
            await response.next_chunk()


@pytest.mark.timeout(20)
async def test_paused_reading_pushes_back_on_the_backend() -> None:
    """While the pump is paused nothing more is read: the backend's writes back up."""
    piece = b"data: " + b"x" * 16_000 + b"\n\n"
    filled = asyncio.Event()

    async def script(fake: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await fake.read_request(reader)
        writer.write(HEAD_200_CHUNKED)
        for _ in range(2000):  # 32 MB, far more than the kernel buffers between us
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            if writer.transport.get_write_buffer_size() > 4_000_000:
                filled.set()
                await writer.drain()
        writer.write(b"0\r\n\r\n")

    async with backend(script) as (_, url, upstream):
        response = await upstream.send("POST", url, [], b"")
        received: list[int] = []

        def sink(data: bytes) -> None:
            received.append(len(data))
            response.pause_reading()

        response.pump(sink)
        assert await response.pumped() is False
        await asyncio.wait_for(filled.wait(), 10)
        assert sum(received) < 1_000_000  # one read's worth, not the stream
        while not await response.pumped():  # read on, a piece at a time, to the end
            response.resume_reading()
        assert sum(received) == 2000 * len(piece)


@pytest.mark.timeout(10)
async def test_an_https_backend_is_verified_against_the_trusted_certificates(monkeypatch) -> None:
    """TLS to a backend verifies its certificate with the system's trust store, which
    SSL_CERT_FILE extends (how a deployment adds an internal CA)."""
    import trustme

    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_tls)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "localhost", 0, ssl=server_tls)
    url = f"https://localhost:{server.sockets[0].getsockname()[1]}/v1/loads"
    try:
        untrusting = Upstream(connect_timeout_s=2)
        await untrusting.start()
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await untrusting.request("GET", url, [], None, 2)
        await untrusting.close()

        with ca.cert_pem.tempfile() as ca_file:
            monkeypatch.setenv("SSL_CERT_FILE", ca_file)
            trusting = Upstream(connect_timeout_s=2)
            await trusting.start()
            assert await trusting.request("GET", url, [], None, 2) == (200, b"ok")
            await trusting.close()
    finally:
        server.close()
