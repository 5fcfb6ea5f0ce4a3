"""Issue 13's live test on loopback: 2 simulated pairs, 2 `mtp-gateway serve` processes.

Pair "a" has a crossover of 4, pair "b" of 12 (each pair its own trade-off). Gateway 1 opens 5
long streams, gateway 2 (which sees them only through the backends' /v1/loads) opens 5 more:
both pairs serve, pair "a" switches to plain on its own load as gateway 2 sees it (its own 2
or 3 requests there would not reach 4), pair "b" stays on MTP with as much load, and when the
streams close every count returns to 0, on both gateways and on the four servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from tests.live import wait_until
from tests.test_gateway_live import OpenStream, chat
from tests.test_shutdown import ROOT, free_port, until_serving

# The configured crossovers decide, as written: the learned one would take each pair's from its
# caps, and adapted to the accept length a few steps into the first streams have decoded
# (1.25 makes a's 4 a 2) a's third stream could go to plain, as once under a full run's load.
AS_WRITTEN = {"adaptive_crossover": False, "adapt_to_accept_length": False}
PAIR_ROUTING = {"a": {"crossover": 4, "hysteresis": 1, "min_dwell_s": 0, **AS_WRITTEN},
                "b": {"crossover": 12, "hysteresis": 1, "min_dwell_s": 0, **AS_WRITTEN}}


def fleet_config(pairs: dict[str, SimPair], port: int) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "pairs": [{"name": name, "mtp": {"url": pair.urls["mtp"]},
                   "plain": {"url": pair.urls["plain"]}, "routing": PAIR_ROUTING[name]}
                  for name, pair in pairs.items()],
        "monitor": {"interval_s": 0.1, "use_backend_loads": True},
    }


@contextlib.asynccontextmanager
async def gateway_process(config: dict[str, Any], tmp_path: Path,
                          client: httpx.AsyncClient) -> AsyncIterator[str]:
    path = tmp_path / f"gateway-{config['listen']['port']}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--config", str(path), "--log-level", "warning",
        cwd=ROOT, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{config['listen']['port']}"
    try:
        await until_serving(client, url, process)
        yield url
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), timeout=10)


async def state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return (await client.get(url + "/dashboard/state")).json()


def modes(view: dict[str, Any]) -> dict[str, str]:
    return {pair["name"]: pair["mode"] for pair in view["pairs"]}


@pytest.mark.timeout(60)
async def test_two_gateways_share_two_pairs_each_pair_on_its_own_load(tmp_path) -> None:
    async with start_sim_pair(SimOptions(speed=1)) as pair_a, \
            start_sim_pair(SimOptions(speed=1)) as pair_b, \
            httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=40)) as client:
        pairs = {"a": pair_a, "b": pair_b}
        async with gateway_process(fleet_config(pairs, free_port()), tmp_path, client) as one, \
                gateway_process(fleet_config(pairs, free_port()), tmp_path, client) as two:
            long = chat(max_tokens=4000, ignore_eos=True, stream=True)
            streams: list[OpenStream] = []
            try:
                for _ in range(5):
                    streams.append(await OpenStream(client, one + "/v1/chat/completions",
                                                    long).open())
                assert sorted(s.backend for s in streams) == ["a/mtp"] * 3 + ["b/mtp"] * 2

                async def two_sees_ones_streams() -> bool:
                    backends = (await state(client, two))["backends"]
                    return sum(b["running"] or 0 for b in backends.values()) == 5

                deadline = asyncio.get_running_loop().time() + 10
                while not await two_sees_ones_streams():
                    assert asyncio.get_running_loop().time() < deadline, "no /v1/loads reading"
                    await asyncio.sleep(0.05)
                for _ in range(5):
                    streams.append(await OpenStream(client, two + "/v1/chat/completions",
                                                    long).open())
                placed = [s.backend for s in streams[5:]]
                assert "a/plain" in placed, placed  # a's load as two sees it reached 4
                assert not any(b.startswith("b/") and b != "b/mtp" for b in placed), placed
                view = await state(client, two)
                assert modes(view) == {"a": "plain", "b": "mtp"}
                on_pair = {name: sum(b["inflight"] for b in view["backends"].values()
                                     if b["pair"] == name) for name in ("a", "b")}
                assert on_pair["a"] > 0 and on_pair["b"] > 0  # both pairs serve two's requests
                assert modes(await state(client, one)) == {"a": "mtp", "b": "mtp"}  # 3 and 2
            finally:
                for stream in streams:
                    await stream.close()

            async def settled() -> bool:
                views = [await state(client, url) for url in (one, two)]
                return all(v["concurrency"] == 0 for v in views)

            deadline = asyncio.get_running_loop().time() + 10
            while not await settled():
                assert asyncio.get_running_loop().time() < deadline, "in-flight did not return to 0"
                await asyncio.sleep(0.05)
            engines = [p.servers[role].live.engine for p in pairs.values() for role in ("mtp", "plain")]
            await wait_until(lambda: all(e.num_running == 0 and e.num_waiting == 0
                                         for e in engines), timeout=10)
