"""Routing state: exact in-flight counts, the mode, sessions, and what the monitor learned.

One `Router` per app. `admit()` takes a decision and counts the request in the same
synchronous step (no await between), so two concurrent requests always see each other.
The returned `Lease` is released exactly once, whatever path the request ends by; callers
release it in `finally`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.adaptive import CrossoverEstimator
from gateway.config import BACKEND_NAMES, BackendName, Routing
from gateway.policy import (
    BackendView,
    Decision,
    Mode,
    Moves,
    RequestFacts,
    Snapshot,
    decide,
    effective_crossover,
    other,
    plan_moves,
)


@dataclass
class BackendHealth:
    """Written by the monitor and the circuit breaker; read at decision time."""

    up: bool = True
    circuit_open: bool = False
    half_open: bool = False  # the circuit's open period is over: one trial request may go
    trial_in_flight: bool = False  # ... and it is on its way: the others still stay away
    effective_cap: int | None = None
    accept_length: float | None = None
    reported_running: int | None = None
    reported_waiting: int | None = None
    reported_at: float = float("-inf")  # monotonic time of the last /v1/loads reading

    @property
    def accepting(self) -> bool:
        """May take a new request: up, and its circuit closed or half-open with no trial out."""
        return self.up and not self.circuit_open and not self.trial_in_flight

    def claim_trial(self) -> bool:
        """A request is going here: when half-open, it is the trial (True)."""
        if self.half_open and not self.trial_in_flight:
            self.trial_in_flight = True
            return True
        return False

    def end_trial(self) -> None:
        """The trial ended without a verdict (the client left first): the next may try."""
        if self.half_open:
            self.trial_in_flight = False


class SessionMap:
    """Session id -> backend of its last turn, least recently used forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, BackendName] = OrderedDict()

    def get(self, session: str | None) -> BackendName | None:
        if session is None or session not in self._entries:
            return None
        self._entries.move_to_end(session)
        return self._entries[session]

    def put(self, session: str | None, backend: BackendName) -> None:
        if session is None or self.capacity == 0:
            return
        self._entries[session] = backend
        self._entries.move_to_end(session)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class Lease:
    """One admitted request's claim on a backend's in-flight count."""

    router: Router
    decision: Decision
    backend: BackendName
    trial: bool = False  # the half-open circuit's trial request
    started: bool = False  # its first byte came: a move would lose generated text
    released: bool = field(default=False)
    output_tokens: int | None = None  # completion tokens, when the caller learned them
    output_chunks: int | None = None  # SSE chunks that carried them, when counted
    # When the first byte came and the router's running-stream areas then (a speed sample).
    _sample_from: tuple[float, dict[BackendName, float]] | None = None

    @property
    def reason(self) -> str:
        """Why the request is where it is: the decision's reason, or failover after a retry."""
        return self.decision.reason if self.backend == self.decision.backend else "failover"

    def move_to(self, backend: BackendName) -> None:
        """Retry elsewhere before any byte went out: the count follows the request."""
        if self.released or backend == self.backend:
            return
        self._end_trial()
        self._count(-1)
        self.backend = backend
        self._count(+1)
        self._sample_from = None  # its speed is no longer one server's
        self.trial = self.router.health[backend].claim_trial()

    def mark_started(self) -> None:
        """The first byte came from the backend."""
        if not self.started and not self.released:
            self.started = True
            self.router.not_started[self.backend] -= 1
            now = self.router.advance_clock()
            self._sample_from = (now, dict(self.router.running_area))

    def release(self) -> None:
        if not self.released:
            self._end_trial()
            now = self._count(-1)
            self.released = True
            self.router.served[self.backend] += 1
            self._observe_speed(now)

    def _observe_speed(self, now: float) -> None:
        if self._sample_from is None or not self.output_tokens:
            return
        since, areas = self._sample_from
        seconds = now - since
        if seconds <= 0:
            return
        mean = {name: (self.router.running_area[name] - areas[name]) / seconds for name in areas}
        chunks = self.output_chunks - 1 if self.output_chunks else None  # after the first
        self.router.estimator.observe(self.backend, self.output_tokens - 1, seconds,
                                      mean[self.backend], mean[other(self.backend)], chunks)

    def _count(self, delta: int) -> float:
        now = self.router.advance_clock()
        self.router.inflight[self.backend] += delta
        if not self.started:
            self.router.not_started[self.backend] += delta
        return now

    def _end_trial(self) -> None:
        if self.trial:
            self.trial = False
            self.router.health[self.backend].end_trial()


class Router:
    def __init__(self, routing: Routing, *, loads_max_age_s: float = 3.0,
                 use_backend_loads: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.routing = routing
        self.clock = clock
        self.mode: Mode = "mtp"
        self.mode_since = clock()
        self.inflight: dict[BackendName, int] = {name: 0 for name in BACKEND_NAMES}
        self.served: dict[BackendName, int] = {name: 0 for name in BACKEND_NAMES}  # finished
        # Of the in-flight, those whose first byte has not come (Lease.mark_started).
        self.not_started: dict[BackendName, int] = {name: 0 for name in BACKEND_NAMES}
        self.health: dict[BackendName, BackendHealth] = {n: BackendHealth() for n in BACKEND_NAMES}
        self.sessions = SessionMap(routing.max_sessions)
        self.loads_max_age_s = loads_max_age_s
        self.use_backend_loads = use_backend_loads
        self._flipped_to_plain = False  # since the last take_moves()
        # Integral over time of the streams each backend was running (in flight, at most its
        # cap), up to `_area_at`: a stream's mean load is the difference over its life.
        self.running_area: dict[BackendName, float] = {name: 0.0 for name in BACKEND_NAMES}
        self._area_at = self.mode_since
        self.estimator = CrossoverEstimator()

    def advance_clock(self) -> float:
        """Bring the running areas up to now (before any in-flight count changes)."""
        now = self.clock()
        elapsed = now - self._area_at
        if elapsed > 0:
            for name, count in self.inflight.items():
                cap = self.health[name].effective_cap
                self.running_area[name] += elapsed * (count if cap is None else min(count, cap))
            self._area_at = now
        return now

    @property
    def concurrency(self) -> int:
        return sum(self.inflight.values())

    def update_routing(self, routing: Routing) -> None:
        self.sessions.capacity = routing.max_sessions
        self.routing = routing

    def snapshot(self, now: float) -> Snapshot:
        return Snapshot(self.mode, self.mode_since,
                        {name: self._view(name, now) for name in BACKEND_NAMES},
                        accept_length=self.accept_length,
                        learned_crossover=self.learned_crossover)

    @property
    def accept_length(self) -> float | None:
        """MTP's accept length: over its recent streams when learning, else the monitor's
        (SGLang's average since the server started)."""
        recent = self.estimator.accept_length if self.routing.adaptive_crossover else None
        return recent or self.health["mtp"].accept_length

    @property
    def learned_crossover(self) -> int | None:
        """The crossover the relayed streams imply, within the configured bounds (or None)."""
        routing = self.routing
        if not routing.adaptive_crossover:
            return None
        low, high = routing.crossover_bounds
        return self.estimator.crossover(low, high, self.health["mtp"].effective_cap)

    @property
    def crossover(self) -> int:
        """The crossover in force now: learned, else adapted to MTP's accept length."""
        return effective_crossover(self.routing, self.accept_length, self.learned_crossover)

    def learning_state(self) -> dict[str, object]:
        """What the relayed streams taught (dashboard, /admin): the learned crossover, each
        server's estimated tokens/s at the crossover in force (None: not seen there), MTP's
        recent accept length, and how many streams were samples."""
        estimator, crossover = self.estimator, self.crossover
        cap = self.health["mtp"].effective_cap
        mtp_load = crossover if cap is None else min(crossover, cap)
        return {
            "crossover": self.learned_crossover,
            "throughput": {"mtp": estimator.mtp.aggregate(mtp_load),
                           "plain": estimator.plain.aggregate(crossover)},
            "accept_length": estimator.accept_length,
            "samples": estimator.samples,
        }

    def _view(self, name: BackendName, now: float) -> BackendView:
        health = self.health[name]
        fresh = self.use_backend_loads and now - health.reported_at <= self.loads_max_age_s
        reported = None
        if fresh and health.reported_running is not None:
            reported = health.reported_running + (health.reported_waiting or 0)
        return BackendView(
            healthy=health.accepting,
            inflight=self.inflight[name],
            effective_cap=health.effective_cap,
            reported_load=reported,
            not_started=self.not_started[name],
        )

    def admit(self, facts: RequestFacts, now: float | None = None) -> Decision | Lease:
        """Decide and count. Returns the Decision alone when there is no backend."""
        now = self.advance_clock() if now is None else now
        decision = decide(self.snapshot(now), facts, self.routing, now)
        if self.mode == "mtp" and decision.mode == "plain":
            self._flipped_to_plain = True
        self.mode, self.mode_since = decision.mode, decision.mode_since
        if decision.backend is None:
            return decision
        lease = Lease(self, decision, decision.backend, self.health[decision.backend].claim_trial())
        lease._count(+1)
        return lease

    def take_moves(self, now: float | None = None) -> Moves:
        """What to move from MTP to plain now (see policy.plan_moves); the caller moves them."""
        now = self.clock() if now is None else now
        flipped, self._flipped_to_plain = self._flipped_to_plain, False
        return plan_moves(self.snapshot(now), self.routing, flipped=flipped)

    def remember_session(self, session: str | None, backend: BackendName) -> None:
        self.sessions.put(session, backend)
