"""The ASGI types the gateway's raw endpoints use, and the one way they answer with an error.

Proxied paths bypass the framework (see app.GatewayApp): these are the shapes they speak."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.apis import OPENAI_API
from gateway.apis.errors import GatewayError

Scope = MutableMapping[str, Any]  # as ASGI servers and Starlette type them
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]


async def send_error(send: Send, exc: GatewayError, extra: RawHeaders | None = None,
                     api: str = OPENAI_API) -> None:
    """A whole error response in the shape of the API the request came in on."""
    body = exc.to_bytes(api)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})
