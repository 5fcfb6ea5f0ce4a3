"""/health (one generated token, 503 when failing or past SGLANG_HEALTH_CHECK_TIMEOUT), /ready
and /ping of a simulated server."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.sim import formats
from gateway.sim.context import ServerContext
from gateway.sim.engine import QueueFullError
from gateway.sim.engine import Request as EngineRequest

HEALTH_MIN_S = 1.0  # SGLang's /health generates one token and polls in 1 s sleeps
HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT


class Health:
    def __init__(self, context: ServerContext) -> None:
        self.context = context
        self.live = context.live
        self.faults = context.faults

    def routes(self) -> list[Route]:
        get = ["GET"]
        return [
            Route("/health", self.health, methods=get),
            Route("/health_generate", self.health, methods=get),
            Route("/ready", self.ready, methods=get),
            Route("/ping", self.ping, methods=get),
        ]

    async def health(self, request: Request) -> Response:
        """Like SGLang: generate one token, at least ~1 s (scaled); 503 when failing. Past the
        20 s the server is marked unhealthy (http_server.py:779-798): a paused server's probe
        waits in the tokenizer, so after 20 s of pause /health is 503 and /ready, /ping too."""
        scale = 1 / self.live.speed  # real seconds per simulated second
        if self.faults.failing:
            return Response(status_code=503)
        probe = self._health_probe()
        floor = asyncio.sleep(HEALTH_MIN_S * scale)
        try:
            ok, _ = await asyncio.wait_for(asyncio.gather(probe, floor), HEALTH_TIMEOUT_S * scale)
        except TimeoutError:
            self.context.healthy = ok = False
        if ok:
            self.context.healthy = True
        return Response(status_code=200 if ok else 503)

    async def _health_probe(self) -> bool:
        await self.faults.wait_unhung()
        rid = f"HEALTH_CHECK_{formats.new_rid()}"
        try:
            queue = self.live.submit(EngineRequest(rid, [0], 1))
        except (QueueFullError, ValueError):
            return False
        try:
            return (await queue.get()).finish_reason == "length"
        finally:
            self.live.abort(rid, exact=True)  # after a timeout, do not leave it running

    async def ready(self, request: Request) -> Response:
        """http_server.py:714-718: not paused and healthy (tokenizer_manager.py:732-734)."""
        ready = self.context.healthy and not self.context.saver.state.tokenizer_paused
        return Response(status_code=200 if ready else 503)

    async def ping(self, request: Request) -> Response:
        """SageMaker's /ping (http_server.py:2189-2199): healthy, paused or not."""
        return Response(status_code=200 if self.context.healthy else 503)
