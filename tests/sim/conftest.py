import asyncio
import time
from collections.abc import Awaitable, Callable

import looptime  # a test extra; its pytest plugin is off (pyproject), run_on_loop_clock makes its loop
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


def run_on_loop_clock(test: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
    """Run ``test`` on looptime's event loop: its clock moves only when every task waits for a
    timer, so the simulator's steps, its wake-ups and a client's timeout are measured on the
    same clock and a loaded machine cannot make them early or late. ``timeout`` is that clock's."""
    async def bounded() -> None:
        await asyncio.wait_for(test(), timeout)
    with asyncio.Runner(loop_factory=looptime.new_event_loop) as runner:
        runner.run(bounded())


async def until_on_loop_clock(predicate: Callable[[], Awaitable[object]], within: float,
                              every: float = 0.02) -> float:
    """Poll ``predicate`` until true, at most ``within`` seconds of the loop's clock; returns
    those seconds (run_on_loop_clock's loop: how long the simulator took, not the machine)."""
    clock = asyncio.get_running_loop().time
    start = clock()
    while not await predicate():
        assert clock() - start < within, f"condition not met within {within} s"
        await asyncio.sleep(every)  # of the loop's clock: polls cost real time, the wait does not
    return clock() - start
