"""Virtual time for a pair whose servers take turns owning the GPUs' memory, and for loads that
change within one run (``--schedule``).

One module of ~430 lines on purpose: the turns pair's virtual time and its schedules share one
clock, one pool and one turn-cost model; split, each would reach into the others' state.

**The turns pair.** Both servers are sized for the whole GPU less what the parked one still
holds (:func:`gateway.bench.targets.turns_profiles`). Only the holder steps; the other is
parked (:meth:`gateway.sim.virtual.VirtualSim.park`). The real :class:`gateway.routing.pool.Pool`
admits and counts every request and computes the load signal
(:func:`gateway.routing.policy.load_against_crossover`); the request is placed on the holder (a pin),
and the pure :func:`gateway.turns.decision.decide_turn` says when to hand over. A turn, in
virtual time, as issue 19 orders it:

1. stop admitting to the outgoing server: arrivals wait at the gateway;
2. its unstarted requests move to the incoming server (cancelled, re-sent whole);
3. its running streams are continued there: aborted, and the prompt + the tokens generated so
   far sent as the new prompt for the rest of ``max_tokens`` (a cold prefill: release flushes
   the prefix cache). With ``running="finish"`` they finish on the outgoing server first,
   within ``finish_bound_s``; those still running then are continued (``past_bound="end"``,
   a vLLM pair: ended with an error);
4. with a store (``store``, below) the outgoing server, idle and unpaused, first drains its
   L3 writes, at most ``drain_bound_s``;
5. the outgoing server is paused and released (its prefix cache flushed, with a store its host
   tier and the writes not yet in L3 too), and after ``cost_s`` (pause + release + resume +
   continue: 1.5 s measured on an H200 with the host copy retained, memory-turns.md; a vLLM
   pair's ``cost_to``: the outgoing server's sleep + the incoming one's wake) the incoming one
   steps;
6. the waiting arrivals are admitted.

**The store** (``TurnModel.store``, :mod:`gateway.sim.hicache`): ``own`` (the default, what a
deployment should run: SGLang's HiCache with write-through to an L3 file store on a tmpfs,
one namespace per server) lets each server find, on its next turn, the session prefixes it
wrote on its previous one: a request loads them and prefills only the rest. ``none`` is the
pair without HiCache; ``shared`` puts both servers in one namespace, which SGLang 0.5.23 would
serve as silent garbage (the plain server reading MTP's pages), so the simulator refuses it.
The decision then charges a turn what the sessions at work pay on the incoming server: their
contexts its store lacks, prefilled, and the seconds to load the rest
(:func:`gateway.turns.decision.carried_cost`).

**Schedules.** ``4:600,64:600`` keeps 4 clients busy for 600 s, then 64 for 600 s, in one run
of one simulator: clients beyond the phase's count finish their script and stop; new ones start
at a phase's beginning. Tokens are counted over the whole run, and each phase's figures over
its own window. A schedule's run, or a steady level's, stops once every request that started
before its end has ended (:class:`gateway.bench.virtual.UntilCounted`).

**Open loop** (``arrivals``, :class:`gateway.bench.arrivals.OpenLoop`): script ``i`` starts at
its scheduled time ``times[i]`` whatever else runs (a request, or a session closed-loop inside);
at most ``max_in_flight`` scripts are alive, later arrivals wait in order. A script's first
request counts its latency from the scheduled time (``RequestRecord.start``), so a wait at the
client, in the turns' waiting room or in a server's queue is all in it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from gateway.bench.arrivals import OpenLoop
from gateway.bench.flights import Flight, Flights, drive_script
from gateway.bench.levels import LevelPlan
from gateway.bench.stats import ArrivalRecord, RequestRecord, summarise
from gateway.bench.virtual import AcceptMonitor, UntilCounted, route, virtual_pool
from gateway.bench.workloads import Job, Outcome, Workload
from gateway.config import Role, Routing, Turns
from gateway.routing.backend import BackendState
from gateway.routing.crossover import CrossoverEstimator
from gateway.routing.policy import load_against_crossover
from gateway.routing.pool import Ask, Lease, Pool
from gateway.sim.hicache import L3_WRITE_BYTES_PER_S, StoreSpec, store_spec
from gateway.sim.profile import Profile
from gateway.sim.virtual import RequestLog, VirtualSim
from gateway.turns.decision import (
    GAIN_PER_CROSSOVER,
    NEVER,
    Across,
    CarriedCost,
    Holding,
    LoadSignal,
    TurnRules,
    carried_cost,
    decide_turn,
    measured_gain_per_crossover,
    wanted,
)

MEASURED_TURN_COST_S = 1.5  # memory-turns.md: one pauses, the other resumes, host copy retained
FINISH_BOUND_S = 30.0  # running="finish": streams still running after this are continued


@dataclass(frozen=True)
class TurnModel:
    """How a turn is done and what it costs (see the module docstring)."""

    cost_s: float = MEASURED_TURN_COST_S
    # continue: running streams go on on the incoming server; finish: they end where they run
    # (within finish_bound_s); finish-back: finish on the way back to MTP only (a draining burst)
    running: Literal["continue", "finish", "finish-back"] = "continue"
    finish_bound_s: float = FINISH_BOUND_S
    # those still running past finish_bound_s: continued, or ended with an error (vLLM's plan:
    # no continuation, gateway/turns/state.py HANDOVERS)
    past_bound: Literal["continue", "end"] = "continue"
    # the cost of a turn to each server where it is not cost_s (vLLM: the other's sleep + its wake)
    cost_to: tuple[tuple[Role, float], ...] = ()
    crossover: int | None = None  # in the load signal's unit; None: calibrated per workload
    first_holder: Role = "mtp"
    # the turn must repay this many times its cost first (gateway/turns/decision.py); 0: the
    # rule before it, a turn as soon as the load crosses
    payback_turns: float = TurnRules().payback_turns
    # how fast plain pulls ahead past the crossover; None: calibrated with the crossover
    gain_per_crossover: float | None = None
    # each server's HiCache L3 namespace; none by default, as the deploy files run: on agent
    # days it bought nothing (lab/results/turns-store/turns.md)
    store: Literal["own", "shared", "none"] = "none"
    # the outgoing server's L3 writes before its pause: the live gateway's bound
    drain_bound_s: float = Turns().keep_caches_within_s
    gpus: int = 4  # ranks a store's pages and Mamba states are split over
    l3_write_bytes_per_s: float = L3_WRITE_BYTES_PER_S  # a rank: how fast its store takes writes
    l3_capacity_bytes: float | None = None  # a server's L3 cap; None: the deploy files'

    def store_specs(self, profiles: Mapping[str, Profile]) -> dict[str, StoreSpec]:
        """Each server's store: ``own`` a namespace each, ``shared`` one for both."""
        if self.store == "none":
            return {}
        return {role: dataclasses.replace(
                    store_spec(profiles[role].speculative, gpus=self.gpus,
                               namespace="pair" if self.store == "shared" else role,
                               capacity_bytes=self.l3_capacity_bytes),
                    l3_write_bytes_per_s=self.l3_write_bytes_per_s)
                for role in ("mtp", "plain") if role in profiles}

    def turn_cost_s(self, to: Role) -> float:
        return dict(self.cost_to).get(to, self.cost_s)

    def rules(self, routing: Routing) -> TurnRules:
        return TurnRules(turn_cost_s=max((cost for _, cost in self.cost_to), default=self.cost_s),
                         min_dwell_s=routing.min_dwell_s,
                         prefill_tokens_per_s=routing.prefill_tokens_per_s,
                         payback_turns=self.payback_turns,
                         gain_per_crossover=self.gain_per_crossover or GAIN_PER_CROSSOVER)


@dataclass
class TurnRecord:
    """One turn: when it started and settled, and what it moved."""

    start: float
    to: Role
    reason: str
    released_at: float = 0.0  # when the outgoing server was parked (after finishing, if so)
    settled_at: float = 0.0  # when the incoming server stepped again
    moved_unstarted: int = 0
    continued: int = 0
    continued_tokens: int = 0  # prompt + generated tokens the continued streams re-prefill
    finished_first: int = 0
    ended: int = 0  # running past the finish bound, ended with an error (past_bound="end")
    waited: int = 0  # arrivals that waited at the gateway
    # What the sessions at work pay for their contexts on the incoming server, from the stores
    # as they are when the turn starts: sessions, their contexts (without a store, all of it is
    # prefilled), what its store lacks (prefilled), the seconds to load the rest, the seconds
    # to prefill the lack, at the incoming server's prefill rate.
    sessions: int = 0
    context_tokens: int = 0
    prefill_tokens: int = 0
    load_s: float = 0.0
    prefill_s: float = 0.0
    drain_s: float = 0.0  # the outgoing server's L3 writes drained before its pause
    dropped_tokens: int = 0  # writes the release dropped (not in L3 yet)


# --- schedules --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Phase:
    concurrency: int
    seconds: float


def parse_schedule(text: str) -> list[Phase]:
    """``C:SECONDS,...`` -> phases."""
    phases = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        c, sep, s = part.partition(":")
        try:
            phase = Phase(int(c), float(s))
        except ValueError:
            phase = None
        if not sep or phase is None or phase.concurrency < 1 or phase.seconds <= 0:
            raise ValueError(f"--schedule takes C:SECONDS,... with C >= 1 and SECONDS > 0, got {part!r}")
        phases.append(phase)
    if not phases:
        raise ValueError("--schedule needs at least one C:SECONDS phase")
    return phases


def phase_windows(phases: Sequence[Phase]) -> list[tuple[float, float]]:
    windows, t = [], 0.0
    for phase in phases:
        windows.append((t, t + phase.seconds))
        t += phase.seconds
    return windows


class _Clients:
    """Closed-loop client slots following a level plan or a schedule."""

    def __init__(self, sim: VirtualSim, workload: Workload,
                 send: Callable[[Job, Callable[[Outcome], None]], object],
                 plan: LevelPlan | None, phases: Sequence[Phase] | None) -> None:
        self.sim, self.workload, self.send = sim, workload, send
        self.plan, self.phases = plan, phases
        self.started = 0  # requests
        self.scripts = 0
        self.active: set[int] = set()
        self.windows = phase_windows(phases) if phases else []

    def concurrency_now(self) -> int:
        if self.plan is not None:
            return self.plan.concurrency
        for (t0, t1), phase in zip(self.windows, self.phases or (), strict=True):
            if t0 <= self.sim.now < t1:
                return phase.concurrency
        return 0

    def budget_left(self) -> bool:
        if self.plan is not None:
            return self.plan.budget_left(self.started, self.sim.now)
        return self.sim.now < self.windows[-1][1]

    def begin(self) -> None:
        if self.plan is not None:
            for slot in range(self.plan.concurrency):
                self.sim.at(0.0, partial(self._next, slot))
            return
        for t0, _ in self.windows:
            self.sim.at(t0, self._fill)

    def _fill(self) -> None:
        for slot in range(self.concurrency_now()):
            if slot not in self.active:
                self._next(slot)

    def _next(self, slot: int) -> None:
        if not self.budget_left() or slot >= self.concurrency_now():
            self.active.discard(slot)
            return
        self.active.add(slot)
        script = self.workload.script(self.scripts)
        self.scripts += 1
        drive_script(self.sim, script, self._start, lambda: self._next(slot))

    def _start(self, job: Job, done: Callable[[Outcome], None]) -> None:
        self.started += 1
        self.send(job, done)


Sender = Callable[[Job, Callable[[Outcome], None], float | None], RequestRecord]


class _OpenClients:
    """Open-loop arrivals: script ``i`` starts at ``times[i]`` (or, past ``max_in_flight``
    scripts alive, when one ends), its first request's latency counted from ``times[i]``."""

    def __init__(self, sim: VirtualSim, workload: Workload, send: Sender, arrivals: OpenLoop) -> None:
        self.sim, self.workload, self.send, self.arrivals = sim, workload, send, arrivals
        self.records = [ArrivalRecord(t) for t in arrivals.times]
        self.alive = 0
        self.held: deque[int] = deque()

    def begin(self) -> None:
        for i, t in enumerate(self.arrivals.times):
            self.sim.at(t, functools.partial(self._arrive, i))

    def _arrive(self, i: int) -> None:
        if self.alive >= self.arrivals.max_in_flight:
            self.held.append(i)
            return
        self._begin_script(i)

    def _begin_script(self, i: int) -> None:
        self.alive += 1
        arrival = self.records[i]
        arrival.started = started = self.sim.now
        first_send: list[float] = []

        def send(job: Job, done: Callable[[Outcome], None]) -> None:
            # The script's first Send (its jobs leave together) was due as long after the
            # scheduled arrival as after the script's start (a think time first); a later one is
            # due when it is sent (an answer, or a think time, ended).
            if not first_send:
                first_send.append(self.sim.now)
            start = arrival.scheduled + (self.sim.now - started) if self.sim.now == first_send[0] else None
            arrival.requests += 1
            arrival.output_asked += job.max_tokens

            def ended(outcome: Outcome) -> None:
                if outcome.error is not None:
                    arrival.errors += 1
                done(outcome)

            arrival.records.append(self.send(job, ended, start))

        drive_script(self.sim, self.workload.script(i), send, lambda: self._end(i))

    def _end(self, i: int) -> None:
        self.records[i].end = self.sim.now
        self.alive -= 1
        if self.held:
            self._begin_script(self.held.popleft())


# --- the turns controller in virtual time -----------------------------------------------------

class _TurnFlights(Flights):
    def continue_on(self, flight: Flight, to: BackendState) -> None:
        """Abort it where it runs and send it to ``to`` with what it generated so far."""
        self._move(flight, to)

    def end(self, flight: Flight) -> None:
        """Abort it where it runs: it ends with an error ("abort")."""
        self.sim.abort(self.engine_of(flight.lease.backend), flight.rid)


@dataclass(eq=False)
class _Waiting:
    job: Job
    record: RequestRecord
    done: Callable[[Outcome], None]


@dataclass(eq=False)
class TurnsController:
    """The pair's memory in virtual time: who holds it, turns, the waiting room."""

    sim: VirtualSim
    pool: Pool
    flights: _TurnFlights
    routing: Routing  # the turns' routing: a fixed crossover in the load signal's unit
    model: TurnModel
    holder: Role = "mtp"
    since: float = NEVER
    across: Across | None = None
    turning: TurnRecord | None = None
    turns: list[TurnRecord] = field(default_factory=list)
    waiting: deque[_Waiting] = field(default_factory=deque)
    _timer_at: float | None = None
    # each session's context: when its last Send left, its longest prompt then (a Send's jobs
    # leave together: a side call or sub-agents beside the main call are not its context), and
    # with a store its page keys; and the decision's carried cost (recomputed at most every
    # COST_REFRESH_S: it walks every session's pages)
    _contexts: dict[str, tuple[float, int, list[int]]] = field(default_factory=dict)
    _cost: tuple[float, CarriedCost] | None = None

    COST_REFRESH_S = 1.0

    def __post_init__(self) -> None:
        self.rules = self.model.rules(self.routing)
        self.pair = self.pool.pairs["default"]
        self.sim.park(self._other(), flush_cache=True)

    def _other(self) -> Role:
        return "plain" if self.holder == "mtp" else "mtp"

    # the request path
    def send(self, job: Job, record: RequestRecord, done: Callable[[Outcome], None]) -> None:
        if self.turning is not None:
            self.turning.waited += 1
            self.waiting.append(_Waiting(job, record, done))
            return
        self._admit(job, record, done)
        self.evaluate()

    def _admit(self, job: Job, record: RequestRecord, done: Callable[[Outcome], None]) -> None:
        if job.session is not None:
            self._track(job.session, job.prompt_ids)
        ask = Ask(session=job.session, pin=self.holder, prompt_tokens=len(job.prompt_ids))
        lease = self.pool.admit(ask, self.sim.now)
        assert isinstance(lease, Lease) and lease.backend.role == self.holder

        def finished(outcome: Outcome) -> None:
            done(outcome)
            self.evaluate()

        self.flights.start(job, lease, record, finished)

    # the decision
    def _on(self, role: Role) -> list[Flight]:
        backend = self.pair.backends[role]
        return [f for f in self.flights.live.values() if f.lease.backend is backend]

    def _track(self, session: str, prompt: Sequence[int]) -> None:
        now, known = self.sim.now, self._contexts.get(session)
        if known is not None and known[0] == now and known[1] >= len(prompt):
            return
        keys = self.sim.engines[self.holder].block_keys(prompt) if self.sim.hicache else []
        self._contexts[session] = (now, len(prompt), keys)

    def _at_work(self) -> dict[str, tuple[float, int, list[int]]]:
        at_work = self.pair.sessions.working(self.sim.now, self.routing.session_idle_s)
        return {s: self._contexts[s] for s in at_work if s in self._contexts}

    def _sessions_context(self) -> int:
        return self.pair.sessions.reusable_context(self.sim.now, self.routing.session_idle_s)

    def carried(self, to: Role) -> CarriedCost:
        """What the sessions at work would pay for their contexts on ``to`` now: without a
        store, the holder's cache the release throws away, prefilled again; with one, what
        ``to``'s store lacks, prefilled, and the seconds to load the rest."""
        cache = self.sim.hicache.get(to)
        if cache is None:
            return CarriedCost(min(self._sessions_context(),
                                   self.sim.engines[self.holder].prefix_cached_tokens), 0.0)
        now, at_work = self.sim.now, self._at_work()
        contexts = {s: tokens for s, (_, tokens, _) in at_work.items()}
        stored = {s: cache.stored_keys(keys, now)[0] for s, (_, _, keys) in at_work.items()}
        return carried_cost(contexts, stored, cache.spec.load_s)

    def _carried_now(self, to: Role) -> CarriedCost:
        now = self.sim.now
        if to not in self.sim.hicache:  # a sum, cheap
            return self.carried(to)
        if self._cost is None or now - self._cost[0] >= self.COST_REFRESH_S:
            self._cost = (now, self.carried(to))
        return self._cost[1]

    def evaluate(self) -> None:
        if self.turning is not None:
            return
        now = self.sim.now
        load = LoadSignal(*load_against_crossover(self.pool.snapshot(self.pair, now), self.routing))
        running = self._on(self.holder)
        continued = sum(len(f.job.prompt_ids) + f.generated for f in running if f.lease.started)
        # what the turn would cost matters only once the load stands on the other side
        across = wanted(self.holder, load) != self.holder
        cost = self._carried_now(self._other()) if across else CarriedCost(0, 0.0)
        decision = decide_turn(Holding(self.holder, self.since, self.across), load, self.rules, now,
                               cached_tokens=cost.prefill_tokens, continued_tokens=continued,
                               load_s=cost.load_s)
        self.across = decision.across
        if decision.turn and decision.to is not None:
            self._begin_turn(decision.to, decision.reason)
        elif decision.reason in ("confirming", "paying_back", "dwell"):
            self._recheck(decision.reason, cost, continued)

    def _recheck(self, reason: str, cost: CarriedCost, continued: int) -> None:
        """Look again when the answer could change without any request arriving or ending."""
        assert self.across is not None
        to_mtp = self.holder == "plain"
        if reason == "confirming":
            at = self.across.since + (self.rules.to_mtp_after_s if to_mtp else self.rules.to_plain_after_s)
        elif reason == "paying_back":
            at = self.across.repaid_at(self.rules.price(cost.prefill_tokens, cost.load_s))
        else:
            at = self.since + self.rules.dwell(cost.prefill_tokens, continued, cost.load_s)
        if at <= self.sim.now or at == math.inf or (self._timer_at is not None and self._timer_at <= at):
            return
        self._timer_at = at

        def fire() -> None:
            if self._timer_at == at:
                self._timer_at = None
                self.evaluate()

        self.sim.at(at, fire)

    # the turn
    def _begin_turn(self, to: Role, reason: str) -> None:
        turn = self.turning = TurnRecord(start=self.sim.now, to=to, reason=reason)
        self.turns.append(turn)
        self._record_cost(turn)
        incoming = self.pair.backends[to]
        flights = self._on(self.holder)
        unstarted = [f for f in flights if not f.lease.started]
        for flight in unstarted:
            self.flights.continue_on(flight, incoming)
        turn.moved_unstarted = len(unstarted)
        turn.finished_first = len(flights) - len(unstarted)  # less those continued at release
        finish = self.model.running == "finish" or (self.model.running == "finish-back" and to == "mtp")
        if finish and any(f.lease.started for f in flights):
            deadline = self.sim.now + self.model.finish_bound_s
            self._await_finish(deadline)
            return
        self._release()

    def _await_finish(self, deadline: float) -> None:
        running = self._on(self.holder)
        if not running or self.sim.now >= deadline:
            assert self.turning is not None
            self._release()
            return
        self.sim.at(min(deadline, self.sim.now + 0.1), lambda: self._await_finish(deadline))

    def _release(self) -> None:
        turn = self.turning
        assert turn is not None
        incoming = self.pair.backends[turn.to]
        running = self._on(self.holder)
        turn.finished_first -= len(running)
        if self.model.past_bound == "end":
            turn.ended = len(running)
            for flight in running:
                self.flights.end(flight)
            running = []
        for flight in running:
            turn.continued += 1
            turn.continued_tokens += len(flight.job.prompt_ids) + flight.generated
            self.flights.continue_on(flight, incoming)
        now = self.sim.now
        cache = self.sim.hicache.get(self.holder)
        if cache is not None:  # idle and unpaused until its L3 writes drain, bounded
            until = min(cache.drained_at(now), now + self.model.drain_bound_s)
            if until > now:
                turn.drain_s = until - now
                self.sim.at(until, self._park)
                return
        self._park()

    def _park(self) -> None:
        turn = self.turning
        assert turn is not None
        turn.released_at = self.sim.now
        cache = self.sim.hicache.get(self.holder)
        dropped = cache.dropped_tokens if cache is not None else 0
        self.sim.park(self.holder, flush_cache=True)
        turn.dropped_tokens = cache.dropped_tokens - dropped if cache is not None else 0
        self.sim.at(self.sim.now + self.model.turn_cost_s(turn.to), self._settle)

    def _record_cost(self, turn: TurnRecord) -> None:
        """The turn's cost to the sessions at work, from the stores as they are now."""
        at_work = self._at_work()
        turn.sessions = len(at_work)
        turn.context_tokens = sum(tokens for _, tokens, _ in at_work.values())
        if turn.to in self.sim.hicache:
            cost = self.carried(turn.to)
            turn.prefill_tokens, turn.load_s = cost.prefill_tokens, cost.load_s
        else:
            turn.prefill_tokens = turn.context_tokens
        profile = self.sim.engines[turn.to].profile
        turn.prefill_s = profile.prefill_ms_per_1k * turn.prefill_tokens / 1e6

    def _settle(self) -> None:
        turn = self.turning
        assert turn is not None
        self.sim.unpark(turn.to)
        self.holder, self.since, self.across = turn.to, self.sim.now, None
        turn.settled_at = self.sim.now
        self.turning = None
        while self.waiting:
            w = self.waiting.popleft()
            self._admit(w.job, w.record, w.done)
        self.evaluate()


# --- one run ------------------------------------------------------------------------------------

@dataclass
class RunResult:
    records: list[RequestRecord]
    wall_s: float
    turns: list[TurnRecord]
    step_log: list[tuple[float, float, str]] | None = None
    arrivals: list[ArrivalRecord] = field(default_factory=list)  # open loop only
    request_log: list[RequestLog] | None = None  # log_requests: the simulator's own records


def run_virtual(workload: Workload, routing: Routing, profiles: Mapping[str, Profile], *,
                plan: LevelPlan | None = None, phases: Sequence[Phase] | None = None,
                arrivals: OpenLoop | None = None,
                turns: TurnModel | None = None, turns_routing: Routing | None = None,
                shared_device: bool = True, seed: int = 0, log_steps: bool = False,
                log_requests: bool = False,
                learned: CrossoverEstimator | None = None) -> RunResult:
    """One level (``plan``), one schedule (``phases``) or one open-loop run (``arrivals``) in a
    fresh simulator. Without ``turns`` the pool routes by ``routing`` as in
    :func:`gateway.bench.virtual.run_virtual_level` (moves at the flip included); with it the
    pair takes turns, deciding on ``turns_routing``."""
    if sum(x is not None for x in (plan, phases, arrivals)) != 1:
        raise ValueError("give a level plan, a schedule or open-loop arrivals")
    sim = VirtualSim(profiles, shared_device=shared_device, seed=seed, log_steps=log_steps,
                     log_requests=log_requests, hicache=turns.store_specs(profiles) if turns else None)
    if turns is not None:  # the pool's load signal and crossover are the turns' own
        routing = turns_routing or routing
    pool = virtual_pool(routing, profiles, learned)
    records: list[RequestRecord] = []
    flights = _TurnFlights(sim, lambda backend: backend.name)
    controller = None
    if turns is not None:
        controller = TurnsController(sim, pool, flights, routing, turns, holder=turns.first_holder)
    monitor = AcceptMonitor(sim, pool)
    # where the figures stop counting: a steady level's or a schedule's end (an open loop counts
    # everything, and a learner carried on learns from the drain too)
    counted_until = plan.duration_s if plan is not None else phase_windows(phases)[-1][1] if phases else None
    counted = UntilCounted(sim, None if learned is not None else counted_until)

    def send(job: Job, done: Callable[[Outcome], None], start: float | None = None) -> RequestRecord:
        record = RequestRecord(start=sim.now if start is None else start)
        if arrivals is not None:
            record.sent = sim.now
        records.append(record)
        done = counted.track(record, done)
        if controller is not None:
            controller.send(job, record, done)
            return record
        monitor()
        route(pool, flights, sim.now, job, record, done)
        return record

    open_clients = None
    if arrivals is not None:
        open_clients = _OpenClients(sim, workload, send, arrivals)
        open_clients.begin()
    else:
        _Clients(sim, workload, send, plan, phases).begin()
    counted.run()
    wall = max((r.end for r in records if r.end is not None), default=0.0)
    return RunResult(records, wall, controller.turns if controller else [], sim.step_log,
                     open_clients.records if open_clients else [],
                     sim.request_log if log_requests else None)


def tokens_within(records: Sequence[RequestRecord], t0: float, t1: float) -> float:
    """Output tokens that reached the clients inside [t0, t1]."""
    return sum(n for r in records if r.error is None
               for t, n in zip(r.chunk_times, r.chunk_tokens, strict=False) if t0 <= t <= t1)


# --- the crossover the turns decide on -------------------------------------------------------

CALIBRATION_LEVELS = (4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 56, 64, 80, 96, 128)
CALIBRATION_PLAN_S = (100.0, 30.0)  # steady: duration, warm-up


@dataclass(frozen=True)
class Calibration:
    """What the turns decide on, measured on the workload: the crossover, and how fast plain
    pulls ahead past it (``TurnRules.gain_per_crossover``, measured at about twice it)."""

    crossover: int
    gain_per_crossover: float = GAIN_PER_CROSSOVER


_calibrated: dict[tuple[object, ...], Calibration] = {}


def calibrate_crossover(workload_factory: Callable[[], Workload], profiles: Mapping[str, Profile],
                        routing: Routing, *, seed: int = 0, key: tuple[object, ...] | None = None,
                        levels: Sequence[int] = CALIBRATION_LEVELS) -> Calibration:
    """The load (in clients: requests in flight, or sessions at work for session traffic) from
    which the pair's plain server alone makes at least the aggregate tok/s of its MTP server
    alone, each owning the GPUs: what ``mtp-gateway calibrate`` measures on a user's own
    servers and traffic. Found by bisection over ``levels`` (one crossing assumed); the last
    level + 1 when MTP is never overtaken. Then plain's gain at the level of ``levels``
    nearest twice the crossover (:func:`gateway.turns.decision.measured_gain_per_crossover`).
    ``key`` memoises it for one process."""
    from gateway.bench.virtual import run_virtual_level

    if key is not None and key in _calibrated:
        return _calibrated[key]
    duration, warmup = CALIBRATION_PLAN_S

    @functools.cache
    def aggregates(c: int) -> tuple[float, float]:
        plan = LevelPlan(c, None, duration, warmup)
        aggregate = {}
        for policy in ("mtp-only", "plain-only"):
            records, wall = run_virtual_level(workload_factory(), plan,
                                              routing.model_copy(update={"policy": policy}),
                                              profiles, seed=seed)
            aggregate[policy] = summarise(policy, c, records, wall, plan.window).aggregate_tps
        return aggregate["plain-only"], aggregate["mtp-only"]

    def plain_wins(c: int) -> bool:
        plain, mtp = aggregates(c)
        return plain >= mtp

    low, high = 0, len(levels)  # answer: the first index where plain wins (high: none)
    while low < high:
        mid = (low + high) // 2
        if plain_wins(levels[mid]):
            high = mid
        else:
            low = mid + 1
    if low < len(levels):
        crossover = levels[low]
        past = min(levels[low:], key=lambda c: abs(c - 2 * crossover))
        calibration = Calibration(crossover, measured_gain_per_crossover(past, crossover, *aggregates(past)))
    else:
        calibration = Calibration(levels[-1] + 1)
    if key is not None:
        _calibrated[key] = calibration
    return calibration


def turns_routing(routing: Routing, crossover: int) -> Routing:
    """The routing the turns decide on: a fixed crossover in the load signal's unit (requests in
    flight, or sessions at work), not adapted to the accept length (an adaptive MTP server's
    average over its small batches says nothing of its speed at the crossover)."""
    return routing.model_copy(update={"crossover": crossover, "session_crossover": crossover,
                                      "adaptive_crossover": False, "adapt_to_accept_length": False,
                                      "hysteresis": min(routing.hysteresis, max(crossover - 1, 0))})
