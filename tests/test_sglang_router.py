"""Deployment path 2, live on loopback: each pool behind SGLang's own router (sglang-router,
the PyPI wheel with the Rust router inside), the gateway routing between the two routers
(deploy/k8s/overlays/pools). Everything is started and stopped by the test.

The router answers neither /v1/loads nor /server_info (404 in 0.3.2): the gateway keeps both
pools usable on its own counts (tests/test_minimal_backend.py) and says so in /admin/state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.server import SimOptions, start_sim_pair
from tests.conftest import live_gateway
from tests.live import wait_until

try:
    import sglang_router  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # in the test extra: CI must run this test, not skip it
    pytest.skip("sglang-router is not installed: pip install -e '.[test]'", allow_module_level=True)

ADMIN = {"authorization": "Bearer admin"}
# The router registers each worker by asking it for its model, then tries to fetch that model's
# tokenizer from the Hugging Face hub. This machine may reach nothing but loopback: any
# outside request goes to a closed loopback port and fails at once (the router carries on).
OFFLINE = {"HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
           **{k: "http://127.0.0.1:9" for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")}}


def _free_port() -> int:
    # sglang-router refuses --port 0; a port free a moment ago (retried below if taken since).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.asynccontextmanager
async def sglang_router(worker_url: str, log_dir: Path) -> AsyncIterator[str]:
    """One router in front of one pool (here a pool of one simulated server), until it is ready."""
    for _ in range(3):
        port, metrics_port = _free_port(), _free_port()
        log_path = log_dir / f"router-{port}.log"
        with open(log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--worker-urls", worker_url, "--policy", "cache_aware",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--log-level", "warn", stdout=log, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **OFFLINE})
        url = f"http://127.0.0.1:{port}"
        try:
            if await _ready(url, proc):
                yield url
                return
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        if "in use" not in log_path.read_text(errors="replace"):
            raise AssertionError(f"sglang-router did not start:\n{log_path.read_text()[-2000:]}")
    raise AssertionError("no free port for sglang-router after 3 attempts")


async def _ready(url: str, proc: asyncio.subprocess.Process, timeout_s: float = 30) -> bool:
    """True once the router has registered its worker (/readiness 200); False if it exited."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while proc.returncode is None:
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url + "/readiness")).status_code == 200:
                    return True
            assert time.monotonic() < deadline, f"sglang-router at {url} not ready in {timeout_s} s"
            await asyncio.sleep(0.05)
    return False


async def requests_served(client: httpx.AsyncClient, sim_url: str) -> float:
    text = (await client.get(sim_url + "/metrics")).text
    return sum(s.value for family in text_string_to_metric_families(text)
               if family.name == "sglang:num_requests" for s in family.samples
               if s.name.endswith("_total"))


@pytest.mark.timeout(90)
async def test_gateway_routes_between_two_sglang_router_pools() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with start_sim_pair(SimOptions(speed=50)) as pair, \
                sglang_router(pair.urls["mtp"], Path(tmp)) as mtp_pool, \
                sglang_router(pair.urls["plain"], Path(tmp)) as plain_pool:
            pools = SimpleNamespace(urls={"mtp": mtp_pool, "plain": plain_pool})
            async with live_gateway(pools, routing={"allow_pin_header": True},
                                    monitor={"interval_s": 3600.0},
                                    auth={"admin_key": "admin"}) as gateway, \
                    httpx.AsyncClient(timeout=30) as client:
                for _ in range(gateway.runtime.settings.monitor.fall + 1):
                    await gateway.runtime.probes.probe_all()
                models = (await client.get(gateway.url + "/v1/models")).json()
                model = models["data"][0]["id"]  # the pools' model, read through the routers
                for pool in ("mtp", "plain"):
                    before = await requests_served(client, pair.urls[pool])
                    response = await client.post(
                        gateway.url + "/v1/chat/completions", headers={"x-gateway-pin": pool},
                        json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 8, "stream": True})
                    assert response.status_code == 200, response.text
                    assert response.headers["x-gateway-backend"] == pool
                    assert response.text.rstrip().endswith("data: [DONE]")
                    assert '"content"' in response.text
                    # ... served by the simulated server behind that pool's router
                    assert await requests_served(client, pair.urls[pool]) == before + 1

                state = (await client.get(gateway.url + "/admin/state", headers=ADMIN)).json()
                for pool in ("mtp", "plain"):
                    backend = state["backends"][pool]
                    assert backend["up"] is True
                    assert backend["missing_endpoints"] == ["/server_info", "/v1/loads"]
                    assert backend["fallback"]
                await wait_until(lambda: gateway.pool.concurrency == 0, timeout=5)
