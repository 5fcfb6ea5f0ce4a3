"""The gateway's own endpoints (health, metrics, dashboard, admin) and the small GETs it asks
a backend (models, server_info, stored responses). Handlers stay thin."""

from __future__ import annotations

import hmac
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import HTMLResponse, JSONResponse, Response

from gateway.config import BACKEND_NAMES, BackendName, ConfigError, build_routing
from gateway.errors import BadRequest, Forbidden, Unauthorized
from gateway.inbound import bearer_token, parse_json_object
from gateway.policy import other

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
        "learning": r.learning_state(),
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


async def _from_backends(request: Request, path: str, order: list[BackendName] | None = None,
                         *, next_on_404: bool = False) -> Response:
    """Answered by a backend, as SGLang answers it, behind the client key like SGLang's
    --api-key. By default the backend of the current mode first, the other one if it fails."""
    runtime = _runtime(request)
    headers = request.scope["headers"]
    runtime.proxy.check_client_key(headers, runtime.settings)
    if order is None:
        mode = runtime.router.mode
        order = [mode, other(mode)]
    status, upstream_headers, body, backend = await runtime.proxy.pass_through(
        request.method, path, headers, order, next_on_404=next_on_404)
    return Response(body, status_code=status, headers={
        **{k.decode("latin-1"): v.decode("latin-1") for k, v in upstream_headers},
        "x-gateway-backend": backend})


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return await _from_backends(request, "/v1/models")


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> Response:
    return await _from_backends(request, request.url.path)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    """The MTP server's: its speculative accept length is what SGLang's own tools read
    (bench_serving uses it to count inter-token latency per token); the plain one when MTP
    does not answer."""
    return await _from_backends(request, request.url.path, ["mtp", "plain"])


@router.get("/v1/responses/{response_id}")
@router.post("/v1/responses/{response_id}/cancel")
async def stored_response(request: Request, response_id: str) -> Response:
    """A stored response lives on the server that made it: asked there first (both, in turn,
    when the gateway does not know it, e.g. after a restart)."""
    holder = _runtime(request).proxy.stored.get(response_id)
    order: list[BackendName] = ["mtp", "plain"] if holder is None else [holder, other(holder)]
    return await _from_backends(request, request.url.path, order, next_on_404=True)


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

