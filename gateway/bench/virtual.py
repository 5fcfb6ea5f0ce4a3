"""The bench in the simulator's virtual time: no HTTP, deterministic, a C=128 sweep in seconds.

A *virtual gateway* routes every request with the real :class:`gateway.routing.pool.Pool` of one pair
(and so the real :func:`gateway.routing.policy.decide`), with ``now`` = virtual time, the effective caps
the probes would read from ``/server_info`` (the profiles' ``effective_max_running``), session affinity
remembered when a request ends (as the relay does), MTP's accept length as the monitor reads
it from ``/server_info`` (SGLang's cumulative ``avg_spec_accept_length``, refreshed every
``ACCEPT_REFRESH_S`` of virtual time, so an acceptance-aware policy sees what it would see
live), and submits to a
:class:`gateway.sim.virtual.VirtualSim` whose two backends share one device. The static
baselines go through the same router with ``policy: mtp-only`` / ``plain-only``.

Each level runs in a fresh simulator and router, so levels are independent and every figure is
reproducible bit for bit. A steady level stops once every request that started before its
duration has ended (:class:`UntilCounted`): what its sessions send later is counted nowhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from gateway.bench.flights import Flights, drive_script
from gateway.bench.levels import LevelPlan
from gateway.bench.stats import LevelResult, RequestRecord, summarise
from gateway.bench.workloads import Job, Outcome, Workload
from gateway.config import Backend, Routing
from gateway.routing.crossover import CrossoverEstimator
from gateway.routing.pool import Ask, Lease, PairSpec, Pool
from gateway.sim.profile import Profile
from gateway.sim.virtual import VirtualSim

POLICIES = ("crossover", "mtp-only", "plain-only")
# The monitor polls every monitor.interval_s (1 s) and reads /server_info every few rounds.
ACCEPT_REFRESH_S = 5.0
TARGET_NAMES = {"crossover": "gateway", "mtp-only": "mtp-only", "plain-only": "plain-only"}


def routing_for(policy: str, routing: Routing) -> Routing:
    return routing.model_copy(update={"policy": policy})


def _accepting(profile: Profile, p: float) -> Profile:
    if not profile.speculative:
        return profile
    return dataclasses.replace(profile, accept_prob=p, accept_prob_repetitive=p)


def virtual_pool(routing: Routing, profiles: Mapping[str, Profile],
                 learned: CrossoverEstimator | None = None) -> Pool:
    """One pair's pool, with the running caps the monitor would read from /server_info."""
    pool = Pool([PairSpec("default", Backend(url="http://sim/mtp"),
                          Backend(url="http://sim/plain"), routing)], now=0.0,
                max_sessions=routing.max_sessions)
    if learned is not None:
        pool.pairs["default"].estimator = learned
    for name, profile in profiles.items():
        if name in pool.backends:
            pool.backends[name].record_server_info(profile.effective_max_running, None)
    return pool


class AcceptMonitor:
    """MTP's accept length as the monitor reads it, every ACCEPT_REFRESH_S of virtual time."""

    def __init__(self, sim: VirtualSim, pool: Pool) -> None:
        self.sim, self.pool = sim, pool
        self.refreshed = -ACCEPT_REFRESH_S

    def __call__(self) -> None:
        if self.sim.now - self.refreshed < ACCEPT_REFRESH_S:
            return
        self.refreshed = self.sim.now
        for name, engine in self.sim.engines.items():
            if name in self.pool.backends and engine.profile.speculative:
                backend = self.pool.backends[name]
                backend.record_server_info(backend.effective_cap,
                                           engine.stats.avg_spec_accept_length or None)


class _AllCounted(Exception):
    """Raised by the event that ends a run once nothing it counts can change."""


class UntilCounted:
    """A run whose figures count only the requests that started before ``end`` (a steady
    level's duration, a schedule's last phase's end) and the tokens out before it stops once the
    last of those requests has ended: what its sessions send later (hours of virtual time for
    agent sessions with human gaps) changes none of them, and up to that moment the run is the
    same, event for event, as one left to drain. ``end=None``: a run that counts everything
    (makespan, open loop), or whose drain still matters (a learner carried to the next level),
    runs until idle."""

    def __init__(self, sim: VirtualSim, end: float | None) -> None:
        self.sim, self.end, self.open = sim, end, 0
        if end is not None:
            sim.at(end, self.stop_if_counted)

    def track(self, record: RequestRecord, done: Callable[[Outcome], None]) -> Callable[[Outcome], None]:
        """``done`` for a request just sent, counting it while it runs if it started before the end."""
        end = self.end
        if end is None or record.start >= end:
            return done
        self.open += 1

        def ended(outcome: Outcome) -> None:
            self.open -= 1
            done(outcome)
            if self.open == 0 and self.sim.now >= end:  # stop once this event is over
                self.sim.at(self.sim.now, self.stop_if_counted)

        return ended

    def stop_if_counted(self) -> None:
        if self.open == 0:
            raise _AllCounted

    def run(self) -> None:
        try:
            self.sim.run_until_idle()
        except _AllCounted:
            pass


def route(pool: Pool, flights: Flights, now: float, job: Job, record: RequestRecord,
          done: Callable[[Outcome], None]) -> None:
    """Admit a request through the pool and start it (moves at the flip included)."""
    admitted = pool.admit(Ask(session=job.session, prompt_tokens=len(job.prompt_ids)), now)
    if not isinstance(admitted, Lease):
        record.error, record.end = "no_backend", now
        done(Outcome(0, error="no_backend"))
        return
    flights.start(job, admitted, record, done)
    flights.apply_moves(admitted.flip)


def run_virtual_level(workload: Workload, plan: LevelPlan, routing: Routing,
                      profiles: Mapping[str, Profile], *, shared_device: bool = True,
                      seed: int = 0, accept_drop: tuple[float, float] | None = None,
                      learned: CrossoverEstimator | None = None,
                      ) -> tuple[list[RequestRecord], float]:
    """Run one level; returns every request's record and the level's wall time.

    ``accept_drop=(before, after)``: MTP accepts each draft with probability ``before`` (every
    prompt, the seed's repeated token too) until half the level (half its duration, or half
    its requests started), then ``after``: does the routing follow a change of acceptance?
    ``learned``: the router's crossover estimator, carried over from earlier levels (a live
    gateway has seen the load rise before it reaches this level).
    """
    if accept_drop is not None:
        profiles = {name: _accepting(profile, accept_drop[0]) for name, profile in profiles.items()}
    sim = VirtualSim(profiles, shared_device=shared_device, seed=seed)
    pool = virtual_pool(routing, profiles, learned)
    records: list[RequestRecord] = []
    counters = {"started": 0, "scripts": 0}
    monitor = AcceptMonitor(sim, pool)
    counted = UntilCounted(sim, plan.duration_s if learned is None else None)

    def next_script() -> None:
        if not plan.budget_left(counters["started"], sim.now):
            return
        script = workload.script(counters["scripts"])
        counters["scripts"] += 1
        drive_script(sim, script, start, next_script)

    def start(job: Job, done: Callable[[Outcome], None]) -> None:
        counters["started"] += 1
        maybe_drop_acceptance()
        send(job, done)

    def maybe_drop_acceptance() -> None:
        if accept_drop is None or counters.get("dropped"):
            return
        half = (sim.now >= plan.duration_s / 2 if plan.duration_s is not None
                else counters["started"] > (plan.requests or 0) / 2)
        if half:
            counters["dropped"] = 1
            for engine in sim.engines.values():
                engine.profile = _accepting(engine.profile, accept_drop[1])

    flights = Flights(sim, lambda backend: backend.name)

    def send(job: Job, done: Callable[[Outcome], None]) -> None:
        record = RequestRecord(start=sim.now)
        records.append(record)
        monitor()
        route(pool, flights, sim.now, job, record, counted.track(record, done))

    for _ in range(plan.concurrency):
        sim.at(0.0, next_script)
    counted.run()
    wall = max((r.end for r in records if r.end is not None), default=0.0)
    return records, wall


def run_virtual_sweep(workload_factory: Callable[[], Workload], plans: Sequence[LevelPlan],
                      routing: Routing, profiles: Mapping[str, Profile], *,
                      policies: Sequence[str] = POLICIES, shared_device: bool = True, seed: int = 0,
                      progress: Callable[[str, int], None] | None = None,
                      accept_drop: tuple[float, float] | None = None,
                      carry_learning: bool = False,
                      ) -> dict[str, list[LevelResult]]:
    """Every policy over every level; results by target name (gateway, mtp-only, plain-only).

    ``carry_learning``: the learned crossover's samples carry from level to level, in the
    order given (as a live gateway's would while the load rises); else each level starts cold.
    """
    results: dict[str, list[LevelResult]] = {TARGET_NAMES.get(p, p): [] for p in policies}
    estimators = {policy: CrossoverEstimator() for policy in policies}
    for plan in plans:
        for policy in policies:
            target = TARGET_NAMES.get(policy, policy)
            records, wall = run_virtual_level(workload_factory(), plan, routing_for(policy, routing),
                                              profiles, shared_device=shared_device, seed=seed,
                                              accept_drop=accept_drop,
                                              learned=estimators[policy] if carry_learning else None)
            results[target].append(summarise(target, plan.concurrency, records, wall, plan.window))
            if progress:
                progress(target, plan.concurrency)
    return results
