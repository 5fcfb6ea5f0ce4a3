"""The pool: every pair's backends, each pair's mode, sessions; it places and admits requests.

`Pool.admit()` decides and counts in one synchronous step (no await between), so two concurrent
requests always see each other. A decision is two pure functions over the pool's state: which
pair (`gateway.routing.pairs.choose_pair`), then MTP or plain by that pair's own load, mode and
routing section (`gateway.routing.policy.decide`). A retry is the same decision again with the failed
servers excluded. The admitted request's `Lease` (gateway.routing.lease) carries the moves its
decision's flip causes.

The pool's parts have modules of their own: a pair (gateway.routing.pair), sessions
(gateway.routing.sessions), the lease and its end (gateway.routing.lease); their names are importable
from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import replace

from gateway.config import Role, Settings
from gateway.routing.backend import BackendState, CircuitRules, ProbeRules
from gateway.routing.lease import Ask, Attempt, Failure, Flip, Lease, Outcome, Placement, Verdict, blame
from gateway.routing.pair import MemoryGate, PairSpec, PairState, pair_specs
from gateway.routing.pairs import PairChoice, PairView, choose_pair
from gateway.routing.policy import (
    BackendView,
    Decision,
    Reason,
    RequestFacts,
    Snapshot,
    decide,
    plan_moves,
)
from gateway.routing.sessions import SessionActivity, SessionMap

__all__ = ["Ask", "Attempt", "Failure", "Flip", "Lease", "MemoryGate", "Outcome", "PairSpec",
           "PairState", "Placement", "Pool", "SessionActivity", "SessionMap", "Verdict", "blame",
           "pair_specs"]

DEFAULT_CIRCUIT, DEFAULT_PROBE = CircuitRules(), ProbeRules()


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
                    circuit_rules=circuit, probe_rules=probe, engine=spec.engine)
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
        return [_pair_view(pair.name, [self.view(b, now, exclude) for b in pair.backends.values()])
                for pair in self.pairs.values()]

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
        single, snapshot = self.single, None
        if single is not None:  # its servers' views once, for the choice and the decision
            snapshot = self.snapshot(single, now, exclude)
            views = [_pair_view(single.name, snapshot.backends.values())]
        else:
            views = self.pair_views(now, exclude)
        choice = choose_pair(views, session_pair, self.affinity_slack)
        if choice.pair is None:
            return self._nowhere(choice, now, exclude)
        pair = self.pairs[choice.pair]
        role = session_backend.role if session_backend is not None and session_pair == pair.name \
            else None
        return self._place_in(pair, choice, RequestFacts(role, ask.pin, ask.prompt_tokens), now,
                              exclude, snapshot)

    def _nowhere(self, choice: PairChoice, now: float, exclude: Collection[str]) -> Placement:
        """No pair can take the request now. It waits for a turn under way (memory_turn), or
        for the circuit of a turns pair's holder that is up (holder_circuit): the pair has no
        other server to take it, as a single server queues what it is sent. Else no_backend."""
        first = next(iter(self.pairs.values()))
        held = [h for p in self.pairs.values()
                if (h := _holder_behind_circuit(p, now, exclude)) is not None]
        reason: Reason = "holder_circuit" if held else "no_backend"
        if any(p.turns is not None and p.turns.waiting_for_turn for p in self.pairs.values()):
            reason = "memory_turn"
        look_again_s = min((s for h in held if (s := h.circuit.opens_in(now)) is not None),
                           default=None)
        return Placement(None, Decision(None, reason, first.mode, first.mode_since), choice,
                         look_again_s=look_again_s)

    def _place_in(self, pair: PairState, choice: PairChoice, facts: RequestFacts, now: float,
                  exclude: Collection[str], snapshot: Snapshot | None = None) -> Placement:
        if snapshot is None:
            snapshot = self.snapshot(pair, now, exclude)
        decision = decide(snapshot, facts, pair.routing, now)
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
        lease.attempts.append(Attempt.on(placement.backend, now, lease))
        pair = self.pairs[placement.backend.pair]
        pair.sessions.begin(ask.session, now, pair.routing.session_idle_s, ask.prompt_tokens)
        lease.placement = self.with_flip(placement, now)
        return lease


def _pair_view(name: str, backends: Collection[BackendView]) -> PairView:
    """A pair's load and whether it can take the request, from its servers' views."""
    return PairView(name, sum(v.load for v in backends), any(v.healthy for v in backends))


def _holder_behind_circuit(pair: PairState, now: float, exclude: Collection[str]
                           ) -> BackendState | None:
    """The turns pair's holder when it is up but its circuit keeps it out (open, half-open
    with its trial out, or closed with its slow start full); a holder that is down is lost
    (gateway/turns/state.py holder_lost)."""
    role = pair.turns.admitting if pair.turns is not None else None
    if role is None:
        return None
    holder = pair.backends[role]
    if holder.up and not holder.parked and holder.name not in exclude and not holder.accepting(now):
        return holder
    return None


def _turns_reason(decision: Decision, gate: MemoryGate) -> Decision:
    """In a turns pair the server holding the memory serves whatever the load asks; while
    none admits, the request waits for the turn."""
    if decision.backend is None:
        reason = "memory_turn" if gate.waiting_for_turn else decision.reason
        return replace(decision, reason=reason)
    if decision.reason == "failover":  # the mode's server is parked, not failed
        return replace(decision, reason="memory_holder")
    return decision
