"""Small requests a backend answers whole (models, server info, a stored response), asked of
the backends in a given order until one answers."""

from __future__ import annotations

import asyncio

from gateway.apis.errors import (
    GatewayError,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
    no_healthy_backend,
    openai_shaped,
)
from gateway.relay.asgi import RawHeaders
from gateway.relay.inbound import Headers, upstream_headers
from gateway.routing.backend import BackendState
from gateway.upstream.client import Upstream


async def pass_through(upstream: Upstream, idle_s: float, method: str, path: str,
                       client_headers: Headers, order: list[BackendState], *,
                       next_on_404: bool = False) -> tuple[int, RawHeaders, bytes, BackendState]:
    """A small request answered by the first backend in `order` that answers (the next
    one on a connection error or 5xx, and on 404 when asked): status, headers, body. A backend
    silent for `idle_s` is stuck: the next one is asked."""
    failure: GatewayError = no_healthy_backend()
    for index, state in enumerate(order):
        target, backend = state.target, state.name
        headers = upstream_headers(client_headers, target.api_key)
        try:
            async with asyncio.timeout(idle_s):
                response = await upstream.send(method, target.url + path, headers,
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
