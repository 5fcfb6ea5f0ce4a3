"""The turns pairs of one gateway, assembled: a driver per pair, the waiting room, the
metrics and the journal. `build_turns` is called once by the app's Runtime."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.config import Monitor, Pair, Role, Settings, Turns
from gateway.routing.policy import load_against_crossover
from gateway.routing.pool import PairState, Pool
from gateway.turns.auto import AutoShape
from gateway.turns.decision import (
    NEVER,
    Across,
    CarriedCost,
    Holding,
    LoadSignal,
    TurnRules,
    carried_cost,
    decide_turn,
    wanted,
)
from gateway.turns.driver import PairDriver
from gateway.turns.follow import FollowDriver
from gateway.turns.handles import PairHandles, Streams
from gateway.turns.journal import Journal
from gateway.turns.metrics import TurnMetrics
from gateway.turns.shape import ShapeChoice, choose_shape
from gateway.turns.state import PairMemory
from gateway.turns.waiting import WaitingRoom
from gateway.upstream.client import Upstream
from gateway.upstream.engine.probe import SaverReport
from gateway.upstream.engine.seam import engine_of

log = logging.getLogger("mtp_gateway.turns")


class LoadWish:
    """The pure hand-over decision (gateway/turns/decision.py) fed with the pair's load as the
    routing measures it (its crossover and hysteresis), the requests waiting for a turn, the
    routing's min_dwell_s and the last turn's measured cost. MTP is never wished for again
    once its speculation came back lost (the operator restarts it).

    With ``turns.kv_store`` each server keeps its own store: what a server's store holds is
    taken to be each session's context when that server last handed the memory over (it served
    them until then, and its writes drained before its pause)."""

    def __init__(self, pool: Pool, pair: PairState, turns: Turns,
                 waiting: Callable[[], int], streams: Streams) -> None:
        self.pool, self.pair, self.turns, self.waiting = pool, pair, turns, waiting
        self.streams = streams
        self.since = NEVER  # the first turn needs no dwell
        self.across: Across | None = None
        self.turn_cost_s = turns.turn_cost_s
        self.stored: dict[Role, dict[str, int]] = {"mtp": {}, "plain": {}}

    def load(self, now: float) -> LoadSignal:
        level, crossover, band = load_against_crossover(self.pool.snapshot(self.pair, now),
                                                        self.pair.routing)
        return LoadSignal(level + self.waiting(), crossover, band)

    def rules(self) -> TurnRules:
        routing, turns = self.pair.routing, self.turns
        return TurnRules(turn_cost_s=self.turn_cost_s, dwell_turns=turns.dwell_turns,
                         min_dwell_s=routing.min_dwell_s, to_plain_after_s=turns.to_plain_after_s,
                         to_mtp_after_s=turns.to_mtp_after_s,
                         prefill_tokens_per_s=routing.prefill_tokens_per_s,
                         payback_turns=turns.payback_turns, gain_per_crossover=turns.gain_per_crossover)

    def turn_to(self, state: PairMemory, now: float) -> Role | None:
        if state.holder is None:
            return None
        cost = self.carried(state.holder, now)
        decision = decide_turn(Holding(state.holder, self.since, self.across),
                               self.load(now), self.rules(), now,
                               cached_tokens=cost.prefill_tokens, load_s=cost.load_s,
                               continued_tokens=self.continued_tokens(state.holder))
        self.across = decision.across
        if not decision.turn or (decision.to == "mtp" and state.speculation_lost):
            return None
        return decision.to

    def contexts(self, now: float) -> dict[str, int]:
        sessions = self.pair.sessions
        return {s: sessions.last_prompt.get(s, 0)
                for s in sessions.working(now, self.pair.routing.session_idle_s)}

    def carried(self, holder: Role, now: float) -> CarriedCost:
        """What the sessions at work pay for their contexts on the other server: all of them
        prefilled, or (``kv_store``) what its store lacks and the rest loaded."""
        if not self.turns.kv_store:
            idle_s = self.pair.routing.session_idle_s
            return CarriedCost(self.pair.sessions.reusable_context(now, idle_s), 0.0)
        incoming: Role = "plain" if holder == "mtp" else "mtp"
        rate = self.turns.store_load_tokens_per_s
        return carried_cost(self.contexts(now), self.stored[incoming], lambda tokens: tokens / rate)

    def continued_tokens(self, holder: Role) -> int:
        """What the holder's running streams would make the incoming server prefill again:
        their output estimated as the pieces relayed times the holder's accept length."""
        per_piece = (self.pair.accept_length or 1.0) if holder == "mtp" else 1.0
        return self.streams.running_tokens(self.pair.backends[holder], per_piece)

    def preferred(self) -> Role:
        return wanted("mtp", self.load(time.monotonic()))

    def settled(self, holder: Role, now: float, turn_s: float | None) -> None:
        """A turn restarts the dwell; a settling (at start, after a failure) does not: the
        holder it found may have held for long."""
        self.across = None
        if turn_s is not None:
            self.since, self.turn_cost_s = now, turn_s
            if self.turns.kv_store:  # the outgoing server's store: the sessions it served
                outgoing = self.stored["plain" if holder == "mtp" else "mtp"]
                outgoing.update(self.contexts(now))
                while len(outgoing) > self.pair.routing.max_sessions:
                    del outgoing[next(iter(outgoing))]


class TurnsRuntime:
    def __init__(self, drivers: dict[str, PairDriver | FollowDriver],
                 waiting: WaitingRoom | None, configured: dict[str, ShapeChoice],
                 auto: dict[str, AutoShape] | None = None) -> None:
        self.drivers = drivers
        self.waiting = waiting
        self.configured = configured  # the pairs whose shape the configuration forces
        self.auto = auto or {}  # the `memory: auto` pairs, each with the task that decides it

    def start(self) -> list[asyncio.Task[None]]:
        return [*(asyncio.create_task(driver.run(), name=f"turns-{name}")
                  for name, driver in self.drivers.items()),
                *(asyncio.create_task(auto.run(), name=f"memory-auto-{name}")
                  for name, auto in self.auto.items())]

    def state(self) -> dict[str, Any]:
        return {name: driver.describe() for name, driver in self.drivers.items()}

    def shape_of(self, pair: str) -> ShapeChoice:
        """The pair's shape and why (undecided yet: shape None)."""
        auto = self.auto.get(pair)
        return auto.choice if auto is not None else self.configured[pair]


def build_turns(settings: Settings, pool: Pool, upstream: Upstream, streams: Streams,
                registry: CollectorRegistry) -> TurnsRuntime:
    """A driver for every pair with `memory: turns`, a task deciding every `memory: auto`
    pair's shape (gateway/turns/auto.py); neither: nothing runs, nothing waits."""
    turns = settings.turns
    configured = {p.name: choose_shape(settings.memory_of(p), {}) for p in settings.fleet()
                  if settings.memory_of(p) != "auto"}
    for name, choice in configured.items():
        log.info("pair %s: memory %s (%s)", name, choice.shape, choice.reason)
    pairs = [p for p in settings.fleet() if settings.memory_of(p) != "split"]
    if not pairs:
        return TurnsRuntime({}, None, configured)
    waiting = WaitingRoom(turns.wait_max_requests, turns.wait_max_s, turns.retry_after_s,
                          turns.wait_circuit_max_s)
    drivers: dict[str, PairDriver | FollowDriver] = {}
    metrics = TurnMetrics(registry, lambda: drivers, lambda: waiting.waiting)
    journal = Journal(turns.state_file)

    def take_turns(spec: Pair) -> PairDriver | FollowDriver:
        name, pair, controller = spec.name, pool.pairs[spec.name], settings.controller_of(spec)
        controls = {role: engine_of(backend).control(upstream, backend.target, backend.name)
                    for role, backend in pair.backends.items()}
        handles = PairHandles(name, pair.backends, controls, streams, turns,
                              on_change=waiting.changed)
        driver: PairDriver | FollowDriver
        if controller is not None:
            driver = FollowDriver(handles, upstream, controller)
        else:
            wish = LoadWish(pool, pair, turns, lambda: waiting.waiting, streams)
            driver = PairDriver(handles, wish=wish, journal=journal, events=metrics,
                                engine=settings.engine_of(spec))
        pair.turns = drivers[name] = driver
        return driver

    auto: dict[str, AutoShape] = {}
    for spec in pairs:
        if settings.memory_of(spec) == "turns":
            take_turns(spec)
            continue
        pair = pool.pairs[spec.name]
        pair.turns = auto[spec.name] = AutoShape(
            pair, functools.partial(_read_saver, upstream, pair, lambda: settings.monitor),
            functools.partial(take_turns, spec), lambda _choice: waiting.changed(),
            lambda: settings.monitor.interval_s, settings.engine_of(spec))
    return TurnsRuntime(drivers, waiting, configured, auto)


async def _read_saver(upstream: Upstream, pair: PairState, monitor: Callable[[], Monitor],
                      role: Role) -> SaverReport:
    backend = pair.backends[role]
    return await engine_of(backend).read_memory_saver(upstream, backend.target, monitor().request_timeout_s)
