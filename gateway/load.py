"""Routing state: exact in-flight counts, the mode, sessions, and what the monitor learned.

One `Router` per app. `admit()` takes a decision and counts the request in the same
synchronous step (no await between), so two concurrent requests always see each other.
The returned `Lease` is released exactly once, whatever path the request ends by; callers
release it in `finally`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

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
        self.trial = self.router.health[backend].claim_trial()

    def mark_started(self) -> None:
        """The first byte came from the backend."""
        if not self.started and not self.released:
            self.started = True
            self.router.not_started[self.backend] -= 1

    def release(self) -> None:
        if not self.released:
            self._end_trial()
            self._count(-1)
            self.released = True
            self.router.served[self.backend] += 1

    def _count(self, delta: int) -> None:
        self.router.inflight[self.backend] += delta
        if not self.started:
            self.router.not_started[self.backend] += delta

    def _end_trial(self) -> None:
        if self.trial:
            self.trial = False
            self.router.health[self.backend].end_trial()


class Router:
    def __init__(self, routing: Routing, *, loads_max_age_s: float = 3.0,
                 use_backend_loads: bool = False) -> None:
        self.routing = routing
        self.mode: Mode = "mtp"
        self.mode_since = time.monotonic()
        self.inflight: dict[BackendName, int] = {name: 0 for name in BACKEND_NAMES}
        self.served: dict[BackendName, int] = {name: 0 for name in BACKEND_NAMES}  # finished
        # Of the in-flight, those whose first byte has not come (Lease.mark_started).
        self.not_started: dict[BackendName, int] = {name: 0 for name in BACKEND_NAMES}
        self.health: dict[BackendName, BackendHealth] = {n: BackendHealth() for n in BACKEND_NAMES}
        self.sessions = SessionMap(routing.max_sessions)
        self.loads_max_age_s = loads_max_age_s
        self.use_backend_loads = use_backend_loads
        self._flipped_to_plain = False  # since the last take_moves()

    @property
    def concurrency(self) -> int:
        return sum(self.inflight.values())

    def update_routing(self, routing: Routing) -> None:
        self.sessions.capacity = routing.max_sessions
        self.routing = routing

    def snapshot(self, now: float) -> Snapshot:
        return Snapshot(self.mode, self.mode_since,
                        {name: self._view(name, now) for name in BACKEND_NAMES},
                        accept_length=self.health["mtp"].accept_length)

    @property
    def crossover(self) -> int:
        """The crossover in force now (adapted to MTP's accept length when configured)."""
        return effective_crossover(self.routing, self.health["mtp"].accept_length)

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
        now = time.monotonic() if now is None else now
        decision = decide(self.snapshot(now), facts, self.routing, now)
        if self.mode == "mtp" and decision.mode == "plain":
            self._flipped_to_plain = True
        self.mode, self.mode_since = decision.mode, decision.mode_since
        if decision.backend is None:
            return decision
        self.inflight[decision.backend] += 1
        self.not_started[decision.backend] += 1
        return Lease(self, decision, decision.backend, self.health[decision.backend].claim_trial())

    def take_moves(self, now: float | None = None) -> Moves:
        """What to move from MTP to plain now (see policy.plan_moves); the caller moves them."""
        now = time.monotonic() if now is None else now
        flipped, self._flipped_to_plain = self._flipped_to_plain, False
        return plan_moves(self.snapshot(now), self.routing, flipped=flipped)

    def remember_session(self, session: str | None, backend: BackendName) -> None:
        self.sessions.put(session, backend)
