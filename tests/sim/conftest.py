import asyncio
import time
from collections.abc import Callable

import pytest

from gateway.sim.server import SimOptions, start_sim_pair


@pytest.fixture
async def pair():
    async with start_sim_pair(SimOptions(speed=50)) as started:
        yield started


async def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> float:
    """Poll ``predicate`` (sync or async) until true; returns the seconds it took."""
    start = time.perf_counter()
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.005)
