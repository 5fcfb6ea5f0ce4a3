"""The gateway's own endpoints: health, metrics, models, admin. Handlers stay thin."""

from __future__ import annotations

import hmac
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import HTMLResponse, JSONResponse, Response

from gateway.config import BACKEND_NAMES, ConfigError, build_routing
from gateway.errors import BadRequest, Forbidden, NoBackend, Unauthorized
from gateway.inbound import bearer_token, parse_json_object

router = APIRouter()
DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_text(encoding="utf-8")


def _runtime(request: Request) -> Any:
    return request.app.state.runtime


def require_admin(request: Request) -> None:
    key = _runtime(request).settings.auth.admin_key
    if not key:
        raise Forbidden("admin endpoints are disabled; set auth.admin_key to enable them")
    given = bearer_token(request.scope["headers"]) or ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise Unauthorized("invalid or missing admin key")


def require_metrics_access(request: Request) -> None:
    """Metrics and the dashboard: public unless auth.metrics_public is off."""
    if not _runtime(request).settings.auth.metrics_public:
        require_admin(request)


def fallback_state(missing: frozenset[str]) -> dict[str, Any]:
    """What a backend lacking SGLang's own endpoints costs the routing (monitor.py)."""
    fallback = None
    if missing:
        fallback = f"no {', '.join(sorted(missing))}: routed on the gateway's own in-flight counts"
    return {"missing_endpoints": sorted(missing), "fallback": fallback}


def routing_state(runtime: Any, *, with_urls: bool) -> dict[str, Any]:
    """The router's state as JSON: what /admin/state and the dashboard show."""
    r = runtime.router
    backends = {}
    for name in BACKEND_NAMES:
        health = r.health[name]
        backends[name] = {
            "inflight": r.inflight[name], "served": r.served[name], "up": health.up,
            "circuit_open": health.circuit_open, "circuit_half_open": health.half_open,
            "effective_cap": health.effective_cap,
            "accept_length": health.accept_length, "running": health.reported_running,
            "waiting": health.reported_waiting,
            **fallback_state(runtime.monitor.missing[name]),
        }
        if with_urls:
            backends[name]["url"] = runtime.settings.backends.get(name).url
    ttft = {name: {"sum": total, "count": count}
            for name, (total, count) in runtime.metrics.ttft_totals.items()}
    return {
        "ttft": ttft,
        "mode": r.mode, "mode_for_s": round(time.monotonic() - r.mode_since, 3),
        "concurrency": r.concurrency, "crossover": r.crossover,
        "routing": r.routing.model_dump(mode="json"),
        "backends": backends, "sessions": len(r.sessions),
    }


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    runtime = _runtime(request)
    state = routing_state(runtime, with_urls=False)
    usable = [n for n, b in state["backends"].items() if b["up"] and not b["circuit_open"]]
    body = {"status": "ok" if usable else "unavailable", "mode": state["mode"],
            "concurrency": state["concurrency"], "backends": state["backends"]}
    return JSONResponse(body, status_code=200 if usable else 503)


@router.get("/livez")
async def livez() -> JSONResponse:
    """Liveness (Kubernetes' livenessProbe): the event loop answers. Says nothing about the
    backends, so an outage of both does not get the gateways restarted; /health does."""
    return JSONResponse({"status": "alive"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    require_metrics_access(request)
    runtime = _runtime(request)
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    runtime = _runtime(request)
    if runtime.monitor.model_payload is None:
        await runtime.monitor.probe_all()
    if runtime.monitor.model_payload is None:
        raise NoBackend("no backend has answered /v1/models yet")
    return JSONResponse(runtime.monitor.model_payload)


@router.get("/admin/state")
async def admin_state(request: Request) -> JSONResponse:
    require_admin(request)
    return JSONResponse(routing_state(_runtime(request), with_urls=True))


@router.get("/dashboard/state")
async def dashboard_state(request: Request) -> JSONResponse:
    require_metrics_access(request)
    return JSONResponse(routing_state(_runtime(request), with_urls=False))


@router.get("/dashboard")
async def dashboard(request: Request) -> HTMLResponse:
    require_metrics_access(request)
    return HTMLResponse(DASHBOARD_HTML)


@router.put("/admin/routing")
async def put_routing(request: Request) -> JSONResponse:
    """Change routing at runtime: a partial routing section, merged over the current one."""
    require_admin(request)
    runtime = _runtime(request)
    changes = parse_json_object(await request.body())
    merged = {**runtime.settings.routing.model_dump(), **changes}
    try:
        routing = build_routing(merged)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from exc
    runtime.apply_routing(runtime.settings.model_copy(update={"routing": routing}))
    return JSONResponse(routing.model_dump(mode="json"))

