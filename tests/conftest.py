"""Shared fixtures: the simulated SGLang pair and a live gateway in front of it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI
from hypothesis import settings as hypothesis_settings
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from tests.live import serve_app

# Generated tests draw the same examples on every run: CI fails only on a real regression, never on
# an unlucky draw. HYPOTHESIS_PROFILE=explore draws fresh examples when hunting for bugs.
hypothesis_settings.register_profile("ci", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", max_examples=2000, database=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
async def sim() -> AsyncIterator[SimPair]:
    async with start_sim_pair(SimOptions(speed=50)) as pair:
        yield pair


class LiveGateway:
    def __init__(self, app: FastAPI, url: str) -> None:
        self.app = app
        self.url = url

    @property
    def runtime(self) -> Any:
        return self.app.state.runtime

    @property
    def pool(self) -> Any:
        return self.runtime.pool

    def inflight(self) -> dict[str, int]:
        return {name: b.inflight for name, b in self.pool.backends.items()}


def circuit_open(backend: Any) -> bool:
    """A backend's circuit is open now (it half-opens when its open period is over)."""
    return backend.circuit.is_open(time.monotonic())


def half_open(backend: Any) -> bool:
    return backend.circuit.is_half_open(time.monotonic())


def gateway_settings(pair: SimPair | None, **sections: dict[str, Any]) -> Any:
    # These tests' pairs split their memory (`memory: auto` has its own: tests/turns/test_auto_live.py).
    data: dict[str, Any] = {"monitor": {"interval_s": 0.05}, "memory": "split"}
    if pair is not None:
        data["backends"] = {name: {"url": url} for name, url in pair.urls.items()}
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    return build_settings(data)


@contextlib.asynccontextmanager
async def live_gateway(pair: SimPair | None, *, config_path: Any = None, stock_uvicorn: bool = False,
                       **sections: dict[str, Any]) -> AsyncIterator[LiveGateway]:
    app = create_app(gateway_settings(pair, **sections), registry=CollectorRegistry(),
                     config_path=config_path)
    async with serve_app(app, stock_uvicorn=stock_uvicorn) as url:
        gateway = LiveGateway(app, url)
        if pair is not None:  # the first probe round has read caps and models
            await gateway.runtime.probes.probe_all()
        yield gateway
