"""Run an ASGI app under a real uvicorn server on 127.0.0.1, port 0, in the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import uvicorn

from gateway.front.server import gateway_http_protocol


@contextlib.asynccontextmanager
async def serve_app(app: object, *, graceful_s: int | None = None,
                    stock_uvicorn: bool = False) -> AsyncIterator[str]:
    """Serve `app` as the gateway serves itself (uvicorn with the gateway's HTTP protocol), or
    with uvicorn as shipped: a server without the gateway's synchronous body writer."""
    http, _ = ("auto", 0) if stock_uvicorn else gateway_http_protocol(64 * 1024)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                            access_log=False, timeout_graceful_shutdown=graceful_s,
                            http=http)  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started or task.done(), timeout=10)
    if task.done():
        task.result()
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=15)


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0,
                     interval: float = 0.005) -> None:
    """Poll a condition with a deadline: no sleep-and-hope."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)
