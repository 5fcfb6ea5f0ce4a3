"""Requests in flight on the virtual simulator, each through a pool lease: the driver both
virtual-time benches share (`gateway.bench.virtual`, one pair; `gateway.bench.fleet`, pairs
and replicas).

A request runs on its lease's backend and ends its lease when it ends, as the relay does
(success when it ran to its length). At a pair's flip to plain, the requests the pool plans to
move leave that pair's MTP server: cancelled there and submitted again on plain (after the text
generated so far, for a running stream), under a new rid. Rids have a fixed width: an abort
matches rids by prefix, as SGLang's does, and "r1" would also abort "r10".
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from gateway.bench.stats import RequestRecord
from gateway.bench.workloads import WORD_ID_BASE, Job, Outcome, Script, Send, Think
from gateway.routing.backend import BackendState
from gateway.routing.policy import choose_moves
from gateway.routing.pool import Flip, Lease
from gateway.routing.pool import Outcome as LeaseOutcome
from gateway.sim.engine import Request
from gateway.sim.virtual import VirtualSim


@dataclass(eq=False)
class Flight:
    """One request of the workload, wherever it runs now (a move gives it a new rid)."""

    job: Job
    lease: Lease
    record: RequestRecord
    done: Callable[[Outcome], None]
    rid: str = ""

    @property
    def generated(self) -> int:
        """Tokens it received so far, wherever they ran (the record counts them)."""
        return self.record.tokens


def generated_ids(rid: str, job: Job, n: int) -> tuple[int, ...]:
    """Stand-in token ids for the text generated so far (a greedy repeated prompt repeats)."""
    if job.greedy and job.prompt_ids:
        return job.prompt_ids[-1:] * n
    rng = random.Random(rid)
    return tuple(WORD_ID_BASE + rng.randrange(512) for _ in range(n))


class Flights:
    def __init__(self, sim: VirtualSim, engine_of: Callable[[BackendState], str]) -> None:
        self.sim = sim
        self.engine_of = engine_of  # the simulated server a backend of the pool is
        self.live: dict[str, Flight] = {}  # by current rid, in submission order
        self._rids = itertools.count()

    def start(self, job: Job, lease: Lease, record: RequestRecord,
              done: Callable[[Outcome], None]) -> None:
        self._submit(Flight(job, lease, record, done), job.prompt_ids or (0,), job.max_tokens)

    def apply_moves(self, flip: Flip | None) -> None:
        """What an admission's flip of its pair moves: requests on the pair's MTP server move
        to its plain one (unstarted ones, as the relay picks them; running ones too with
        handoff_running, the oldest first)."""
        if flip is None:
            return
        by_lease: dict[object, Flight] = {f.lease: f for f in self.live.values()}
        unstarted = [by_lease[lease] for lease in flip.source.unstarted
                     if lease in by_lease and by_lease[lease].lease.movable]
        on_mtp = [f for f in self.live.values() if f.lease.backend is flip.source]
        running = [f for f in on_mtp if f.lease.started][:flip.moves.running]
        for flight in choose_moves(unstarted, flip.moves.not_started) + running:
            self._move(flight, flip.target)

    def _move(self, flight: Flight, to: BackendState) -> None:
        old_rid = flight.rid
        del self.live[old_rid]
        flight.rid = ""
        self.sim.abort(self.engine_of(flight.lease.backend), old_rid)
        flight.lease.move_to(to, self.sim.now)
        job = flight.job
        prompt = (job.prompt_ids or (0,)) + generated_ids(old_rid, job, flight.generated)
        self._submit(flight, prompt, job.max_tokens - flight.generated)

    def _submit(self, flight: Flight, prompt: Sequence[int], max_tokens: int) -> None:
        rid = flight.rid = f"r{next(self._rids):09d}"
        self.live[rid] = flight
        record, lease = flight.record, flight.lease
        record.backend = self.engine_of(lease.backend)

        def on_first(t: float) -> None:
            if record.first is None:
                record.first = t
            lease.first_byte(t)

        times, counts = record.chunk_times.append, record.chunk_tokens.append

        def on_chunk(t: float, n: int) -> None:  # every chunk of a virtual bench: kept lean
            record.tokens += n
            times(t)
            counts(n)

        def on_finish(t: float, reason: str) -> None:
            if flight.rid != rid:  # moved: this was the abort of its old copy
                return
            del self.live[rid]
            record.end = t
            if reason != "length":
                record.error = reason
            lease.output_tokens = flight.generated
            lease.output_chunks = len(record.chunk_tokens)
            lease.end(LeaseOutcome.SUCCESS if reason == "length" else LeaseOutcome.CLIENT_GONE, t)
            flight.done(Outcome(record.tokens, error=record.error))

        request = Request(rid, tuple(prompt), max_tokens, greedy=flight.job.greedy)
        self.sim.submit(record.backend, request, on_first_token=on_first, on_chunk=on_chunk,
                        on_finish=on_finish)


def drive_script(sim: VirtualSim, script: Script, send: Callable[[Job, Callable[[Outcome], None]], None],
                 finished: Callable[[], None], value: list[Outcome] | None = None) -> None:
    """Run one client's script in simulated time: think, send its jobs (together), resume it
    with their outcomes once all have ended, and call `finished` when the script is done."""
    try:
        action = script.send(value)
    except StopIteration:
        finished()
        return
    if isinstance(action, Think):
        sim.at(sim.now + action.seconds, lambda: drive_script(sim, script, send, finished))
        return
    assert isinstance(action, Send)
    outcomes: list[Outcome | None] = [None] * len(action.jobs)
    pending = [len(action.jobs)]

    def done(i: int, outcome: Outcome) -> None:
        outcomes[i] = outcome
        pending[0] -= 1
        if pending[0] == 0:
            drive_script(sim, script, send, finished, [o for o in outcomes if o is not None])

    for i, job in enumerate(action.jobs):
        send(job, partial(done, i))

