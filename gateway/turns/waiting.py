"""Arrivals that find no server admitting (a turn in progress, a `memory: auto` pair not decided
yet) wait at the gateway, bounded in count and in time (`turns.wait_max_requests`,
`turns.wait_max_s`); past either they get a 503 in their API's shape with Retry-After, never
a hang."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from gateway.apis.errors import NoBackend

T = TypeVar("T")


class MemoryTurnBusy(NoBackend):
    code, kind = "memory_turn_in_progress", "memory_turn"


class WaitingRoom:
    """One per gateway: `changed()` (a pair began admitting again) wakes every waiter, which
    tries its admission again."""

    def __init__(self, max_requests: int, max_s: float, retry_after_s: int) -> None:
        self.max_requests = max_requests
        self.max_s = max_s
        self.retry_after_s = retry_after_s
        self.waiting = 0
        self._changed: asyncio.Future[None] | None = None

    def changed(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def admit(self, attempt: Callable[[], T], must_wait: Callable[[T], bool]) -> T:
        """`attempt()` until `must_wait` says no, waiting for a change between tries."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_s
        while True:
            result = attempt()
            if not must_wait(result):
                return result
            if self.waiting >= self.max_requests:
                raise self._busy(f"{self.waiting} requests already wait for it")
            left = deadline - loop.time()
            if left <= 0:
                raise self._busy(f"waited {self.max_s:g} s")
            if self._changed is None:
                self._changed = loop.create_future()
            self.waiting += 1
            try:
                await asyncio.wait_for(asyncio.shield(self._changed), left)
            except TimeoutError:
                raise self._busy(f"waited {self.max_s:g} s") from None
            finally:
                self.waiting -= 1

    def _busy(self, why: str) -> MemoryTurnBusy:
        return MemoryTurnBusy(f"no server of the pair admits yet (its GPU memory being handed from "
                              f"one server to the other, or its memory shape not decided yet); "
                              f"{why}; retry shortly",
                              headers={"retry-after": str(self.retry_after_s)})
