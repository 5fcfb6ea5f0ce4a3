"""A pair with `memory: auto`, until its shape is decided (gateway/turns/shape.py), and after.

At start the task reads both servers' `/server_info` every `monitor.interval_s` until
`choose_shape` decides. Meanwhile no server of the pair admits (both are parked, so the monitor
leaves them to this task): once one server has answered, arrivals wait at the gateway (bounded,
as for a turn), since the one that answered may be a parked turns server that would hold them
forever; while neither answers there is nothing to wait for, and a request gets the gateway's
503 at once. Then:

- turns: the pair gets its turns driver (or a follower of its controller), which settles it
  from fresh probes as at any start (gateway/turns/discovery.py);
- split: the pair routes as a split pair. When a server that was down comes back, both are
  read again: if both now run with the memory saver (vLLM: sleep mode in dev mode), the pair
  turns, but only while nothing is in flight on it (a turn's settling releases one server, which
  with streams running on it would end them); until then it stays split and says so. A turns
  pair never goes back to split without a restart: its parked server must not be admitted to
  (discovery already refuses to turn a pair whose server lost the memory saver: `cannot_turn`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gateway.config import ROLES, EngineName, Role
from gateway.routing.pair import PairState
from gateway.turns.shape import ShapeChoice, choose_shape
from gateway.upstream.engine.probe import SaverReport

log = logging.getLogger("mtp_gateway.turns")


class Driver(Protocol):
    """What a decided turns pair runs (gateway/turns/driver.py, gateway/turns/follow.py)."""

    async def run(self) -> None: ...


class AutoShape:
    """The pair's memory gate while its shape is undecided, and the task that decides it."""

    def __init__(self, pair: PairState, read: Callable[[Role], Awaitable[SaverReport]],
                 take_turns: Callable[[], Driver], decided: Callable[[ShapeChoice], None],
                 interval_s: Callable[[], float], engine: EngineName = "sglang") -> None:
        self.pair = pair
        self.engine = engine
        self.read = read  # one server's /server_info, as a SaverReport
        self.take_turns = take_turns  # the pair's turns driver, installed as its gate
        self.decided = decided  # wakes the arrivals waiting for the choice
        self.interval_s = interval_s
        self.reports: dict[Role, SaverReport] = dict.fromkeys(ROLES, "silent")
        self.choice = choose_shape("auto", self.reports, engine)
        self._park(True)  # either may be a parked turns server: neither is admitted to yet

    # --- the gate the pool reads while undecided (gateway/routing/pair.MemoryGate) -----------

    @property
    def admitting(self) -> Role | None:
        return None

    @property
    def waiting_for_turn(self) -> bool:
        return any(report != "silent" for report in self.reports.values())

    def describe(self) -> dict[str, Any]:
        return {"phase": "deciding", "holder": None, "admitting": None, "turns": 0,
                "step": None, "stuck": None, "last_failure": None,
                "reason": self.choice.reason, "reports": dict(self.reports)}

    # --- the task ----------------------------------------------------------------------------

    async def run(self) -> None:
        choice = await self._until_decided()
        if choice.shape == "split":
            self._decide(choice)
            choice = await self._until_both_can_turn()
        driver = self.take_turns()  # the pair's gate from now on
        self._decide(choice)
        await driver.run()

    def _decide(self, choice: ShapeChoice) -> None:
        log.info("pair %s: memory %s (%s)", self.pair.name, choice.shape, choice.reason)
        self.choice = choice
        if choice.shape == "split":
            self.pair.turns = None
            self._park(False)
        self.decided(choice)

    def _park(self, parked: bool) -> None:
        for backend in self.pair.backends.values():
            backend.set_parked(parked)

    async def _read(self) -> ShapeChoice:
        found = await asyncio.gather(*(self.read(role) for role in ROLES))
        self.reports = dict(zip(ROLES, found, strict=True))
        return choose_shape("auto", self.reports, self.engine)

    async def _until_decided(self) -> ShapeChoice:
        said = ""
        while True:
            choice = await self._read()
            if choice.shape is not None:
                return choice
            if choice.reason != said:
                log.warning("pair %s: memory not decided yet: %s", self.pair.name, choice.reason)
                said = choice.reason
            self.choice = choice
            await asyncio.sleep(self.interval_s())

    async def _until_both_can_turn(self) -> ShapeChoice:
        """A split pair: read again whenever a server that was down comes back."""
        down: set[Role] = set()
        again = False
        told = False
        while True:
            await asyncio.sleep(self.interval_s())
            backends = self.pair.backends
            back = {role for role in down if backends[role].up}
            down = (down - back) | {role for role in ROLES if not backends[role].up}
            again = again or bool(back)
            if not again:
                continue
            choice = await self._read()
            if choice.shape != "turns":
                again = told = False
                continue
            if not any(backend.inflight for backend in backends.values()):
                return choice
            if not told:
                log.warning("pair %s: %s; it stays split while requests run on it, and turns "
                            "once none does", self.pair.name, choice.reason)
                told = True
