"""A backend with only the OpenAI endpoints (no SGLang `/v1/loads` nor `/server_info`) stays
usable: an OpenAI-compatible server that is not SGLang, or SGLang's own router in front of a
pool (tests/test_sglang_router.py). The gateway then routes on its own counts and says so once
in the log and in `/admin/state`."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.sim.server import SimOptions, start_sim_pair
from tests.conftest import live_gateway
from tests.live import serve_app

ADMIN = {"authorization": "Bearer admin"}
MODEL = "minimal-model"


class MinimalOpenAI:
    """/v1/models and /v1/chat/completions, nothing else: every other path is a 404."""

    def __init__(self) -> None:
        self.models_status = 200
        self.served = 0
        self.app = Starlette(routes=[
            Route("/v1/models", self._models),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ])

    async def _models(self, request: Request) -> Response:
        if self.models_status != 200:
            return JSONResponse({"error": "no workers"}, self.models_status)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.served += 1
        chunk = {"id": "m", "object": "chat.completion.chunk", "model": MODEL, "choices": [
            {"index": 0, "delta": {"content": "minimal"}, "finish_reason": "stop"}]}
        if body.get("stream"):
            async def events() -> AsyncIterator[bytes]:
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"id": "m", "object": "chat.completion", "model": MODEL, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "minimal"},
             "finish_reason": "stop"}]})


@contextlib.asynccontextmanager
async def gateway_with_minimal_mtp(backend: MinimalOpenAI) -> AsyncIterator[Any]:
    """The gateway with the minimal server as `mtp` and a simulated SGLang server as `plain`.
    The monitor's own loop runs once; the test drives every further probe round."""
    async with serve_app(backend.app) as minimal_url, \
            start_sim_pair(SimOptions(speed=50)) as pair:
        backends = SimpleNamespace(urls={"mtp": minimal_url, "plain": pair.urls["plain"]})
        async with live_gateway(backends, monitor={"interval_s": 3600.0},
                                auth={"admin_key": "admin"}) as gateway:
            yield gateway


async def probe_rounds(gateway: Any, rounds: int) -> None:
    for _ in range(rounds):
        await gateway.runtime.probes.probe_all()


@pytest.mark.timeout(30)
async def test_backend_without_loads_or_server_info_keeps_serving(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="mtp_gateway.monitor")
    backend = MinimalOpenAI()
    async with gateway_with_minimal_mtp(backend) as gateway, httpx.AsyncClient() as client:
        fall = gateway.runtime.settings.monitor.fall
        await probe_rounds(gateway, 3 * fall)  # more than enough failures to mark it down
        for stream in (False, True):
            response = await client.post(gateway.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "stream": stream})
            assert response.status_code == 200, response.text
            assert response.headers["x-gateway-backend"] == "mtp"
            assert "minimal" in response.text
        assert backend.served == 2

        state = (await client.get(gateway.url + "/admin/state", headers=ADMIN)).json()
        mtp, plain = state["backends"]["mtp"], state["backends"]["plain"]
        assert mtp["up"] is True
        assert mtp["missing_endpoints"] == ["/server_info", "/v1/loads"]
        assert "own in-flight counts" in mtp["fallback"]
        assert mtp["effective_cap"] is None and mtp["running"] is None
        assert plain["missing_endpoints"] == [] and plain["fallback"] is None
        assert plain["effective_cap"] is not None  # the SGLang side still reads its cap

        said = [r.getMessage() for r in caplog.records if "has no" in r.getMessage()]
        assert len(said) == 1, said  # once, not every probe
        assert said[0].startswith("backend mtp has no /server_info or /v1/loads")


@pytest.mark.timeout(30)
async def test_backend_without_loads_is_still_probed(caplog) -> None:
    """The fallback probe is /v1/models: a server that stops answering it is still marked down
    (as SGLang's router does while no worker is registered: 503 "No models available")."""
    backend = MinimalOpenAI()
    async with gateway_with_minimal_mtp(backend) as gateway, httpx.AsyncClient() as client:
        fall = gateway.runtime.settings.monitor.fall
        await probe_rounds(gateway, fall)
        assert gateway.pool.backends["mtp"].up
        backend.models_status = 503
        await probe_rounds(gateway, fall)
        assert not gateway.pool.backends["mtp"].up
        response = await client.post(gateway.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert response.headers["x-gateway-backend"] == "plain"
        backend.models_status = 200
        await probe_rounds(gateway, gateway.runtime.settings.monitor.rise)
        assert gateway.pool.backends["mtp"].up
