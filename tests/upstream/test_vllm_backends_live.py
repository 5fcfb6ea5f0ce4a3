"""The gateway with `engine: vllm` in front of the simulated vLLM 0.33.0 split pair (port 0):
the monitor reads vLLM's load from /metrics and its running cap from the dev-mode
/server_info, and a client that leaves is aborted by the closed connection alone: no SGLang
/abort_request is sent to a vLLM server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from gateway.sim.vllm.app import VllmOptions
from tests.conftest import LiveGateway
from tests.live import serve_app, wait_until

MODEL = "Qwen/Qwen3.5-122B-A10B"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 100000,
        "ignore_eos": True, "stream": True}


@contextlib.asynccontextmanager
async def vllm_gateway(engine: str = "vllm", dev_mode: bool = True
                       ) -> AsyncIterator[tuple[SimPair, LiveGateway, list[str]]]:
    """The split vLLM pair behind a gateway; the URLs the gateway POSTs control calls to."""
    options = SimOptions(speed=5, engine="vllm", vllm=VllmOptions(dev_mode=dev_mode, max_num_seqs=3))
    async with start_sim_pair(options) as pair:
        settings = build_settings({
            "backends": {name: {"url": url} for name, url in pair.urls.items()}, "engine": engine,
            "routing": {"policy": "plain-only"}, "monitor": {"interval_s": 0.05},
            "log": {"access": False}})
        app = create_app(settings, registry=CollectorRegistry())
        posted: list[str] = []
        upstream = app.state.runtime.upstream
        post_json = upstream.post_json

        async def recording(url: str, *args: Any, **kwargs: Any) -> Any:
            posted.append(url)
            return await post_json(url, *args, **kwargs)

        upstream.post_json = recording
        async with serve_app(app) as url:
            yield pair, LiveGateway(app, url), posted


@pytest.mark.timeout(30)
async def test_the_monitor_reads_vllms_load_and_running_cap():
    async with vllm_gateway() as (pair, gateway, _), httpx.AsyncClient(timeout=20) as client:
        plain = gateway.pool.backends["plain"]
        await wait_until(lambda: plain.effective_cap == 3, timeout=5)  # max_num_seqs
        streams = [asyncio.create_task(client.post(gateway.url + "/v1/chat/completions", json=LONG))
                   for _ in range(4)]
        await wait_until(lambda: plain.loads is not None and (plain.loads.running, plain.loads.waiting)
                         == (3, 1), timeout=5)  # vllm:num_requests_running / _waiting
        assert plain.missing_endpoints == frozenset() and plain.up
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)


@pytest.mark.timeout(30)
async def test_without_dev_mode_the_load_is_still_read_and_the_cap_said_missing():
    async with vllm_gateway(dev_mode=False) as (pair, gateway, _):
        plain = gateway.pool.backends["plain"]
        await wait_until(lambda: plain.loads is not None, timeout=5)
        assert plain.missing_endpoints == frozenset({"/server_info?config_format=json"})
        assert plain.effective_cap is None and plain.up


@pytest.mark.timeout(30)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_client_leaving_is_aborted_by_the_closed_connection_alone(engine: str):
    """api_utils.py:53-100: vLLM aborts a request whose connection closed; it has no
    /abort_request (that is SGLang's, and the sglang engine module sends it)."""
    async with vllm_gateway(engine) as (pair, gateway, posted), httpx.AsyncClient() as client:
        server = pair.servers["plain"].live.engine
        async with client.stream("POST", gateway.url + "/v1/chat/completions", json=LONG) as response:
            async for _ in response.aiter_bytes():
                break  # one piece, then the client leaves
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)
        await wait_until(lambda: server.num_running == 0, timeout=5)
        await wait_until(lambda: not gateway.runtime.proxy.aborts.background, timeout=5)
        aborts = [url for url in posted if url.endswith("/abort_request")]
        # sglang: what the gateway sent vLLM servers before the engine was chosen per pair
        assert aborts == ([] if engine == "vllm" else [pair.urls["plain"] + "/abort_request"])


@pytest.mark.timeout(30)
async def test_a_stream_its_vllm_server_breaks_ends_with_the_apis_error_not_a_continuation(caplog):
    """A continuation counts the answer so far at /v1/tokenize, which vLLM serves at /tokenize
    (entrypoints/serve/tokenize/api_router.py:36): the broken stream ends with chat's error
    event then [DONE], as one that cannot be continued."""
    from gateway.sim.faults import Faults

    async with vllm_gateway() as (pair, gateway, _), httpx.AsyncClient(timeout=20) as client:
        await pair.servers["plain"].set_faults(Faults(crash_after_chunks=3))
        body = {**LONG, "max_tokens": 50}
        async with client.stream("POST", gateway.url + "/v1/chat/completions", json=body) as response:
            text = (await response.aread()).decode()
        assert response.status_code == 200
        assert '"error"' in text.rsplit("data: {", 1)[-1] and text.rstrip().endswith("data: [DONE]")
        metrics = (await client.get(gateway.url + "/metrics")).text
        assert "gateway_continued_requests_total{" not in metrics
        assert "could not count the answer so far (/v1/tokenize: HTTP 404)" in caplog.text
        await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)
