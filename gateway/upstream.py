"""The upstream HTTP client, behind one small interface.

aiohttp, not httpx, on the hot path: measured (research/perf-anchors.md) httpcore's pool does
O(pooled connections) work per request and collapses at 128 concurrent streams, while the
same relay on aiohttp held the load generator's ceiling. Everything aiohttp-specific lives
here; its exceptions are mapped to gateway errors in exactly one place (`_mapped`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp
import yarl

from gateway.errors import GatewayError, UpstreamBroken, UpstreamConnectError, UpstreamTimeout

# Response headers that describe one hop, or that the gateway sets itself.
_SKIP_RESPONSE_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "content-encoding", "date", "server",
    "www-authenticate", "set-cookie",
})


def client_headers(raw: tuple[tuple[bytes, bytes], ...]) -> list[tuple[bytes, bytes]]:
    """The backend's response headers that may go on to the client: not the hop-by-hop ones,
    nor those the backend's Connection header names (RFC 9110 7.6.1)."""
    skip = set(_SKIP_RESPONSE_HEADERS)
    for name, value in raw:
        if name.lower() == b"connection":
            skip.update(token.strip().lower() for token in value.decode("latin-1").split(","))
    return [(name.lower(), value) for name, value in raw
            if name.decode("latin-1").lower() not in skip]


@contextmanager
def _mapped(phase: str) -> Iterator[None]:
    """Translate aiohttp/asyncio failures into the gateway's error tree."""
    try:
        yield
    except GatewayError:
        raise
    except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
        raise UpstreamConnectError(f"cannot connect to backend: {exc}") from exc
    except TimeoutError as exc:  # aiohttp.ServerTimeoutError is one too
        raise UpstreamTimeout(f"backend timed out ({phase})", kind=f"timeout_{phase}") from exc
    except (aiohttp.ClientError, ConnectionError) as exc:
        if phase == "connect":
            raise UpstreamConnectError(f"backend closed the connection: {exc}") from exc
        raise UpstreamBroken(f"backend stream broke: {exc!r}") from exc


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    _response: aiohttp.ClientResponse

    async def next_chunk(self) -> bytes:
        """The bytes that have arrived (b"" at the end): no re-chunking, no decoding.

        A plain coroutine, not an async generator, so the relay can interrupt a read for a
        keep-alive and then read on."""
        try:
            return await self._response.content.readany()
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise UpstreamBroken(f"backend stream broke: {exc!r}") from exc

    async def read(self) -> bytes:
        with _mapped("read"):
            return await self._response.read()

    def close(self) -> None:
        # Closing (not releasing) drops the connection, so an unfinished stream stops upstream.
        self._response.close()


class Upstream:
    """A pooled client for the backends. Created and closed by the app's lifespan."""

    def __init__(self, *, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type", "Accept"),
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies of its own
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def _url(url: str) -> yarl.URL:
        """Parsed once per backend and path, not per request."""
        return yarl.URL(url)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream used before start()")
        return self._session

    async def send(self, method: str, url: str, headers: list[tuple[str, str]],
                   body: bytes | None) -> UpstreamResponse:
        """Send a request and wait for the response headers (timeouts are the caller's)."""
        with _mapped("connect"):
            response = await self.session.request(
                method, self._url(url), data=body, headers=headers, allow_redirects=False
            )
        return UpstreamResponse(response.status, client_headers(response.raw_headers), response)

    async def post_json(self, url: str, body: bytes, headers: list[tuple[str, str]],
                        timeout_s: float) -> int:
        """A small control-plane call (abort). Returns the status; raises mapped errors."""
        with _mapped("connect"):
            async with asyncio.timeout(timeout_s):
                async with self.session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    return response.status

    async def get_json(self, url: str, headers: list[tuple[str, str]], timeout_s: float) -> object:
        with _mapped("connect"):
            async with asyncio.timeout(timeout_s):
                async with self.session.get(url, headers=headers) as response:
                    if response.status != 200:
                        raise UpstreamConnectError(f"{url} answered {response.status}")
                    return await response.json(content_type=None)
