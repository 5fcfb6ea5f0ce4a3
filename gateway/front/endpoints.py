"""The gateway's own endpoints (health, metrics, dashboard, admin) and the small GETs it asks
a backend (models, server_info, stored responses). Handlers stay thin."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.responses import HTMLResponse, JSONResponse, Response

from gateway.apis.errors import BadRequest, Forbidden, Unauthorized
from gateway.config import ConfigError, build_routing, describe_validation_error
from gateway.front.aliases import card_as, listed_with_aliases
from gateway.front.passthrough import pass_through
from gateway.relay.admission import check_client_key
from gateway.relay.inbound import bearer_token, parse_json_object
from gateway.routing.backend import BackendState
from gateway.routing.pair import PairState
from gateway.routing.pool import Pool

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


def backend_state(backend: BackendState, now: float, *, with_urls: bool) -> dict[str, Any]:
    circuit, loads = backend.circuit, backend.loads
    state = {
        "pair": backend.pair, "role": backend.role,
        "inflight": backend.inflight, "served": backend.served, "up": backend.up,
        "circuit_open": circuit.is_open(now), "circuit_half_open": circuit.is_half_open(now),
        "circuit_failures": circuit.failures,
        "effective_cap": backend.effective_cap, "accept_length": backend.accept_length,
        "running": None if loads is None else loads.running,
        "waiting": None if loads is None else loads.waiting,
        "loads_age_s": None if loads is None else round(now - loads.at, 3),
        **fallback_state(backend.missing_endpoints),
    }
    if with_urls:
        state["url"] = backend.target.url
    return state


def pair_state(pair: PairState, now: float) -> dict[str, Any]:
    return {
        "name": pair.name, "mode": pair.mode, "mode_for_s": round(now - pair.mode_since, 3),
        "concurrency": pair.concurrency, "crossover": pair.crossover, "moved": pair.moved,
        "learning": pair.learning_state(), "routing": pair.routing.model_dump(mode="json"),
        "backends": [b.name for b in pair.backends.values()],
    }


def routing_state(runtime: Any, *, with_urls: bool) -> dict[str, Any]:
    """The pool's state as JSON: what /admin/state and the dashboard show. The top-level mode,
    crossover and learning are the first pair's (the only one, without `pairs`)."""
    pool: Pool = runtime.pool
    now = time.monotonic()
    pairs = [pair_state(p, now) for p in pool.pairs.values()]
    ttft = {name: {"sum": total, "count": count}
            for name, (total, count) in runtime.metrics.ttft_totals.items()}
    first = pairs[0]
    for pair in pairs:  # a turns pair's memory (gateway/turns): who holds it, the turn's step
        driver = pool.pairs[pair["name"]].turns
        pair["memory"] = driver.describe() if driver is not None else {"phase": "split"}
        # the shape, configured or chosen by `memory: auto`, and why (gateway/turns/shape.py)
        pair["memory_shape"] = runtime.turns.shape_of(pair["name"]).describe()
    return {
        "ttft": ttft,
        "mode": first["mode"], "mode_for_s": first["mode_for_s"],
        "concurrency": pool.concurrency, "crossover": first["crossover"],
        "learning": first["learning"],
        "routing": runtime.settings.routing.model_dump(mode="json"),
        "pairs": pairs,
        "backends": {name: backend_state(b, now, with_urls=with_urls)
                     for name, b in pool.backends.items()},
        "sessions": len(pool.sessions),
        "memory_turn_waiting": 0 if runtime.proxy.waiting is None else runtime.proxy.waiting.waiting,
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


def _by_mode(pool: Pool) -> list[BackendState]:
    """Each pair's backend of its current mode, then the others."""
    first = [p.backends[p.mode] for p in pool.pairs.values()]
    return first + [b for b in pool.backends.values() if b not in first]


async def _from_backends(request: Request, path: str, order: list[BackendState] | None = None,
                         *, next_on_404: bool = False,
                         reshape: Callable[[bytes], bytes] | None = None) -> Response:
    """Answered by a backend, as SGLang answers it, behind the client key like SGLang's
    --api-key. By default the backend of the current mode first, the others if it fails.
    `reshape` changes a 200's body (the model aliases on /v1/models)."""
    runtime = _runtime(request)
    headers = request.scope["headers"]
    check_client_key(headers, runtime.settings)
    status, upstream_headers, body, backend = await pass_through(
        runtime.upstream, runtime.settings.timeouts.idle_s, request.method, path, headers,
        order or _by_mode(runtime.pool), next_on_404=next_on_404)
    if reshape is not None and status == 200:
        body = reshape(body)
    return Response(body, status_code=status, headers={
        **{k.decode("latin-1"): v.decode("latin-1") for k, v in upstream_headers},
        "x-gateway-backend": backend.name})


@router.api_route("/", methods=["GET", "HEAD"])
async def root(request: Request) -> JSONResponse:
    """SGLang's root (http_server.py:2124-2128), behind the client key as every path not
    /health, /ready or /metrics is (utils/auth.py:99-106): Claude Code sends HEAD / before its
    first request, and a 404 there is what SGLang would never answer."""
    check_client_key(request.scope["headers"], _runtime(request).settings)
    return JSONResponse("SGLang is running")


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The backend's list; with models.list_aliases, each alias that is a name (not a
    pattern) listed too, as a copy of its served model's card."""
    aliases = _runtime(request).settings.models
    if not aliases.list_aliases:
        return await _from_backends(request, "/v1/models")
    exact = aliases.exact_aliases()
    return await _from_backends(request, "/v1/models",
                                reshape=lambda listing: listed_with_aliases(listing, exact))


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> Response:
    """The backend's card; with models.list_aliases, a name an alias matches (a pattern's
    too) is answered with its served model's card under that name."""
    aliases = _runtime(request).settings.models
    served = aliases.served_name(model) if aliases.list_aliases else None
    if served is None or served == model:
        return await _from_backends(request, request.url.path)
    return await _from_backends(request, "/v1/models/" + quote(served),
                                reshape=lambda card: card_as(card, model))


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    """The MTP server's: its speculative accept length is what SGLang's own tools read
    (bench_serving uses it to count inter-token latency per token); the plain one when MTP
    does not answer."""
    backends = _runtime(request).pool.backends.values()
    order = sorted(backends, key=lambda b: b.role != "mtp")  # every MTP server first
    return await _from_backends(request, request.url.path, order)


@router.get("/v1/responses/{response_id}")
@router.post("/v1/responses/{response_id}/cancel")
async def stored_response(request: Request, response_id: str) -> Response:
    """A stored response lives on the server that made it: asked there first (both, in turn,
    when the gateway does not know it, e.g. after a restart)."""
    pool: Pool = _runtime(request).pool
    holder = pool.backends.get(_runtime(request).responses.holder(response_id) or "")
    order = list(pool.backends.values())
    if holder is not None:
        order = [holder] + [b for b in order if b is not holder]
    return await _from_backends(request, request.url.path, order, next_on_404=True)


@router.get("/admin/state")
async def admin_state(request: Request) -> JSONResponse:
    require_admin(request)
    return JSONResponse(routing_state(_runtime(request), with_urls=True))


@router.get("/dashboard/state")
async def dashboard_state(request: Request) -> JSONResponse:
    require_metrics_access(request)
    return JSONResponse(routing_state(_runtime(request), with_urls=False))


@router.get("/turns/state")
async def turns_state(request: Request) -> JSONResponse:
    """Each turns pair's memory state (gateway/turns): what the replicas that follow this
    gateway's turns read (turns.controller_url)."""
    require_metrics_access(request)
    return JSONResponse({"pairs": _runtime(request).turns.state()})


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
        updated = runtime.settings.model_copy(update={"routing": routing})
        for pair in updated.pairs:  # each pair's own values must still fit the new section
            updated.routing_for(pair)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from exc
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(exc, prefix="routing")) from exc
    runtime.apply_routing(updated)
    return JSONResponse(routing.model_dump(mode="json"))

