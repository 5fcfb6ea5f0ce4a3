"""The one task per turns pair that does the I/O its memory state asks for.

The state (gateway/turns/state.py) says which step comes next; this task performs it (each
step's I/O: gateway/turns/steps.py, in the pair's engine's calls), one control call at a time
(serialized: one task per pair), each with its timeout, and records the result back into the
state. Nothing else sends a memory-saver or sleep-mode call to the pair's servers. After a
failure the servers are probed and the state settles the pair (gateway/turns/discovery.py); a
pair with no safe step is probed again every `turns.stuck_retry_s`.

What it changes outside the state: which server the pool may admit to (`admitting`, read by
the pool at every decision), the backends' `parked` flag (the monitor leaves a parked server
alone), the waiting room's wake-up, the journal, the metrics and the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gateway.config import ROLES, EngineName, Role
from gateway.turns import nvml
from gateway.turns.discovery import discovered, rediscover
from gateway.turns.handles import PairHandles
from gateway.turns.journal import Journal, from_journal
from gateway.turns.state import (
    PairMemory,
    Phase,
    Step,
    begin_turn,
    can_turn_to,
    holder_lost,
    initial,
    other,
    reprobed,
    sending,
    step_done,
    step_failed,
)
from gateway.turns.steps import TICK_S, StepCalls
from gateway.upstream.engine.probe import CallFailed, Probe

log = logging.getLogger("mtp_gateway.turns")


class TurnEvents(Protocol):
    """Where a driver reports (gateway/turns/metrics.py)."""

    def step(self, pair: str, action: str, seconds: float) -> None: ...
    def outcome(self, pair: str, outcome: str, seconds: float | None = None) -> None: ...
    def failure(self, pair: str, action: str, kind: str) -> None: ...


class Wish(Protocol):
    """Where the pair's load wants the memory (gateway/turns/wiring.LoadWish)."""

    def turn_to(self, state: PairMemory, now: float) -> Role | None:
        """Between turns: the server to hand the memory to now, or None."""
        ...

    def preferred(self) -> Role:
        """The server that should take the memory when a settling may choose."""
        ...

    def settled(self, holder: Role, now: float, turn_s: float | None) -> None:
        """A plan ended with `holder` holding (a turn took `turn_s`)."""
        ...


class PairDriver:
    def __init__(self, pair: PairHandles, *, wish: Wish, journal: Journal,
                 events: TurnEvents | None = None,
                 free_fractions: Callable[[], list[float] | None] = nvml.free_fractions,
                 engine: EngineName = "sglang") -> None:
        self.pair = pair
        self.wish = wish
        self.journal = journal
        self.events = events
        self.steps = StepCalls(pair, free_fractions)
        self.state = from_journal(journal.read(pair.name), pair.clock(), engine)
        self.turns_done = 0
        self._turn_started: float | None = None
        self._reprobe_at = 0.0
        pair.park(self.state.admitting)

    # --- what the rest of the gateway reads --------------------------------------------------

    @property
    def admitting(self) -> Role | None:
        return self.state.admitting

    @property
    def holder(self) -> Role | None:
        return self.state.holder

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def waiting_for_turn(self) -> bool:
        """Arrivals should wait (a turn or a settling under way), not be refused."""
        return self.state.phase in ("discovering", "settling", "handing")

    def describe(self) -> dict[str, Any]:
        """For /admin/state, the dashboard and the replicas that follow this pair."""
        state, now = self.state, self.pair.clock()
        failure = state.failure
        return {
            "phase": state.phase, "holder": state.holder, "admitting": state.admitting,
            "memory": dict(state.memory), "target": state.target,
            "step": None if state.step is None else str(state.step),
            "step_for_s": round(now - state.step_since, 3) if state.step else None,
            "plan": [str(step) for step in state.plan], "for_s": round(now - state.since, 3),
            "turns": self.turns_done, "speculation_lost": state.speculation_lost,
            "stuck": state.why or None, "cannot_turn": state.cannot_turn or None,
            "last_failure": None if failure is None else {
                "step": str(failure.step), "kind": failure.kind, "detail": failure.detail,
                "ago_s": round(now - failure.at, 3)},
        }

    # --- the task ----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await self.drive()
                await self._next()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not leave the pair without its one driver
                log.exception("pair %s: turns driver failed; settling again", self.pair.name)
                self._set(initial(self.pair.clock(), dict(self.state.memory),  # what was known
                                  self.state.engine))
                await asyncio.sleep(self.pair.turns.stuck_retry_s)

    async def _next(self) -> None:
        """Wait for something to do: a turn the pair wants, or a stuck pair's retry."""
        while True:
            state = self.state
            if state.phase == "stuck":
                await asyncio.sleep(self.pair.turns.stuck_retry_s)
                self._set(rediscover(state, self.pair.clock()))
                return
            if state.holder is not None and not self.pair.backends[state.holder].up:
                log.error("pair %s: %s, holding the memory, is down: settling", self.pair.name,
                          state.holder)
                self._outcome("holder_lost")
                self._set(holder_lost(state, self.pair.clock()))
                return
            if state.holder is not None and self.pair.clock() >= self._reprobe_at:
                await self._reprobe(other(state.holder))
                state = self.state
            target = self.wish.turn_to(state, self.pair.clock()) if state.phase == "holding" else None
            if target is not None and can_turn_to(state, target):
                self._turn_started = self.pair.clock()
                log.info("pair %s: handing the memory %s -> %s", self.pair.name, state.holder,
                            target)
                self._set(begin_turn(state, target, self.pair.clock()))
                return
            await asyncio.sleep(TICK_S)

    async def _reprobe(self, role: Role) -> None:
        """A server gone or hung beside the holder: probed again every stuck_retry_s."""
        self._reprobe_at = self.pair.clock() + self.pair.turns.stuck_retry_s
        if self.state.of(role) not in ("gone", "hung"):
            return
        probe = await self.pair.controls[role].probe(self.pair.turns.call_timeout_s)
        state = reprobed(self.state, role, probe)
        if state is not self.state:
            log.warning("pair %s: %s answers again, paused: it may take the memory again",
                        self.pair.name, role)
            self._set(state)

    async def drive(self) -> None:
        """Discover, run the plan in progress; again after a failure; until the pair holds
        (or is stuck)."""
        while True:
            if self.state.phase == "discovering":
                await self._discover()
            if self.state.phase not in ("settling", "handing"):
                return
            await self._run_plan()

    async def _discover(self) -> None:
        timeout = self.pair.turns.call_timeout_s
        found = await asyncio.gather(*(self.pair.controls[role].probe(timeout) for role in ROLES))
        probes: dict[Role, Probe] = dict(zip(ROLES, found, strict=True))
        fractions = self.steps.free_fractions() if self.pair.turns.check_memory else None
        free = None if fractions is None else all(
            f >= self.pair.turns.min_free_fraction for f in fractions)
        preferred = self.wish.preferred()
        state = discovered(self.state, probes, preferred, self.pair.clock(), memory_free=free)
        self._set(state)
        if state.phase == "stuck":
            log.error("pair %s: no safe step: %s (probes: %s); again in %g s", self.pair.name,
                      state.why, _said(probes), self.pair.turns.stuck_retry_s)
            self._outcome("stuck")
        if state.cannot_turn:
            log.error("pair %s: %s; it serves on its holder and never turns", self.pair.name,
                      state.cannot_turn)
        if state.phase == "settling":
            log.info("pair %s: settling on %s: %s", self.pair.name, state.target,
                        ", ".join(map(str, state.plan)))

    async def _run_plan(self) -> None:
        kind = self.state.phase
        lost_before = self.state.speculation_lost
        while (step := self.state.step) is not None:
            started = self.pair.clock()
            self._set(sending(self.state))
            try:
                await self.steps.do(step)
            except CallFailed as failed:
                # Back to discovery (no step left in progress), or a failed speculation check,
                # after which the plan goes on: the pair holds with MTP.
                self._failed(step, failed)
                continue
            now = self.pair.clock()
            if self.events is not None:
                self.events.step(self.pair.name, step.action, now - started)
            self._set(step_done(self.state, now))
        if self.state.phase == "holding":
            assert self.state.holder is not None
            took = None if self._turn_started is None else self.pair.clock() - self._turn_started
            self.wish.settled(self.state.holder, self.pair.clock(), took if kind == "handing" else None)
            if kind == "handing":
                self.turns_done += 1
                log.info("pair %s: memory handed to %s%s", self.pair.name, self.state.holder,
                            "" if took is None else f" in {took:.2f} s")
                lost = self.state.speculation_lost and not lost_before
                self._outcome("done_speculation_lost" if lost else "done", took)
            else:
                log.info("pair %s: settled, %s holds the memory", self.pair.name,
                            self.state.holder)
                self._outcome("settled")

    def _failed(self, step: Step, failed: CallFailed) -> None:
        log.error("pair %s: %s failed (%s): %s", self.pair.name, step, failed.kind, failed.detail)
        if self.events is not None:
            self.events.failure(self.pair.name, step.action, failed.kind)
        was_turn = self.state.phase == "handing"
        self._set(step_failed(self.state, failed.kind, failed.detail, self.pair.clock(),
                              sent=failed.sent))
        if was_turn and self.state.phase == "discovering":
            self._outcome("failed")

    # --- bookkeeping -------------------------------------------------------------------------

    def _set(self, state: PairMemory) -> None:
        before = self.state.admitting
        self.state = state
        self.journal.write(self.pair.name, state)
        self.pair.park(state.admitting)
        if state.admitting != before:
            self.pair.on_change()

    def _outcome(self, outcome: str, seconds: float | None = None) -> None:
        if self.events is not None:
            self.events.outcome(self.pair.name, outcome, seconds)


def _said(probes: Mapping[Role, Probe]) -> str:
    return ", ".join(f"{role}: {'ready' if p.ready else 'paused' if p.alive else 'gone'}"
                     for role, p in probes.items())
