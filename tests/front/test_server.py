"""The gateway's hold on uvicorn's internals: checked once at start, a fallback when they move,
the fast path proven under `mtp-gateway serve`, and the client writer's errors kept the
gateway's own."""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import httpx
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.front import server
from gateway.sim.server import SimOptions, start_sim_pair
from tests.conftest import circuit_open, gateway_settings, live_gateway
from tests.live import serve_app, wait_until
from tests.test_gateway_live import chat, sse_events
from tests.test_shutdown import ROOT, free_port, until_serving


def test_the_pinned_uvicorn_allows_the_fast_path() -> None:
    assert server.check_uvicorn() == server.HttpPath(server.FAST, "")


def test_a_moved_uvicorn_attribute_is_found_at_start(monkeypatch, caplog) -> None:
    monkeypatch.setattr(server, "CYCLE_STATE", (*server.CYCLE_STATE, "response_begun"))
    with caplog.at_level(logging.INFO, logger="mtp_gateway.server"):
        server.uvicorn_config(object(), build_settings({}), "warning")
    assert "relay by ASGI send, not the fast path" in caplog.text
    assert "lacks response_begun" in caplog.text
    monkeypatch.setattr(server, "PROTOCOL_STATE", (*server.PROTOCOL_STATE, "parser_state"))
    assert server.check_uvicorn().name == server.H11
    assert server.gateway_http_protocol(1024)[0] == "h11"


async def stream_once(url: str, max_tokens: int = 8) -> bytes:
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(url + "/v1/chat/completions",
                                     json=chat(max_tokens=max_tokens, stream=True))
        assert response.status_code == 200
        return response.content


def relayed(metrics: str, path: str) -> float:
    line = f'gateway_relayed_streams_total{{path="{path}"}} '
    return float(metrics.split(line)[1].split()[0]) if line in metrics else 0.0


@pytest.mark.timeout(30)
async def test_without_the_cycle_state_streams_go_by_asgi_send(sim, monkeypatch) -> None:
    monkeypatch.setattr(server, "CYCLE_STATE", (*server.CYCLE_STATE, "response_begun"))
    app = create_app(gateway_settings(sim))
    async with serve_app(app) as url, httpx.AsyncClient() as client:
        assert sse_events(await stream_once(url))[-1] == "[DONE]"
        metrics = (await client.get(url + "/metrics")).text
        assert (relayed(metrics, "send"), relayed(metrics, "writer")) == (1.0, 0.0)


@pytest.mark.timeout(40)
async def test_serve_relays_on_the_fast_path(tmp_path) -> None:
    async with start_sim_pair(SimOptions(speed=50)) as pair, httpx.AsyncClient() as client:
        port = free_port()
        config = tmp_path / "config.yaml"
        config.write_text(json.dumps({
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": {name: {"url": url} for name, url in pair.urls.items()}}))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--config", str(config),
            "--log-level", "info", cwd=ROOT, stderr=asyncio.subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            await until_serving(client, url, process)
            for _ in range(2):
                assert sse_events(await stream_once(url))[-1] == "[DONE]"
            metrics = (await client.get(url + "/metrics")).text
            assert (relayed(metrics, "writer"), relayed(metrics, "send")) == (2.0, 0.0)
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), timeout=10)
        assert process.stderr is not None
        log = (await process.stderr.read()).decode()
        assert "relay fast path: the gateway's body writer on uvicorn" in log, log


@pytest.mark.timeout(30)
async def test_an_error_in_the_gateways_own_writer_leaves_the_backends_circuit_alone(
        sim, monkeypatch) -> None:
    """Before, an exception raised by the client writer failed the upstream response as the
    backend's: every stream failed and the backend's circuit opened (a simulated rename of one
    uvicorn attribute did that)."""
    def broken_write(self: server.BodyWriter, data: bytes) -> None:
        raise AttributeError("'RequestResponseCycle' object has no attribute 'transport'")

    monitor = {"circuit_failures": 2, "circuit_open_s": 60}
    async with live_gateway(sim, monitor=monitor) as gateway, httpx.AsyncClient() as client:
        monkeypatch.setattr(server.BodyWriter, "write", broken_write)
        for _ in range(4):
            raw = await stream_once(gateway.url, max_tokens=60)
            assert '"error"' in sse_events(raw)[-2], raw[-300:]  # ended in-band, not silently
        mtp = gateway.pool.backends["mtp"]
        assert mtp.circuit.failures == 0 and not circuit_open(mtp)
        metrics = (await client.get(gateway.url + "/metrics")).text
        assert "gateway_upstream_errors_total{" not in metrics
        await wait_until(lambda: gateway.pool.concurrency == 0)
        monkeypatch.undo()
        raw = await stream_once(gateway.url)
        assert sse_events(raw)[-1] == "[DONE]" and '"error"' not in raw.decode()
