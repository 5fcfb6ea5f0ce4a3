"""The lease of one admitted request on a backend, and how its end is judged.

A `Lease` (from `Pool.admit`) ends exactly once, in `Lease.end(outcome)`, whatever path the
request ends by; that is the one place where the in-flight count is released and where
failure, circuit and blame are decided:

    SUCCESS          the backend answered (a 4xx included: it is up and judged the request);
                     closes its circuit
    BACKEND_FAILURE  the backend failed the request (connect error, 5xx, timeout, a stream
                     broken before or after its first byte): a failure against its circuit
    CLIENT_GONE      no verdict on anyone; a half-open trial lets the next request try
    GATEWAY_ERROR    the gateway's own fault (its client writer, a bug): no verdict either

A 5xx that another server also gives the same request is the request's fault (or every queue
is full), so it counts against no circuit: else a few bad requests would open every circuit.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.config import Role
from gateway.routing.backend import BackendState, SlowStart
from gateway.routing.crossover import SETTLE_S
from gateway.routing.pair import PairState
from gateway.routing.pairs import PairChoice
from gateway.routing.policy import Decision, Moves
from gateway.routing.sessions import SessionMap


class Outcome(enum.Enum):
    SUCCESS = "success"
    BACKEND_FAILURE = "backend_failure"
    CLIENT_GONE = "client_gone"
    GATEWAY_ERROR = "gateway_error"


@dataclass(frozen=True, slots=True)
class Failure:
    kind: str  # a bounded label: connect, status_5xx, stream_error, timeout_first_byte, ...
    answered: bool = False  # the backend answered, with an error (a 5xx, or a stream's first
    # event): when another server answers the same request so too, the request is the cause


@dataclass(frozen=True, slots=True)
class Verdict:
    """One failed attempt of a request, as judged at its end."""

    backend: BackendState
    failure: Failure
    blamed: bool  # counted against the backend's circuit
    opened: bool  # ... and that opened it


def blame(failures: Sequence[Failure]) -> list[bool]:
    """Which failures of one request count against their backend's circuit: all, except an
    error answer that another server also gave the same request."""
    answered = sum(f.answered for f in failures)
    return [not (f.answered and answered > 1) for f in failures]


@dataclass(frozen=True, slots=True)
class Ask:
    """What the pool needs to know about a request to place it."""

    session: str | None = None
    pin: Role | None = None  # client pin, already checked against allow_pin_header
    holder: str | None = None  # the backend that must serve it (it stores what it refers to)
    prompt_tokens: int = 0  # estimated from the body's size (placement.prompt_tokens_from_bytes)


@dataclass(frozen=True, slots=True)
class Flip:
    """A pair's flip to plain, and what it moves off the pair's MTP server now (planned by
    policy.plan_moves; which requests, by gateway.routing.policy.choose_moves). Whoever made the
    decision that flipped applies it: the relay (gateway.relay.in_flight), the bench (its flights)."""

    source: BackendState  # the pair's MTP server
    target: BackendState  # its plain server
    moves: Moves


@dataclass(frozen=True, slots=True)
class Placement:
    backend: BackendState | None  # None: nowhere to go
    decision: Decision
    pair_choice: PairChoice
    flipped: bool = False  # this decision flipped its pair to plain
    flip: Flip | None = None  # ... and these are the moves that causes (once counted in)
    # Nowhere to go, for now: with reason holder_circuit, a circuit lets its trial through in
    # this many seconds, with nothing else to say so (None: a trial's end will).
    look_again_s: float | None = None


@dataclass(eq=False)
class Attempt:
    backend: BackendState
    trial: bool  # the half-open circuit's one trial: held until the lease's end judges it
    failure: Failure | None = None
    slow_start: SlowStart | None = None  # the backend's slow start it is one of, judged likewise

    @classmethod
    def on(cls, backend: BackendState, now: float, request: object, *,
           started: bool = False) -> Attempt:
        """Counted in on `backend` (BackendState.admit)."""
        slow_start = backend.slow_start
        return cls(backend, backend.admit(now, request, started=started), slow_start=slow_start)


class Placer(Protocol):
    """What a lease asks of the pool that made it (gateway.routing.pool.Pool)."""

    pairs: dict[str, PairState]
    sessions: SessionMap

    def place(self, ask: Ask, now: float, exclude: Collection[str] = ()) -> Placement: ...

    def with_flip(self, placement: Placement, now: float) -> Placement: ...


@dataclass(eq=False)
class Lease:
    """One admitted request's claim on a backend; see the module docstring."""

    pool: Placer
    ask: Ask
    placement: Placement
    attempts: list[Attempt]
    started: bool = False  # the first byte came from the backend
    ended: bool = False
    output_tokens: int | None = None  # completion tokens, when the caller learned them
    output_chunks: int | None = None  # SSE chunks that carried them, when counted
    moved_from: BackendState | None = None  # the server a planned move took it off
    # Its end changed a circuit that arrivals may be waiting on (gateway/turns/waiting.py): it
    # ended a half-open trial, opened a circuit again, closed an open one, or freed a place
    # in a slow start (gateway.routing.backend.SlowStart).
    circuit_changed: bool = False
    # When the first byte came, and the pair's running-stream areas then (a speed sample).
    _sample_from: tuple[float, dict[Role, float]] | None = None

    @property
    def backend(self) -> BackendState:
        return self.attempts[-1].backend

    @property
    def reason(self) -> str:
        """Why the request is where it is: the decision's reason, `moved` after a planned
        move at the flip, or failover after a retry."""
        if len(self.attempts) > 1:
            return "failover"
        return self.placement.decision.reason if self.moved_from is None else "moved"

    @property
    def flip(self) -> Flip | None:
        """The moves its admission caused (a flip of its pair to plain), for the caller."""
        return self.placement.flip

    @property
    def movable(self) -> bool:
        """A planned move may take it: not pinned by the client, and not bound to the server
        that holds what it refers to (a stored response)."""
        return self.ask.pin is None and self.ask.holder is None

    def first_byte(self, now: float) -> None:
        if self.started or self.ended:
            return
        self.started = True
        backend = self.backend
        backend.first_byte(self)
        members = self.pool.pairs[backend.pair].backends
        self._sample_from = (now, {role: b.area(now) for role, b in members.items()})

    def retry_elsewhere(self, failure: Failure, now: float) -> Placement | None:
        """The current attempt failed before any byte went to the client: decide again without
        every server that failed it. Returns the new placement (its backend, and the moves
        its decision causes), or None (nothing else can take it: the lease stays, and ends
        with this failure)."""
        if self.ended or self.started:
            return None
        failed = [a.backend.name for a in self.attempts]
        placement = self.pool.place(self.ask, now, exclude=failed)
        if placement.backend is None:
            return None
        current = self.attempts[-1]
        current.failure = failure
        current.backend.leave(now, self, finished=False)  # a trial stays held: judged at end
        self.attempts.append(Attempt.on(placement.backend, now, self))
        self._sample_from = None
        return self.pool.with_flip(placement, now)

    def continue_elsewhere(self, failure: Failure, now: float) -> Placement | None:
        """The current attempt failed after its first byte: decide again without every server
        that failed it, for the stream's continuation there (gateway.relay.continuing). The failure
        stays with the attempt, judged when the lease ends. Returns the new placement (its
        backend, and the moves its decision causes), or None: nothing else can take it."""
        if self.ended:
            return None
        placement = self.pool.place(self.ask, now, exclude=[a.backend.name for a in self.attempts])
        if placement.backend is None:
            return None
        current = self.attempts[-1]
        current.failure = failure
        current.backend.leave(now, self, finished=False)
        self.attempts.append(Attempt.on(placement.backend, now, self, started=self.started))
        self._sample_from = None  # its speed is no longer one server's
        return self.pool.with_flip(placement, now)

    def move_to(self, backend: BackendState, now: float) -> None:
        """Move to another server without a failure (a planned move at the mode's flip)."""
        if self.ended or backend is self.backend:
            return
        current = self.attempts[-1]
        current.backend.leave(now, self, finished=False)
        if current.trial:  # no verdict on it: the next request may be the trial
            current.backend.end_trial()
            current.trial = False
        if current.slow_start is not None:  # likewise: its place is free
            freed = current.backend.slow_start_end(current.slow_start, None)
            self.circuit_changed = self.circuit_changed or freed
        self.attempts[-1] = Attempt.on(backend, now, self, started=self.started)
        self.moved_from = current.backend
        self.pool.pairs[backend.pair].moved += 1
        self._sample_from = None  # its speed is no longer one server's

    def end(self, outcome: Outcome, now: float, failure: Failure | None = None) -> list[Verdict]:
        """The one end of a request: release its count, judge every attempt, remember the
        session. `failure` is the last attempt's, with BACKEND_FAILURE. Later calls do nothing."""
        if self.ended:
            return []
        self.ended = True
        last = self.attempts[-1]
        if outcome is Outcome.BACKEND_FAILURE:
            last.failure = failure or Failure("unknown")
        last.backend.leave(now, self, finished=True)
        pair = self.pool.pairs[self.attempts[0].backend.pair]
        pair.sessions.end(self.ask.session, now, pair.routing.session_idle_s)
        failed = [(a, a.failure) for a in self.attempts if a.failure is not None]
        blamed = dict(zip([a for a, _ in failed], blame([f for _, f in failed]), strict=True))
        changed = self.circuit_changed
        for attempt in self.attempts:
            if attempt.trial:
                attempt.backend.end_trial()
                changed = True
            if attempt.slow_start is not None:
                went_well = (True if attempt is last and outcome is Outcome.SUCCESS
                             else False if blamed.get(attempt) else None)
                changed = attempt.backend.slow_start_end(attempt.slow_start, went_well) or changed
        verdicts = []
        for attempt, failure in failed:
            was_blamed = blamed[attempt]
            opened = attempt.backend.circuit_failure(now) if was_blamed else False
            changed = changed or opened
            verdicts.append(Verdict(attempt.backend, failure, was_blamed, opened))
        if outcome is Outcome.SUCCESS:
            turns = self.pool.pairs[last.backend.pair].turns is not None
            changed = last.backend.circuit_success(slow_start=turns) or changed
        self.circuit_changed = changed
        self.pool.sessions.put(self.ask.session, last.backend.name)
        self._observe_speed(now)
        return verdicts

    def _observe_speed(self, now: float) -> None:
        """A finished stream is a sample of its server's speed at its mean load."""
        if self._sample_from is None or not self.output_tokens:
            return
        since, areas = self._sample_from
        seconds = now - since
        if seconds <= 0:
            return
        pair = self.pool.pairs[self.backend.pair]
        if since < pair.changed_at + SETTLE_S:
            return  # it decoded through a mode change or its aftermath (moved streams' prefills)
        mean = {role: (b.area(now) - areas[role]) / seconds for role, b in pair.backends.items()}
        role = self.backend.role
        chunks = self.output_chunks - 1 if self.output_chunks else None  # after the first
        pair.estimator.observe(role, self.output_tokens - 1, seconds, mean[role],
                               mean["plain" if role == "mtp" else "mtp"], chunks)
