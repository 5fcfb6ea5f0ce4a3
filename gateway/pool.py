"""The pool: every pair's backends, each pair's mode, sessions; and the lease of one request.

`Pool.admit()` decides and counts in one synchronous step (no await between), so two concurrent
requests always see each other. A decision is two pure functions over the pool's state: which
pair (`gateway.pairs.choose_pair`), then MTP or plain by that pair's own load, mode and
routing section (`gateway.policy.decide`). A retry is the same decision again with the failed
servers excluded.

The returned `Lease` ends exactly once, in `Lease.end(outcome)`, whatever path the request
ends by; that is the one place where the in-flight count is released and where failure,
circuit and blame are decided:

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

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gateway.adaptive import SETTLE_S, Advice, CrossoverEstimator
from gateway.backends import BackendState, CircuitRules, ProbeRules, Role
from gateway.config import Backend, Routing, Settings
from gateway.pairs import PairChoice, PairView, choose_pair
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

DEFAULT_CIRCUIT, DEFAULT_PROBE = CircuitRules(), ProbeRules()


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
class PairSpec:
    name: str
    mtp: Backend
    plain: Backend
    routing: Routing


def pair_specs(settings: Settings) -> list[PairSpec]:
    """The configured pairs, each with its routing section (`backends` alone: one pair)."""
    return [PairSpec(p.name, p.mtp, p.plain, settings.routing_for(p)) for p in settings.fleet()]


class MemoryGate(Protocol):
    """A turns pair's memory state, as the pool reads it (gateway/turns/driver.PairDriver)."""

    @property
    def admitting(self) -> Role | None: ...

    @property
    def waiting_for_turn(self) -> bool: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(eq=False)
class PairState:
    """One pair's two backends, and its own mode, routing and learned crossover (the trade-off
    belongs to one set of GPUs)."""

    name: str
    routing: Routing
    backends: dict[Role, BackendState]
    mode: Mode = "mtp"
    mode_since: float = 0.0
    changed_at: float = float("-inf")  # when the mode last changed (never, at start)
    moved: int = 0  # requests moved off its MTP server at flips (Lease.move_to), ever
    estimator: CrossoverEstimator = field(default_factory=CrossoverEstimator)
    sessions: SessionActivity = field(default_factory=lambda: SessionActivity())
    # A turns pair: only the server holding the memory is admitted to (its other is parked,
    # BackendState.parked); None for a split pair.
    turns: MemoryGate | None = None

    @property
    def accept_length(self) -> float | None:
        """MTP's accept length: over its recent streams when learning, else the monitor's
        (SGLang's average since the server started)."""
        recent = self.estimator.accept_length if self.routing.adaptive_crossover else None
        return recent or self.backends["mtp"].accept_length

    @property
    def advice(self) -> Advice | None:
        """Where plain is faster, from the relayed streams and, before they tell, from the
        running caps and accept length (gateway.adaptive); None when not learning."""
        if not self.routing.adaptive_crossover:
            return None
        low, high = self.routing.crossover_bounds
        accept = self.accept_length or self.routing.reference_accept_length
        return self.estimator.advise(low, high, self.backends["mtp"].effective_cap,
                                     self.backends["plain"].effective_cap, accept)

    @property
    def learned_crossover(self) -> int | None:
        """The crossover the relayed streams (or the caps) imply, within the bounds (or None)."""
        advice = self.advice
        return None if advice is None else advice.crossover

    @property
    def plain_below(self) -> int:
        """In flight below which plain is the faster server too (0: MTP at low load)."""
        advice = self.advice
        return 0 if advice is None else advice.plain_below

    @property
    def crossover(self) -> int:
        """The crossover in force now: learned, else adapted to MTP's accept length."""
        return effective_crossover(self.routing, self.accept_length, self.learned_crossover)

    @property
    def concurrency(self) -> int:
        return sum(b.inflight for b in self.backends.values())

    def learning_state(self) -> dict[str, object]:
        """What the relayed streams taught (dashboard, /admin): the learned crossover, each
        server's estimated tokens/s at the crossover in force (None: not seen there), MTP's
        recent accept length, and how many streams were samples."""
        estimator, crossover = self.estimator, self.crossover
        loads = {role: crossover if backend.effective_cap is None
                 else min(crossover, backend.effective_cap) for role, backend in self.backends.items()}
        return {
            "crossover": self.learned_crossover,
            "throughput": {"mtp": estimator.mtp.aggregate(loads["mtp"]),
                           "plain": estimator.plain.aggregate(loads["plain"])},
            "accept_length": estimator.accept_length,
            "samples": estimator.samples,
            "plain_below": self.plain_below if self.routing.adaptive_crossover else None,
        }


class SessionActivity:
    """One pair's sessions at work: requests in flight per session, and when each idle
    session's last request ended (oldest first), for the `sessions` load signal."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.idle_since: OrderedDict[str, float] = OrderedDict()
        self.requests = 0  # requests in flight that name a session

    def begin(self, session: str | None) -> None:
        if session is None:
            return
        self.idle_since.pop(session, None)
        self.in_flight[session] = self.in_flight.get(session, 0) + 1
        self.requests += 1

    def end(self, session: str | None, now: float, idle_s: float) -> None:
        if session is None or session not in self.in_flight:
            return
        self.requests -= 1
        left = self.in_flight[session] - 1
        if left > 0:
            self.in_flight[session] = left
            return
        del self.in_flight[session]
        self.idle_since[session] = now
        self._forget_idle(now, idle_s)

    def at_work(self, now: float, idle_s: float) -> int:
        """Sessions with a request in flight or idle at most `idle_s`."""
        self._forget_idle(now, idle_s)
        return len(self.in_flight) + len(self.idle_since)

    def _forget_idle(self, now: float, idle_s: float) -> None:
        while self.idle_since and now - next(iter(self.idle_since.values())) > idle_s:
            self.idle_since.popitem(last=False)


class SessionMap:
    """Key (a session, a stored response) -> name of the backend that holds its state, least
    recently used forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str | None) -> str | None:
        if key is None or key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: str | None, backend: str) -> None:
        if key is None or self.capacity == 0:
            return
        self._entries[key] = backend
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


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
    policy.plan_moves; which requests, by gateway.moves.choose_moves). Whoever made the
    decision that flipped applies it: the relay (gateway.handover), the bench (its flights)."""

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


@dataclass(eq=False)
class Attempt:
    backend: BackendState
    trial: bool  # the half-open circuit's one trial: held until the lease's end judges it
    failure: Failure | None = None


class Pool:
    def __init__(self, pairs: Sequence[PairSpec], *, now: float,
                 circuit: CircuitRules = DEFAULT_CIRCUIT, probe: ProbeRules = DEFAULT_PROBE,
                 use_backend_loads: bool = False, loads_max_age_s: float = 3.0,
                 affinity_slack: int = 8, max_sessions: int = 10000) -> None:
        if not pairs or len({p.name for p in pairs}) != len(pairs):
            raise ValueError("a pool needs pairs with distinct names")
        single = len(pairs) == 1
        self.pairs: dict[str, PairState] = {}
        self.backends: dict[str, BackendState] = {}
        for spec in pairs:
            members: dict[Role, BackendState] = {}
            for role, target in (("mtp", spec.mtp), ("plain", spec.plain)):
                name = role if single else f"{spec.name}/{role}"  # one pair: today's names
                members[role] = self.backends[name] = BackendState(  # type: ignore[index]
                    name, spec.name, role, target,  # type: ignore[arg-type]
                    circuit_rules=circuit, probe_rules=probe)
            self.pairs[spec.name] = PairState(spec.name, spec.routing, members, mode_since=now)
        self.sessions = SessionMap(max_sessions)
        self.use_backend_loads = use_backend_loads
        self.loads_max_age_s = loads_max_age_s
        self.affinity_slack = affinity_slack

    @classmethod
    def from_settings(cls, settings: Settings, now: float) -> Pool:
        monitor = settings.monitor
        return cls(pair_specs(settings), now=now,
                   circuit=CircuitRules(monitor.circuit_failures, monitor.circuit_open_s),
                   probe=ProbeRules(monitor.fall, monitor.rise),
                   use_backend_loads=monitor.use_backend_loads,
                   loads_max_age_s=monitor.backend_loads_max_age_s,
                   affinity_slack=settings.routing.pair_affinity_slack,
                   max_sessions=settings.routing.max_sessions)

    def apply_routing(self, settings: Settings) -> None:
        """A new routing section (hot reload, PUT /admin/routing): each pair's own, derived
        from it and the pair's overrides; the next decision uses them."""
        for spec in pair_specs(settings):
            if spec.name in self.pairs:
                self.pairs[spec.name].routing = spec.routing
        self.sessions.capacity = settings.routing.max_sessions
        self.affinity_slack = settings.routing.pair_affinity_slack

    @property
    def single(self) -> PairState | None:
        """The one pair of a one-pair pool."""
        return next(iter(self.pairs.values())) if len(self.pairs) == 1 else None

    @property
    def concurrency(self) -> int:
        """Requests this gateway has in flight, over every backend."""
        return sum(b.inflight for b in self.backends.values())

    # --- what the policy sees ----------------------------------------------------------------

    def view(self, backend: BackendState, now: float, exclude: Collection[str] = ()) -> BackendView:
        reported = (backend.reported_load(now, self.loads_max_age_s)
                    if self.use_backend_loads else None)
        return BackendView(
            healthy=backend.accepting(now) and backend.name not in exclude and not backend.parked,
            inflight=backend.inflight,
            effective_cap=backend.effective_cap,
            reported_load=reported,
            not_started=backend.not_started,
        )

    def snapshot(self, pair: PairState, now: float, exclude: Collection[str] = ()) -> Snapshot:
        at_work = (pair.sessions.at_work(now, pair.routing.session_idle_s)
                   if pair.routing.load_signal == "sessions" else None)
        return Snapshot(pair.mode, pair.mode_since,
                        {role: self.view(b, now, exclude) for role, b in pair.backends.items()},
                        accept_length=pair.accept_length,
                        learned_crossover=pair.learned_crossover,
                        plain_below=pair.plain_below,
                        sessions_at_work=at_work, session_requests=pair.sessions.requests)

    def pair_views(self, now: float, exclude: Collection[str] = ()) -> list[PairView]:
        """Each pair's load and whether it can take the request: its servers' views only, not
        a whole snapshot (sessions, learned crossover), which the chosen pair's decision takes."""
        views = []
        for pair in self.pairs.values():
            backends = [self.view(b, now, exclude) for b in pair.backends.values()]
            views.append(PairView(pair.name, sum(v.load for v in backends),
                                  any(v.healthy for v in backends)))
        return views

    # --- deciding ----------------------------------------------------------------------------

    def place(self, ask: Ask, now: float, exclude: Collection[str] = ()) -> Placement:
        """Decide where a request goes (a pair, then a server in it) and apply the pair's new
        mode. Counts nothing: `admit` and `Lease.retry_elsewhere` do."""
        holder = self.backends.get(ask.holder or "")
        if holder is not None and holder.accepting(now) and holder.name not in exclude:
            return self._place_in(self.pairs[holder.pair], PairChoice(holder.pair, "holder"),
                                  RequestFacts(None, holder.role), now, exclude)
        session_backend = self.backends.get(self.sessions.get(ask.session) or "")
        session_pair = session_backend.pair if session_backend is not None else None
        choice = choose_pair(self.pair_views(now, exclude), session_pair, self.affinity_slack)
        if choice.pair is None:
            first = next(iter(self.pairs.values()))
            reason = "memory_turn" if any(p.turns is not None and p.turns.waiting_for_turn
                                          for p in self.pairs.values()) else "no_backend"
            return Placement(None, Decision(None, reason, first.mode, first.mode_since),
                             choice)
        pair = self.pairs[choice.pair]
        role = session_backend.role if session_backend is not None and session_pair == pair.name \
            else None
        return self._place_in(pair, choice, RequestFacts(role, ask.pin, ask.prompt_tokens), now,
                              exclude)

    def _place_in(self, pair: PairState, choice: PairChoice, facts: RequestFacts, now: float,
                  exclude: Collection[str]) -> Placement:
        decision = decide(self.snapshot(pair, now, exclude), facts, pair.routing, now)
        if pair.turns is not None:
            decision = _turns_reason(decision, pair.turns)
        flipped = pair.mode == "mtp" and decision.mode == "plain"
        if decision.mode != pair.mode:
            pair.changed_at = now
        pair.mode, pair.mode_since = decision.mode, decision.mode_since
        backend = pair.backends[decision.backend] if decision.backend is not None else None
        return Placement(backend, decision, choice, flipped)

    def with_flip(self, placement: Placement, now: float) -> Placement:
        """The placement with the moves its flip causes, planned once the request is counted
        in (None when it flipped nothing, or the plan moves nothing)."""
        if not placement.flipped or placement.backend is None:
            return placement
        pair = self.pairs[placement.backend.pair]
        if pair.turns is not None:  # plain is parked: a turn moves them (gateway/turns)
            return placement
        planned = plan_moves(self.snapshot(pair, now), pair.routing, flipped=True)
        if not planned:
            return placement
        flip = Flip(pair.backends["mtp"], pair.backends["plain"], planned)
        return dataclasses.replace(placement, flip=flip)

    def admit(self, ask: Ask, now: float) -> Lease | Placement:
        """Decide and count. Returns the Placement alone when there is nowhere to go; the
        lease's `flip` is what its admission moves, for the caller to apply."""
        placement = self.place(ask, now)
        if placement.backend is None:
            return placement
        lease = Lease(self, ask, placement, [])
        lease.attempts.append(Attempt(placement.backend, placement.backend.admit(now, lease)))
        self.pairs[placement.backend.pair].sessions.begin(ask.session)
        lease.placement = self.with_flip(placement, now)
        return lease


def _turns_reason(decision: Decision, gate: MemoryGate) -> Decision:
    """In a turns pair the server holding the memory serves whatever the load asks; while
    none admits, the request waits for the turn."""
    if decision.backend is None:
        reason = "memory_turn" if gate.waiting_for_turn else decision.reason
        return replace(decision, reason=reason)
    if decision.reason == "failover":  # the mode's server is parked, not failed
        return replace(decision, reason="memory_holder")
    return decision


@dataclass(eq=False)
class Lease:
    """One admitted request's claim on a backend; see the module docstring."""

    pool: Pool
    ask: Ask
    placement: Placement
    attempts: list[Attempt]
    started: bool = False  # the first byte came from the backend
    ended: bool = False
    output_tokens: int | None = None  # completion tokens, when the caller learned them
    output_chunks: int | None = None  # SSE chunks that carried them, when counted
    moved_from: BackendState | None = None  # the server a planned move took it off
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
        self.attempts.append(Attempt(placement.backend, placement.backend.admit(now, self)))
        self._sample_from = None
        return self.pool.with_flip(placement, now)

    def continue_elsewhere(self, failure: Failure, now: float) -> BackendState | None:
        """The current attempt failed after its first byte: decide again without every server
        that failed it, for the stream's continuation there (gateway.handoff). The failure
        stays with the attempt, judged when the lease ends. None: nothing else can take it."""
        if self.ended:
            return None
        placement = self.pool.place(self.ask, now, exclude=[a.backend.name for a in self.attempts])
        if placement.backend is None:
            return None
        current = self.attempts[-1]
        current.failure = failure
        current.backend.leave(now, started=self.started, finished=False)
        self.attempts.append(Attempt(placement.backend,
                                     placement.backend.admit(now, started=self.started)))
        self._sample_from = None  # its speed is no longer one server's
        return placement.backend

    def move_to(self, backend: BackendState, now: float) -> None:
        """Move to another server without a failure (a planned move at the mode's flip)."""
        if self.ended or backend is self.backend:
            return
        current = self.attempts[-1]
        current.backend.leave(now, self, finished=False)
        if current.trial:  # no verdict on it: the next request may be the trial
            current.backend.end_trial()
            current.trial = False
        self.attempts[-1] = Attempt(backend, backend.admit(now, self, started=self.started))
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
        for attempt in self.attempts:
            if attempt.trial:
                attempt.backend.end_trial()
        failed = [a for a in self.attempts if a.failure is not None]
        verdicts = []
        for attempt, blamed in zip(failed, blame([a.failure for a in failed]), strict=True):
            assert attempt.failure is not None
            opened = attempt.backend.circuit_failure(now) if blamed else False
            verdicts.append(Verdict(attempt.backend, attempt.failure, blamed, opened))
        if outcome is Outcome.SUCCESS:
            last.backend.circuit_success()
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
