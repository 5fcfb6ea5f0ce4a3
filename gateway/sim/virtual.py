"""Virtual time: a discrete-event simulation of the backends, deterministic and instant.

A C=128 seed sweep takes seconds of CPU. A benchmark drives it with its own routing::

    sim = VirtualSim(load_profiles(), shared_device=True, seed=0)
    def arrive():
        backend = decide(...)                       # any routing decision, made at sim.now
        sim.submit(backend, Request(rid="r1", prompt=ids, output_len=1000),
                   on_first_token=lambda t: ...,    # t = virtual seconds
                   on_chunk=lambda t, n: ...,       # n new tokens (MTP: several per chunk)
                   on_finish=lambda t, reason: ...) # reason "length" or "abort"
    sim.at(0.0, arrive)                             # schedule any callable at a virtual time
    sim.run_until_idle()                            # or sim.run(until=60.0)

Callbacks run inside the simulation at ``sim.now`` and may submit, abort or schedule more.
``sim.engines[name]`` exposes ``num_running`` / ``num_waiting`` / ``stats`` per backend.
With ``shared_device`` the backends' steps serialize on one simulated GPU (FIFO, so two busy
backends alternate); without it each has its own device. ``devices`` (backend -> device name)
says it per backend: backends naming the same device share it (a fleet of pairs, each pair on
its own GPUs).

Taking turns owning the memory (the memory saver): ``sim.park(name)`` stops a backend from
starting steps (a step in progress ends; its queue stays and waits), optionally flushing its
prefix cache as a release does; ``sim.unpark(name)`` lets it step again. ``log_steps`` keeps
``(start, end, backend)`` of every step, so a test can see that a parked backend never ran.
``log_requests`` keeps every submitted request as the simulator saw it (:class:`RequestLog`:
when it came, its prompt length, the tokens its prefix cache gave it, what it generated), so a
test reads lengths and cache hits from the simulator itself.

HiCache (``hicache``: backend -> :class:`gateway.sim.hicache.StoreSpec`): each such backend gets
a host tier and its L3 namespace (backends naming one namespace share it; two page formats in
one raise :class:`gateway.sim.hicache.NamespaceConflict`). Every prompt its prefix cache inserts
is written through; a request whose stored prefix goes past the device's waits, queued, for its
load (from when its server steps: a parked server's tokenizer holds new requests), then
prefills the tail; a release (``park(flush_cache=True)``) drops the host tier and the writes
not yet in L3.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

from gateway.sim.engine import Engine, Output, Request, Step
from gateway.sim.hicache import WRITE_THROUGH_PREFILL_OVERHEAD, HiCache, Stores, StoreSpec
from gateway.sim.profile import Profile

# SGLang 0.5.23 aborts a stream as soon as the client's disconnect cancels it (the
# `except BaseException` cleanup of `generate_request`, tokenizer_manager.py:958); a
# non-streamed request is noticed when its wait for output times out
# (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s: tokenizer_manager.py:1960-1970, environ.py:1679).
# The 2 s `create_abort_task` (tokenizer_manager.py:2429) is only a fallback after both.
NON_STREAM_DISCONNECT_NOTICED_S = 4.0

FirstTokenCallback = Callable[[float], None]
ChunkCallback = Callable[[float, int], None]
FinishCallback = Callable[[float, str], None]


@dataclass(slots=True)
class _Callbacks:
    on_first_token: FirstTokenCallback | None
    on_chunk: ChunkCallback | None
    on_finish: FinishCallback | None


@dataclass(slots=True)
class RequestLog:
    """One submitted request as the simulator saw it (``VirtualSim(log_requests=True)``)."""

    at: float  # virtual time of the submit
    backend: str
    rid: str
    prompt_tokens: int
    max_tokens: int
    cached_tokens: int | None = None  # from its prefix cache at admission (None: never admitted)
    generated: int = 0  # tokens it emitted
    end: float | None = None
    finish_reason: str | None = None


class _Device:
    """One simulated GPU: runs one step at a time; engines wait their turn in FIFO order."""

    def __init__(self) -> None:
        self.busy = False
        self.queue: deque[str] = deque()


class VirtualSim:
    """Backends on a virtual clock. See the module docstring for the API."""

    def __init__(
        self, profiles: Mapping[str, Profile], shared_device: bool = True, seed: int = 0,
        devices: Mapping[str, str] | None = None, log_steps: bool = False,
        log_requests: bool = False, hicache: Mapping[str, StoreSpec] | None = None,
    ) -> None:
        self.now = 0.0
        self.parked: set[str] = set()
        self.step_log: list[tuple[float, float, str]] | None = [] if log_steps else None
        self._request_log: list[RequestLog] | None = [] if log_requests else None
        self.engines = {
            name: Engine(profile, random.Random(f"{seed}:{name}"))
            for name, profile in profiles.items()
        }
        if log_requests:
            for engine in self.engines.values():
                engine.cached_by_rid = {}
        if devices is None:
            devices = {name: "shared" if shared_device else name for name in self.engines}
        by_name = {device: _Device() for device in set(devices.values())}
        self._devices = {name: by_name[devices[name]] for name in self.engines}
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        # By backend, then rid: a step's outputs look theirs up in one backend's table.
        self._callbacks: dict[str, dict[str, _Callbacks]] = {name: {} for name in self.engines}
        self._active: set[str] = set()  # stepping, or waiting for the device
        self.stores = Stores()
        self.hicache: dict[str, HiCache] = {}
        for name, spec in (hicache or {}).items():
            self._attach(name, spec)
        # requests that reached a parked backend: their store lookup waits for its unpark
        self._lookup_later: dict[str, list[Request]] = {name: [] for name in self.engines}

    def _attach(self, name: str, spec: StoreSpec) -> None:
        engine = self.engines[name]
        cache = self.hicache[name] = HiCache(spec, self.stores.open(spec), engine.block_keys)
        engine.on_insert = lambda prompt, reused: cache.written(prompt, self.now, reused)
        engine.prefill_overhead = WRITE_THROUGH_PREFILL_OVERHEAD

    # --- scheduling ----------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``t`` (not before now; same-time events keep their order)."""
        heapq.heappush(self._events, (max(t, self.now), next(self._order), fn))

    def run(self, until: float | None = None) -> None:
        """Process events up to ``until`` (or until none are left); ``now`` ends at ``until``."""
        while self._events and (until is None or self._events[0][0] <= until):
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()
        if until is not None:
            self.now = max(self.now, until)

    def run_until_idle(self) -> None:
        self.run()

    # --- requests ------------------------------------------------------------------------

    def submit(
        self,
        backend: str,
        request: Request,
        on_first_token: FirstTokenCallback | None = None,
        on_chunk: ChunkCallback | None = None,
        on_finish: FinishCallback | None = None,
    ) -> None:
        """Send a request to ``backend`` now. Raises QueueFullError like the HTTP 503."""
        self.engines[backend].submit(request)
        if self._request_log is not None:
            on_chunk, on_finish = self._logged(backend, request, on_chunk, on_finish)
        self._callbacks[backend][request.rid] = _Callbacks(on_first_token, on_chunk, on_finish)
        if backend in self.hicache:
            if backend in self.parked:
                self._lookup_later[backend].append(request)
            else:
                self._look_up(backend, request)
        # Deferred, so requests submitted at the same instant join one prefill batch.
        self.at(self.now, lambda: self._kick(backend))

    def _look_up(self, backend: str, request: Request) -> None:
        """Its stored prefix, if it adds enough to the device's: it waits for the load."""
        engine = self.engines[backend]
        if request.rid not in engine:
            return
        load = self.hicache[backend].lookup(request.prompt, engine.device_match(request.prompt), self.now)
        if load is None:
            return
        engine.hold(request.rid)

        def loaded() -> None:
            engine.loaded(request.rid, load.tokens)
            self._kick(backend)

        self.at(load.ready_at, loaded)

    def _logged(self, backend: str, request: Request, on_chunk: ChunkCallback | None,
                on_finish: FinishCallback | None) -> tuple[ChunkCallback, FinishCallback]:
        assert self._request_log is not None
        entry = RequestLog(self.now, backend, request.rid, len(request.prompt), request.output_len)
        self._request_log.append(entry)

        def chunk(t: float, n: int) -> None:
            entry.generated += n
            if on_chunk is not None:
                on_chunk(t, n)

        def finish(t: float, reason: str) -> None:
            entry.end, entry.finish_reason = t, reason
            if on_finish is not None:
                on_finish(t, reason)

        return chunk, finish

    @property
    def request_log(self) -> list[RequestLog]:
        """Every submitted request in submit order (``log_requests``), cache hits filled in."""
        if self._request_log is None:
            raise RuntimeError("VirtualSim(log_requests=True) keeps the request log")
        for entry in self._request_log:
            cached = self.engines[entry.backend].cached_by_rid
            if entry.cached_tokens is None and cached is not None and entry.rid in cached:
                entry.cached_tokens = cached[entry.rid]
        return list(self._request_log)

    def abort(self, backend: str, rid: str) -> None:
        """``/abort_request``: the slot is free at once; on_finish gets "abort"."""
        for aborted in self.engines[backend].abort(rid):
            self._deliver(backend, Output(aborted, 0, finish_reason="abort"))

    def disconnect(self, backend: str, rid: str, *, streaming: bool = True) -> None:
        """Client went away: SGLang aborts a stream at once and a non-streamed request when it
        next wakes (at most 4 s); either way the slot frees one step after the abort."""
        delay = 0.0 if streaming else NON_STREAM_DISCONNECT_NOTICED_S
        self.at(self.now + delay, lambda: self._abort_late(backend, rid))

    def _abort_late(self, backend: str, rid: str) -> None:
        if self.engines[backend].abort_after_next_step(rid):
            self._deliver(backend, Output(rid, 0, finish_reason="abort"))

    # --- taking turns ----------------------------------------------------------------------

    def park(self, backend: str, *, flush_cache: bool = False) -> None:
        """No new step starts on ``backend`` (paused and released); ``flush_cache``: its prefix
        cache is gone, as after /release_memory_occupation."""
        self.parked.add(backend)
        if flush_cache:
            self.engines[backend].flush_prefix_cache()
            if backend in self.hicache:
                self.hicache[backend].release(self.now)

    def unpark(self, backend: str) -> None:
        """Resumed: it steps again from now on."""
        self.parked.discard(backend)
        waiting, self._lookup_later[backend] = self._lookup_later[backend], []
        for request in waiting:
            self._look_up(backend, request)
        self.at(self.now, lambda: self._kick(backend))

    # --- the device loop -----------------------------------------------------------------

    def _kick(self, backend: str) -> None:
        if backend in self.parked or backend in self._active or not self.engines[backend].has_work:
            return
        self._active.add(backend)
        device = self._devices[backend]
        if device.busy:
            device.queue.append(backend)
        else:
            self._start(backend)

    def _start(self, backend: str) -> None:
        device = self._devices[backend]
        step = self.engines[backend].begin_step()
        if step is None:
            self._active.discard(backend)
            self._next_on(device)
            return
        device.busy = True
        if self.step_log is not None:
            self.step_log.append((self.now, self.now + step.duration_s, backend))
        self.at(self.now + step.duration_s, lambda: self._finish(backend, step))

    def _finish(self, backend: str, step: Step) -> None:
        device = self._devices[backend]
        device.busy = False
        self._active.discard(backend)
        self._deliver_all(self._callbacks[backend], self.engines[backend].finish_step(step))
        self._next_on(device)  # the other backend, if it waited, goes first
        self._kick(backend)

    def _next_on(self, device: _Device) -> None:
        if device.queue and not device.busy:
            self._start(device.queue.popleft())

    def _deliver(self, backend: str, output: Output) -> None:
        self._deliver_all(self._callbacks[backend], (output,))

    def _deliver_all(self, table: dict[str, _Callbacks], outputs: Iterable[Output]) -> None:
        # One loop per step, not a call per output: this runs for every request every step.
        now = self.now
        for rid, tokens, first, finish_reason in outputs:
            callbacks = table.get(rid)
            if callbacks is None:  # ended already (an abort a callback sent during this step)
                continue
            if tokens:
                if first and callbacks.on_first_token:
                    callbacks.on_first_token(now)
                if callbacks.on_chunk:
                    callbacks.on_chunk(now, tokens)
            if finish_reason is not None:
                del table[rid]
                if callbacks.on_finish:
                    callbacks.on_finish(now, finish_reason)


# --- the seed benchmark ---------------------------------------------------------------------

SEED_TOKEN_ID = 23066
SEED_PROMPT_LEN = 1000
SEED_OUTPUT_LEN = 1000


@dataclass(frozen=True)
class SeedResult:
    """One backend's figures, measured the way the seed's benchmark measured them."""

    backend: str
    concurrency: int
    requests: int
    per_request_tps: float  # mean of output / (e2e - ttft): decode speed while running
    aggregate_tps: float  # total output tokens / makespan
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_max_s: float
    makespan_s: float
    max_running: int
    accept_length: float


@dataclass
class _Timing:
    start: float
    first: float = 0.0
    end: float = 0.0


def run_seed_benchmark(
    profiles: Mapping[str, Profile],
    concurrency: Mapping[str, int],
    *,
    rounds: int = 3,
    shared_device: bool = True,
    seed: int = 0,
    prompt_len: int = SEED_PROMPT_LEN,
    output_len: int = SEED_OUTPUT_LEN,
) -> dict[str, SeedResult]:
    """The seed workload (one repeated token id, ignore_eos, temperature 0) in virtual time.

    ``concurrency`` maps backend -> closed-loop clients, e.g. ``{"plain": 128}`` or
    ``{"mtp": 24, "plain": 40}`` (both at once, on one device when ``shared_device``). All
    clients start together at t=0; each sends ``rounds`` requests back to back.
    """
    sim = VirtualSim(profiles, shared_device=shared_device, seed=seed)
    prompt = (SEED_TOKEN_ID,) * prompt_len
    timings: dict[str, list[_Timing]] = {name: [] for name in concurrency}
    ids = itertools.count()

    def send(backend: str, rounds_left: int) -> None:
        timing = _Timing(start=sim.now)
        timings[backend].append(timing)

        def on_first(t: float) -> None:
            timing.first = t

        def on_finish(t: float, reason: str) -> None:
            timing.end = t
            if rounds_left > 1:
                send(backend, rounds_left - 1)

        request = Request(f"seed-{next(ids)}", prompt, output_len, greedy=True)
        sim.submit(backend, request, on_first_token=on_first, on_finish=on_finish)

    for backend, clients in concurrency.items():
        for _ in range(clients):
            sim.at(0.0, partial(send, backend, rounds))
    sim.run_until_idle()
    return {
        backend: _summarise(backend, concurrency[backend], timings[backend], sim, output_len)
        for backend in concurrency
    }


def _summarise(
    backend: str, clients: int, timings: list[_Timing], sim: VirtualSim, output_len: int
) -> SeedResult:
    ttfts = [t.first - t.start for t in timings]
    makespan = max(t.end for t in timings)
    engine = sim.engines[backend]
    return SeedResult(
        backend=backend,
        concurrency=clients,
        requests=len(timings),
        per_request_tps=statistics.fmean(output_len / (t.end - t.first) for t in timings),
        aggregate_tps=output_len * len(timings) / makespan,
        ttft_mean_s=statistics.fmean(ttfts),
        ttft_p50_s=statistics.median(ttfts),
        ttft_max_s=max(ttfts),
        makespan_s=makespan,
        max_running=engine.stats.peak_running,
        accept_length=engine.stats.avg_spec_accept_length,
    )
