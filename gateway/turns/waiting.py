"""Arrivals that find no server admitting wait at the gateway, bounded, never a hang:

- a turn in progress, or a `memory: auto` pair not decided yet (reason memory_turn): at most
  `turns.wait_max_s`, then a 503 `memory_turn_in_progress` with Retry-After;
- a turns pair's holder, up, whose circuit is open or has its half-open trial out (reason
  holder_circuit): the pair has no other server, and the one server it stands for would have
  queued the request, not refused it. It waits for the circuit to let it through (it may be
  the trial itself; the others wait for the trial's end), at most `turns.wait_circuit_max_s`,
  then the 503 `no_backend_available` it got at once before.

At most `turns.wait_max_requests` wait, for either; past it the same 503s. A request leaves the
room when it is admitted, refused, or cancelled (its client left): it holds no lease meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.apis.errors import GatewayError, NoBackend, no_healthy_backend
from gateway.routing.lease import Lease, Placement

WAIT_REASONS = ("memory_turn", "holder_circuit")


class MemoryTurnBusy(NoBackend):
    code, kind = "memory_turn_in_progress", "memory_turn"


def waits(admitted: Lease | Placement) -> bool:
    """The pool found nowhere to go for now, for a reason worth waiting for."""
    return not isinstance(admitted, Lease) and admitted.decision.reason in WAIT_REASONS


class WaitingRoom:
    """One per gateway: `changed()` (a pair began admitting again, a circuit changed) wakes
    every waiter, which tries its admission again."""

    def __init__(self, max_requests: int, max_s: float, retry_after_s: int,
                 circuit_max_s: float) -> None:
        self.max_requests = max_requests
        self.max_s = max_s
        self.retry_after_s = retry_after_s
        self.circuit_max_s = circuit_max_s
        self.waiting = 0
        self._changed: asyncio.Future[None] | None = None

    def changed(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def admit(self, attempt: Callable[[], Lease | Placement]) -> Lease | Placement:
        """`attempt()` until it need not wait (`waits`), waiting for a change between tries,
        or for the time a circuit lets its trial through (`Placement.look_again_s`)."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        while True:
            result = attempt()
            if not waits(result):
                return result
            assert isinstance(result, Placement)
            turn = result.decision.reason == "memory_turn"
            max_s = self.max_s if turn else self.circuit_max_s
            if self.waiting >= self.max_requests:
                raise self._refusal(turn, f"{self.waiting} requests already wait for it")
            left = arrived + max_s - loop.time()
            if left <= 0:
                raise self._refusal(turn, f"waited {max_s:g} s")
            look = result.look_again_s
            if self._changed is None:
                self._changed = loop.create_future()
            self.waiting += 1
            try:
                await asyncio.wait_for(asyncio.shield(self._changed),
                                       left if look is None else min(left, look))
            except TimeoutError:
                pass  # the next attempt tells: a circuit's trial may go, or past the bound
            finally:
                self.waiting -= 1

    def _refusal(self, turn: bool, why: str) -> GatewayError:
        if not turn:
            return no_healthy_backend(f"the circuit of the server holding the pair's memory is "
                                      f"open; {why}")
        return MemoryTurnBusy(f"no server of the pair admits yet (its GPU memory being handed from "
                              f"one server to the other, or its memory shape not decided yet); "
                              f"{why}; retry shortly",
                              headers={"retry-after": str(self.retry_after_s)})
