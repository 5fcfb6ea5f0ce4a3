"""The one task per turns pair that does the I/O its memory state asks for.

The state (gateway/turns/state.py) says which step comes next; this task performs it, one
control call at a time (serialized: one task per pair), each with its timeout, and records
the result back into the state. Nothing else sends a memory-saver call to the pair's
servers. After a failure the servers are probed and the state settles the pair; a pair with
no safe step is probed again every `turns.stuck_retry_s`.

What it changes outside the state: which server the pool may admit to (`admitting`, read by
the pool at every decision), the backends' `parked` flag (the monitor leaves a parked server
alone), the waiting room's wake-up, the journal, the metrics and the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from gateway.backends import BackendState
from gateway.config import ROLES, Role, Turns
from gateway.engine.probe import Probe
from gateway.engine.sglang import CallFailed, MemorySaver
from gateway.turns import nvml
from gateway.turns.state import (
    PairMemory,
    Phase,
    Step,
    begin_turn,
    can_turn_to,
    discovered,
    from_journal,
    holder_lost,
    initial,
    journal,
    other,
    rediscover,
    reprobed,
    sending,
    step_done,
    step_failed,
)

log = logging.getLogger("mtp_gateway.turns")

TICK_S = 0.05  # how often a driver looks at what its pair wants, and at draining streams


class Streams(Protocol):
    """What the relay does for a turn (gateway/relay.py)."""

    def move_all_unstarted(self, source: BackendState, target: BackendState) -> int:
        """Move every stream on `source` that has sent no byte to `target`; how many."""
        ...

    def end_running(self, source: BackendState, why: str) -> int:
        """End every request still on `source` with an error in its API's shape; how many."""
        ...

    async def hand_off(self, source: BackendState, target: BackendState, *,
                       timeout_s: float = 10.0) -> Any:
        """Continue `source`'s running streams on `target` from what their clients have
        (gateway/handover.py); those that cannot be stay on `source`."""
        ...


class TurnEvents(Protocol):
    """Where a driver reports (gateway/turns/metrics.py)."""

    def step(self, pair: str, action: str, seconds: float) -> None: ...
    def outcome(self, pair: str, outcome: str, seconds: float | None = None) -> None: ...
    def failure(self, pair: str, action: str, kind: str) -> None: ...


class Journal:
    """Each turns pair's memory, in one JSON file, rewritten whole (atomically) on every
    change: a gateway restarted mid-turn reads what was in doubt."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._pairs: dict[str, object] = {}
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                self._pairs = dict(data.get("pairs", {}))
            except (OSError, ValueError, AttributeError, TypeError):
                log.error("turns journal %s unreadable: starting with nothing known", self.path)

    def read(self, pair: str) -> object:
        return self._pairs.get(pair)

    def write(self, pair: str, state: PairMemory) -> None:
        self._pairs[pair] = journal(state)
        if self.path is None:
            return
        temporary = self.path.with_suffix(self.path.suffix + ".tmp")
        temporary.write_text(json.dumps({"pairs": self._pairs}), encoding="utf-8")
        os.replace(temporary, self.path)


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
    def __init__(self, name: str, backends: Mapping[Role, BackendState],
                 savers: Mapping[Role, MemorySaver], streams: Streams, turns: Turns, *,
                 wish: Wish, journal: Journal,
                 events: TurnEvents | None = None, on_change: Callable[[], None] = lambda: None,
                 free_fractions: Callable[[], list[float] | None] = nvml.free_fractions,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.backends = backends
        self.savers = savers
        self.streams = streams
        self.turns = turns
        self.wish = wish
        self.journal = journal
        self.events = events
        self.on_change = on_change
        self.free_fractions = free_fractions
        self.clock = clock
        self.state = from_journal(journal.read(name), clock())
        self.turns_done = 0
        self._turn_started: float | None = None
        self._nvml_seen: bool | None = None
        self._reprobe_at = 0.0
        self._park()

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
        state, now = self.state, self.clock()
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
                log.exception("pair %s: turns driver failed; settling again", self.name)
                self._set(initial(self.clock(), dict(self.state.memory)))  # what was known
                await asyncio.sleep(self.turns.stuck_retry_s)

    async def _next(self) -> None:
        """Wait for something to do: a turn the pair wants, or a stuck pair's retry."""
        while True:
            state = self.state
            if state.phase == "stuck":
                await asyncio.sleep(self.turns.stuck_retry_s)
                self._set(rediscover(state, self.clock()))
                return
            if state.holder is not None and not self.backends[state.holder].up:
                log.error("pair %s: %s, holding the memory, is down: settling", self.name,
                          state.holder)
                self._outcome("holder_lost")
                self._set(holder_lost(state, self.clock()))
                return
            if state.holder is not None and self.clock() >= self._reprobe_at:
                await self._reprobe(other(state.holder))
                state = self.state
            target = self.wish.turn_to(state, self.clock()) if state.phase == "holding" else None
            if target is not None and can_turn_to(state, target):
                self._turn_started = self.clock()
                log.warning("pair %s: handing the memory %s -> %s", self.name, state.holder,
                            target)
                self._set(begin_turn(state, target, self.clock()))
                return
            await asyncio.sleep(TICK_S)

    async def _reprobe(self, role: Role) -> None:
        """A server gone or hung beside the holder: probed again every stuck_retry_s."""
        self._reprobe_at = self.clock() + self.turns.stuck_retry_s
        if self.state.of(role) not in ("gone", "hung"):
            return
        probe = await self.savers[role].probe(self.turns.call_timeout_s)
        state = reprobed(self.state, role, probe)
        if state is not self.state:
            log.warning("pair %s: %s answers again, paused: it may take the memory again",
                        self.name, role)
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
        timeout = self.turns.call_timeout_s
        found = await asyncio.gather(*(self.savers[role].probe(timeout) for role in ROLES))
        probes: dict[Role, Probe] = dict(zip(ROLES, found, strict=True))
        fractions = self.free_fractions() if self.turns.check_memory else None
        free = None if fractions is None else all(
            f >= self.turns.min_free_fraction for f in fractions)
        preferred = self.wish.preferred()
        state = discovered(self.state, probes, preferred, self.clock(), memory_free=free)
        self._set(state)
        if state.phase == "stuck":
            log.error("pair %s: no safe step: %s (probes: %s); again in %g s", self.name,
                      state.why, _said(probes), self.turns.stuck_retry_s)
            self._outcome("stuck")
        if state.cannot_turn:
            log.error("pair %s: %s; it serves on its holder and never turns", self.name,
                      state.cannot_turn)
        if state.phase == "settling":
            log.warning("pair %s: settling on %s: %s", self.name, state.target,
                        ", ".join(map(str, state.plan)))

    async def _run_plan(self) -> None:
        kind = self.state.phase
        while (step := self.state.step) is not None:
            started = self.clock()
            self._set(sending(self.state))
            try:
                await self._do(step)
            except CallFailed as failed:
                self._failed(step, failed)
                return
            now = self.clock()
            if self.events is not None:
                self.events.step(self.name, step.action, now - started)
            self._set(step_done(self.state, now))
        if self.state.phase == "holding":
            assert self.state.holder is not None
            took = None if self._turn_started is None else self.clock() - self._turn_started
            self.wish.settled(self.state.holder, self.clock(), took if kind == "handing" else None)
            if kind == "handing":
                self.turns_done += 1
                log.warning("pair %s: memory handed to %s%s", self.name, self.state.holder,
                            "" if took is None else f" in {took:.2f} s")
                self._outcome("done", took)
            else:
                log.warning("pair %s: settled, %s holds the memory", self.name,
                            self.state.holder)
                self._outcome("settled")

    def _failed(self, step: Step, failed: CallFailed) -> None:
        log.error("pair %s: %s failed (%s): %s", self.name, step, failed.kind, failed.detail)
        if self.events is not None:
            self.events.failure(self.name, step.action, failed.kind)
        was_turn = self.state.phase == "handing"
        self._set(step_failed(self.state, failed.kind, failed.detail, self.clock(),
                              sent=failed.sent))
        if self.state.phase == "holding":  # a lost speculation: noted, the pair serves
            self._outcome("done_speculation_lost" if was_turn else "settled")
        elif was_turn:
            self._outcome("failed")

    # --- the steps ---------------------------------------------------------------------------

    async def _do(self, step: Step) -> None:
        turns, saver = self.turns, self.savers[step.role]
        source, target = self.backends[step.role], self.backends[other(step.role)]
        match step.action:
            case "stop_admitting":
                pass  # the phase did it: admitting is None from the turn's start
            case "move_unstarted":
                moved = self.streams.move_all_unstarted(source, target)
                if moved:
                    log.info("pair %s: %d unstarted streams moved %s -> %s", self.name, moved,
                             source.name, target.name)
            case "end_streams":
                ended = self.streams.end_running(source, "memory_turn")
                if ended:
                    log.warning("pair %s: %d streams waiting on %s, which does not hold the "
                                "memory, ended with an error", self.name, ended, source.name)
            case "running_streams":
                await self._hand_off(source, target)
                await self._running_streams(source)
            case "pause":
                await saver.pause(turns.call_timeout_s)
            case "release":
                await saver.release(turns.release_timeout_s)
            case "check_memory":
                await self._check_memory()
            case "resume":
                await saver.resume(turns.resume_timeout_s)
            case "continue":
                await saver.continue_generation(turns.call_timeout_s)
            case "check_ready":
                await self._until(lambda: saver.ready(turns.call_timeout_s), turns.ready_within_s,
                                  f"{saver.name} /ready not 200 within {turns.ready_within_s:g} s")
            case "check_speculation":
                await self._check_speculation(saver)

    async def _hand_off(self, source: BackendState, target: BackendState) -> None:
        """Running streams that can be continued go on on the incoming server. It is paused:
        their continuations wait in its tokenizer and their first events come after its
        resume, so this does not wait for them (timeout 0); each leaves `source` at once."""
        if not source.inflight:
            return
        result = await self.streams.hand_off(source, target, timeout_s=0)
        staying = sum(getattr(result, "staying", {}).values())
        log.info("pair %s: running streams on %s handed to %s (%d staying: %s)", self.name,
                 source.name, target.name, staying, getattr(result, "staying", {}))

    async def _running_streams(self, source: BackendState) -> None:
        """Running streams finish first within `finish_within_s`, this gateway's and (by the
        server's own count, /v1/loads) the replicas' that follow it; this gateway's left then
        end with an error in their API's shape (a hand-off continues them on the other server,
        once wired). The followers end theirs at the same bound (gateway/turns/follow.py)."""
        deadline = self.clock() + self.turns.finish_within_s
        while source.inflight and self.clock() < deadline:
            await asyncio.sleep(TICK_S)
        saver = self.savers[source.role]
        while not source.inflight and self.clock() < deadline:  # other replicas' streams
            busy = await saver.busy(self.turns.call_timeout_s)
            if not busy:  # none left (or no /v1/loads to tell)
                break
            await asyncio.sleep(TICK_S)
        if source.inflight:
            ended = self.streams.end_running(source, "memory_turn")
            log.warning("pair %s: %d streams on %s did not finish within %g s: ended with an "
                        "error", self.name, ended, source.name, self.turns.finish_within_s)
            deadline = self.clock() + self.turns.call_timeout_s
            while source.inflight and self.clock() < deadline:
                await asyncio.sleep(TICK_S)

    async def _check_memory(self) -> None:
        if not self.turns.check_memory:
            return
        minimum = self.turns.min_free_fraction
        deadline = self.clock() + self.turns.call_timeout_s
        while True:
            fractions = self.free_fractions()
            if fractions is None:
                if self._nvml_seen is not False:
                    log.info("pair %s: no GPU visible to NVML here: the memory check is skipped",
                             self.name)
                self._nvml_seen = False
                return
            self._nvml_seen = True
            if all(f >= minimum for f in fractions):
                return
            if self.clock() >= deadline:
                shown = ", ".join(f"GPU {i}: {f:.0%} free" for i, f in enumerate(fractions))
                raise CallFailed("check", f"the memory did not come back ({shown}; "
                                 f"{minimum:.0%} expected)")
            await asyncio.sleep(TICK_S)

    async def _check_speculation(self, saver: MemorySaver) -> None:
        minimum = self.turns.min_accept_length
        if not minimum:
            return
        accept = await saver.accept_length(self.turns.ready_within_s)
        if accept is None:
            log.info("pair %s: %s gave no accept length: speculation not checked", self.name,
                     saver.name)
            return
        if accept < minimum:
            raise CallFailed("check", f"{saver.name} accepts {accept:.2f} tokens per step after "
                             f"its resume, < {minimum:g}: its draft weights may have come back "
                             "wrong (sglang #31674)")

    async def _until(self, check: Callable[[], Any], within_s: float, why: str) -> None:
        deadline = self.clock() + within_s
        while not await check():
            if self.clock() >= deadline:
                raise CallFailed("timeout", why)
            await asyncio.sleep(TICK_S)

    # --- bookkeeping -------------------------------------------------------------------------

    def _set(self, state: PairMemory) -> None:
        before = self.state.admitting
        self.state = state
        self.journal.write(self.name, state)
        self._park()
        if state.admitting != before:
            self.on_change()

    def _park(self) -> None:
        """The server not admitting is parked: the monitor leaves it alone (a paused SGLang
        server answers 503 on /ready and /health, HS:714-798, and is not down)."""
        admitting = self.state.admitting
        for role, backend in self.backends.items():
            backend.set_parked(role != admitting)

    def _outcome(self, outcome: str, seconds: float | None = None) -> None:
        if self.events is not None:
            self.events.outcome(self.name, outcome, seconds)


def _said(probes: Mapping[Role, Probe]) -> str:
    return ", ".join(f"{role}: {'ready' if p.ready else 'paused' if p.alive else 'gone'}"
                     for role, p in probes.items())
