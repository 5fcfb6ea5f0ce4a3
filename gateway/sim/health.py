"""/health (one generated token, 503 when failing or past SGLANG_HEALTH_CHECK_TIMEOUT), /ready
and /ping of a simulated server."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
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
            Route("/", self.root, methods=["GET", "HEAD"]),
        ]

    async def health(self, request: Request) -> Response:
        """As SGLang (http_server.py:721-799): send a one-token request, then every 1 s
        (scaled) look whether anything came back from the scheduler since: 200 at the first
        look that finds it, 503 after the 20 s, which also marks the server unhealthy. A busy
        scheduler skips the probe (its running requests' outputs answer for it,
        scheduler.py:2240-2247); a paused server's probe waits in the tokenizer, so after 20 s
        of pause /health is 503 and /ready, /ping too. 503 at once under a sim fault."""
        if self.faults.failing:
            return Response(status_code=503)
        scale = 1 / self.live.speed  # real seconds per simulated second
        loop = asyncio.get_running_loop()
        tic = loop.time()
        probe = asyncio.create_task(self._health_probe())
        try:
            while loop.time() < tic + HEALTH_TIMEOUT_S * scale:
                await asyncio.sleep(HEALTH_MIN_S * scale)
                if self.live.last_output_at > tic:
                    self.context.healthy = True
                    return Response(status_code=200)
        finally:
            probe.cancel()
        self.context.healthy = False
        return Response(status_code=503)

    async def _health_probe(self) -> None:
        await self.faults.wait_unhung()
        if not self.live.engine.is_fully_idle:
            return  # skipped by a busy scheduler
        rid = f"HEALTH_CHECK_{formats.new_rid()}"
        try:
            queue = self.live.submit(EngineRequest(rid, [0], 1))
        except (QueueFullError, ValueError):
            return
        try:
            await queue.get()
        finally:
            self.live.abort(rid, exact=True)  # after a timeout, do not leave it running

    async def ready(self, request: Request) -> Response:
        """http_server.py:714-718: not paused and healthy (tokenizer_manager.py:732-734)."""
        ready = self.context.healthy and not self.context.saver.state.tokenizer_paused
        return Response(status_code=200 if ready else 503)

    async def root(self, request: Request) -> Response:
        """http_server.py:2124-2128 (SGLANG_OLLAMA_ROOT_ROUTE unset); behind the API key."""
        return JSONResponse("SGLang is running")

    async def ping(self, request: Request) -> Response:
        """SageMaker's /ping (http_server.py:2189-2199): healthy, paused or not."""
        return Response(status_code=200 if self.context.healthy else 503)
