"""The app factory. Everything the gateway uses is built here and owned by the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.apis import PROXY_PATHS
from gateway.apis.errors import BadRequest, GatewayError, MethodNotAllowed, NotFound
from gateway.config import ConfigError, Settings, build_settings, read_yaml
from gateway.front.endpoints import router as api_routes
from gateway.metrics import GatewayMetrics
from gateway.relay.asgi import Receive, Scope, Send
from gateway.relay.endpoint import ProxyEndpoint
from gateway.routing.pool import Pool
from gateway.routing.sessions import ResponseStore
from gateway.turns.wiring import build_turns
from gateway.upstream.client import Upstream
from gateway.upstream.probes import Probes

log = logging.getLogger("mtp_gateway")


class Runtime:
    """The live objects of one gateway, reachable from handlers as `app.state.runtime`."""

    def __init__(self, settings: Settings, registry: CollectorRegistry,
                 config_path: Path | None) -> None:
        self.settings = settings
        self.config_path = config_path
        self.pool = Pool.from_settings(settings, time.monotonic())
        self.metrics = GatewayMetrics(registry, self.pool)
        self.upstream = Upstream(connect_timeout_s=settings.timeouts.connect_s)
        self.probes = Probes(lambda: self.settings, self.pool, self.upstream)
        self.responses = ResponseStore()
        self.proxy = ProxyEndpoint(lambda: self.settings, self.pool, self.upstream, self.metrics,
                                   self.responses)
        self.turns = build_turns(settings, self.pool, self.upstream, self.proxy.in_flight, registry)
        self.proxy.waiting = self.turns.waiting

    def apply_routing(self, settings: Settings) -> None:
        """Swap in a new routing section (and the pairs' own routing values, when the pairs
        are the same servers): `settings` is where they live; each pair's routing is derived
        from them and the next decision uses it."""
        update: dict[str, Any] = {"routing": settings.routing}
        if _servers(settings) == _servers(self.settings):
            update["pairs"] = settings.pairs
        self.settings = self.settings.model_copy(update=update)
        self.pool.apply_routing(self.settings)

    async def watch_config(self, every_s: float = 1.0) -> None:
        """Hot reload: apply a changed routing section; keep the old one on a bad edit."""
        assert self.config_path is not None
        last = self.config_path.stat().st_mtime_ns
        while True:
            await asyncio.sleep(every_s)
            try:
                mtime = self.config_path.stat().st_mtime_ns
            except OSError:
                continue
            if mtime != last:
                last = mtime
                self.reload_from_file()

    def reload_from_file(self) -> bool:
        assert self.config_path is not None
        try:
            fresh = build_settings(read_yaml(self.config_path))
        except ConfigError as exc:
            log.error("config reload rejected, keeping the running settings: %s", exc)
            return False
        pairs_retuned = (_servers(fresh) == _servers(self.settings)
                         and _pair_routing(fresh) != _pair_routing(self.settings))
        if fresh.routing != self.settings.routing or pairs_retuned:
            self.apply_routing(fresh)
            log.warning("routing reloaded from %s: %s", self.config_path, fresh.routing)
        ignored = [k for k in ("listen", "backends", "timeouts", "limits", "auth", "monitor",
                                 "log", "memory", "turns") if getattr(fresh, k) != getattr(self.settings, k)]
        if _servers(fresh) != _servers(self.settings):
            ignored.append("pairs")
        if ignored:
            log.warning("config sections %s changed; they take effect on restart", ignored)
        return True


def _servers(settings: Settings) -> list[tuple[str, object, object]]:
    return [(p.name, p.mtp, p.plain) for p in settings.pairs]


def _pair_routing(settings: Settings) -> list[dict[str, Any]]:
    return [p.routing for p in settings.pairs]


class GatewayApp:
    """The ASGI entry point. Proxied paths go straight to the relay: every streamed chunk
    would otherwise pass through the framework's middleware send-wrappers and route matching.
    Everything else (lifespan, health, metrics, admin, dashboard) is the FastAPI app."""

    def __init__(self, api: FastAPI, proxy: ProxyEndpoint) -> None:
        self.api = api
        self.proxy = proxy
        self.state = api.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PROXY_PATHS:
            await self.proxy(scope, receive, send)
        else:
            await self.api(scope, receive, send)


def create_app(settings: Settings, *, registry: CollectorRegistry | None = None,
               config_path: str | Path | None = None) -> GatewayApp:
    runtime = Runtime(settings, registry or CollectorRegistry(),
                      Path(config_path) if config_path else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await runtime.upstream.start()
        tasks = [asyncio.create_task(runtime.probes.run(), name="monitor"),
                 *runtime.turns.start()]
        if runtime.config_path is not None:
            tasks.append(asyncio.create_task(runtime.watch_config(), name="config-watch"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if runtime.proxy.aborts.background:  # aborts still on their way to the backends
                await asyncio.wait(runtime.proxy.aborts.background, timeout=2.0)
            await runtime.upstream.close()

    app = FastAPI(title="mtp-gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    app.include_router(api_routes)
    _install_error_mapping(app)
    return GatewayApp(app, runtime.proxy)


def _install_error_mapping(app: FastAPI) -> None:
    """Every error leaves the gateway OpenAI-shaped; this is the one place that says so."""

    async def gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return Response(exc.to_bytes(), status_code=exc.status, headers=exc.headers,
                        media_type="application/json")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        mapped: GatewayError
        if exc.status_code == 404:
            mapped = NotFound(f"no such endpoint: {request.method} {request.url.path}")
        elif exc.status_code == 405:
            mapped = MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}")
        else:
            mapped = BadRequest(str(exc.detail))
            mapped.status = exc.status_code
        mapped.headers = dict(exc.headers or {})  # e.g. Allow, which a 405 must carry
        return await gateway_error(request, mapped)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request"}
        return await gateway_error(request, BadRequest(f"invalid request: {first['msg']}"))

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
