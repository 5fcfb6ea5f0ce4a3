"""The watchdog's deadlines for a relaying stream, in virtual time: the relay does nothing for
it per piece; the watchdog compares the stream's piece count when its timer fires. A silent
backend is still cut off after `idle_s` (never before, at most two looks late), a busy one never,
and a silent stream still gets its keep-alive comments."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable
from typing import Any

import pytest

from gateway.config import Timeouts
from gateway.relay.deadlines import KEEPALIVE, LOOKS_PER_DEADLINE, Deadlines


class VirtualLoop:
    """The two things the watchdog asks of its loop, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self.made = 0

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, (), asyncio.get_running_loop())
        self.made += 1
        heapq.heappush(self.timers, (when, self.made, handle))
        return handle

    def advance(self, to: float, every: Callable[[], None] | None = None) -> None:
        """Run the timers due up to `to`, in order; `every` runs at each timer's time first."""
        while self.timers and self.timers[0][0] <= to:
            when, _, handle = heapq.heappop(self.timers)
            if handle.cancelled():
                continue
            self.now = when
            if every is not None:
                every()
            handle._run()
        self.now = to


class Task:
    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> None:
        self.cancels += 1

    def uncancel(self) -> None:
        self.cancels -= 1


def following(timeouts: Timeouts) -> tuple[Deadlines, VirtualLoop, Task, list[int]]:
    """A stream's watchdog past its first event, following a piece count the test moves."""
    task, loop = Task(), VirtualLoop()
    deadlines = Deadlines(timeouts, task, stream=True)  # type: ignore[arg-type]
    deadlines._loop = loop  # type: ignore[assignment]
    deadlines._started = deadlines.last_activity = deadlines.last_sent = 0.0
    deadlines.start()
    deadlines.got_bytes()  # the first event
    pieces = [0]
    deadlines.follow(lambda: pieces[0])
    return deadlines, loop, task, pieces


@pytest.mark.timeout(10)
async def test_a_backend_sending_pieces_is_never_cut_off_and_a_silent_one_is_after_idle_s() -> None:
    idle_s = 4.0
    deadlines, loop, task, pieces = following(Timeouts(idle_s=idle_s, keepalive_s=0))
    step = idle_s / 10

    def piece() -> None:
        pieces[0] += 1

    t = 0.0
    while t < 10 * idle_s:  # a piece every tenth of idle_s: ten idle budgets go by
        t += step
        loop.advance(t)
        piece()
    assert deadlines.reason is None and task.cancels == 0
    last_piece = t
    loop.advance(t + idle_s - 1e-6)  # silent, but not yet for idle_s
    assert deadlines.reason is None
    loop.advance(t + idle_s * (1 + 2 / LOOKS_PER_DEADLINE) + 1e-6)
    assert deadlines.reason == "timeout_idle" and task.cancels == 1
    assert last_piece + idle_s <= loop.now  # never early


@pytest.mark.timeout(10)
async def test_a_silent_stream_gets_keepalives_and_a_busy_one_none() -> None:
    keepalive_s = 1.0
    deadlines, loop, task, pieces = following(Timeouts(idle_s=100.0, keepalive_s=keepalive_s))
    deadlines.reading = True
    for i in range(1, 40):  # a piece every half keep-alive interval: no comment needed
        loop.advance(i * keepalive_s / 2)
        pieces[0] += 1
    assert deadlines.reason is None and task.cancels == 0
    quiet_from = loop.now
    loop.advance(quiet_from + keepalive_s * (1 + 2 / LOOKS_PER_DEADLINE) + 1e-6)
    assert deadlines.reason == KEEPALIVE and task.cancels == 1
    assert loop.now >= quiet_from + keepalive_s
    deadlines.handled_keepalive()  # the relay wrote the comment
    assert deadlines.reason is None and task.cancels == 0


def test_a_watchdog_of_a_whole_answer_has_no_look() -> None:
    """A non-streamed answer has only the total deadline: nothing to follow."""

    async def run() -> Any:
        task, loop = Task(), VirtualLoop()
        deadlines = Deadlines(Timeouts(total_s=5.0), task, stream=False)  # type: ignore[arg-type]
        deadlines._loop = loop  # type: ignore[assignment]
        deadlines._started = 0.0
        deadlines.start()
        return [when for when, _, handle in loop.timers if not handle.cancelled()]

    assert asyncio.run(run()) == [5.0]
