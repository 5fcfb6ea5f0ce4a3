"""One backend's state, in one place, with one writer per part.

A `BackendState` is everything the gateway knows about one SGLang server: the requests this
gateway has in flight there, what its probes found (health, capacity, accept length, reported
load), and its circuit. Every field is written by a method of this class and by nothing else:

    in flight, served, not started,  the lease (gateway.routing.pool.Lease), at admission and at its end
    running streams over time
    up, probe streaks                the monitor's probe results (probe_ok / probe_failed)
    capacity, accept length          the monitor's /server_info reading (record_server_info)
    reported load                    the monitor's /v1/loads reading (record_loads)
    endpoints it lacks               the monitor (record_missing)
    circuit                          the lease's verdict at its end (circuit_success / _failure)
    slow start                       the lease: at admission, and its verdict at its end
    parked                           a turns pair's driver (gateway/turns): not holding the
                                     memory, paused; the monitor leaves it alone

Time is passed in (`now`, monotonic seconds), never read here: the circuit's open period ends
when a decision looks at it after `open_until`, not by a timer, so virtual time drives it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.config import Backend, EngineName, Role


@dataclass(frozen=True, slots=True)
class CircuitRules:
    failures_to_open: int = 5
    open_s: float = 10.0


@dataclass(frozen=True, slots=True)
class ProbeRules:
    fall: int = 3  # failed probes in a row that mark a backend down
    rise: int = 2  # good probes in a row that mark it up again


@dataclass(slots=True)
class Circuit:
    """Failures of real requests in a row open it for `open_s`; then exactly one trial request
    may go (half-open): its success closes the circuit, its failure opens it again."""

    failures: int = 0
    open_until: float | None = None  # set while open or half-open; None when closed
    trial_in_flight: bool = False

    def is_open(self, now: float) -> bool:
        return self.open_until is not None and now < self.open_until

    def is_half_open(self, now: float) -> bool:
        return self.open_until is not None and now >= self.open_until

    def opens_in(self, now: float) -> float | None:
        """Seconds until the open circuit lets its trial through; None when it is not open
        (closed, or half-open: then its trial's end is what changes it)."""
        return self.open_until - now if self.open_until is not None and now < self.open_until else None


# A slow start whose window reached this many requests in flight is over: its server admits freely.
SLOW_START_FULL = 64


@dataclass(eq=False, slots=True)
class SlowStart:
    """A turns pair's holder just after its circuit closed: the pair has no other server, so the
    requests that waited for the circuit would all go to it at once, into a fault that may
    still hold (one that breaks streams only lets other requests succeed and close the
    circuit). Instead at most `window` requests admitted since the close are in flight: 1 at
    first, doubled by each success of one of them, back to 1 by a failure (five open the
    circuit again), over at SLOW_START_FULL."""

    window: int = 1
    inflight: int = 0

    def admits(self) -> bool:
        return self.inflight < self.window

    def after(self, went_well: bool | None) -> int:
        """The window after one of its requests ended: well, badly (a failure blamed on the
        server), or neither (its client left, it moved)."""
        if went_well is None:
            return self.window
        return self.window * 2 if went_well else 1


@dataclass(slots=True)
class LoadReading:
    """The backend's own count from /v1/loads: every replica's traffic, and any bypassing us."""

    running: int
    waiting: int
    at: float  # monotonic time the reading arrived
    own_inflight_then: int  # this gateway's in-flight count there at that moment


@dataclass(eq=False)
class BackendState:
    """See the module docstring. `name` is unique in the pool ("mtp", or "pair-b/plain")."""

    name: str
    pair: str
    role: Role
    target: Backend  # url and keys
    engine: EngineName = "sglang"  # what the server is (its pair's: Settings.engine_of)
    circuit_rules: CircuitRules = field(default_factory=CircuitRules)
    probe_rules: ProbeRules = field(default_factory=ProbeRules)
    # --- written by the lease
    inflight: int = 0
    served: int = 0  # finished requests
    # Of the in-flight, those whose first byte has not come (the pool's leases), in arrival
    # order: the one record of which requests have not started (a flip's moves pick from it).
    unstarted: dict[object, None] = field(default_factory=dict)
    # Integral over time of the streams it was running (in flight, at most its cap), up to
    # `area_at`: a stream's mean load is the difference over its life (gateway.routing.crossover).
    running_area: float = 0.0
    area_at: float | None = None
    # --- written by the monitor
    up: bool = True
    good_probes: int = 0
    bad_probes: int = 0
    effective_cap: int | None = None
    accept_length: float | None = None
    usage_by_default: bool = False  # its streams end with a usage chunk the client did not ask for
    loads: LoadReading | None = None
    missing_endpoints: frozenset[str] = frozenset()  # SGLang's own, answered 404/405
    # --- written by the lease's verdict
    circuit: Circuit = field(default_factory=Circuit)
    slow_start: SlowStart | None = None  # a turns pair's holder, after its circuit closed
    # --- written by a turns pair's driver
    parked: bool = False

    # --- reading -----------------------------------------------------------------------------

    def accepting(self, now: float) -> bool:
        """May take a new request: up, its circuit closed or half-open with no trial out, and
        its slow start, if any, with room."""
        circuit, slow_start = self.circuit, self.slow_start
        return (self.up and not circuit.is_open(now) and not circuit.trial_in_flight
                and (slow_start is None or slow_start.admits()))

    def reported_load(self, now: float, max_age_s: float) -> int | None:
        """Running + waiting as the backend last said, moved by this gateway's own requests
        started and ended since (exact for ours, `age` old for everyone else's); None when the
        reading is older than `max_age_s` (fail open: then only our own count is used)."""
        reading = self.loads
        if reading is None or now - reading.at > max_age_s:
            return None
        return max(0, reading.running + reading.waiting + self.inflight - reading.own_inflight_then)

    def area(self, now: float) -> float:
        """The running-stream area up to `now`."""
        self._advance(now)
        return self.running_area

    # --- the lease ---------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Bring the running area up to now (before any in-flight count changes)."""
        if self.area_at is not None and now > self.area_at:
            cap = self.effective_cap
            running = self.inflight if cap is None else min(self.inflight, cap)
            self.running_area += (now - self.area_at) * running
        if self.area_at is None or now > self.area_at:
            self.area_at = now

    @property
    def not_started(self) -> int:
        return len(self.unstarted)

    def admit(self, now: float, request: object, *, started: bool = False) -> bool:
        """Count one request in (`started`: a stream moved here with its first byte sent);
        True when it is the half-open circuit's one trial. With a slow start under way, the
        request is one of it (its lease holds `slow_start`, and ends its part)."""
        self._advance(now)
        self.inflight += 1
        if self.slow_start is not None:
            self.slow_start.inflight += 1
        if not started:
            self.unstarted[request] = None
        if self.circuit.is_half_open(now) and not self.circuit.trial_in_flight:
            self.circuit.trial_in_flight = True
            return True
        return False

    def first_byte(self, request: object) -> None:
        self.unstarted.pop(request, None)

    def leave(self, now: float, request: object, *, finished: bool) -> None:
        """Count one request out (it ended, or moved elsewhere)."""
        self._advance(now)
        self.inflight -= 1
        self.unstarted.pop(request, None)
        if finished:
            self.served += 1

    def end_trial(self) -> None:
        """The trial request ended. Its verdict, if any, comes next; without one (the client
        left first) the next request may be the trial."""
        self.circuit.trial_in_flight = False

    def slow_start_end(self, slow_start: SlowStart, went_well: bool | None) -> bool:
        """One request of `slow_start` ended (see SlowStart.after); True when that is this
        server's slow start still (its place is free: a waiting request may go)."""
        slow_start.inflight -= 1
        if slow_start is not self.slow_start:
            return False  # over, or the circuit opened again meanwhile
        slow_start.window = slow_start.after(went_well)
        if slow_start.window >= SLOW_START_FULL:
            self.slow_start = None
        return True

    def circuit_success(self, *, slow_start: bool = False) -> bool:
        """A success closes the circuit; True when it was open or half-open. Then, with
        `slow_start` (a turns pair's holder), its admissions start slow (SlowStart)."""
        was_open = self.circuit.open_until is not None
        self.circuit = Circuit()
        if was_open and slow_start:
            self.slow_start = SlowStart()
        return was_open

    def circuit_failure(self, now: float) -> bool:
        """Count a failure; True when this one opened the circuit."""
        circuit = self.circuit
        circuit.failures += 1
        reopen = circuit.is_half_open(now)
        if reopen or (circuit.failures >= self.circuit_rules.failures_to_open
                      and circuit.open_until is None):
            circuit.open_until = now + self.circuit_rules.open_s
            circuit.trial_in_flight = False
            self.slow_start = None  # its trial comes first again
            return True
        return False

    # --- a turns pair's driver ---------------------------------------------------------------

    def set_parked(self, parked: bool) -> None:
        """Parked: paused without the memory (its probes say nothing of its health). Unparked
        after the driver saw it ready: its probes count again, from a clean streak."""
        if self.parked and not parked:
            self.up, self.good_probes, self.bad_probes = True, 0, 0
        if parked:
            self.slow_start = None
        self.parked = parked

    # --- the monitor -------------------------------------------------------------------------

    def probe_ok(self) -> bool:
        """A good probe; True when it brought the backend back up."""
        self.good_probes, self.bad_probes = self.good_probes + 1, 0
        if not self.up and self.good_probes >= self.probe_rules.rise:
            self.up = True
            return True
        return False

    def probe_failed(self) -> bool:
        """A failed probe; True when it took the backend down."""
        self.good_probes, self.bad_probes = 0, self.bad_probes + 1
        if self.up and self.bad_probes >= self.probe_rules.fall:
            self.up = False
            return True
        return False

    def record_loads(self, running: int, waiting: int, now: float) -> None:
        self.loads = LoadReading(running, waiting, now, self.inflight)

    def record_server_info(self, effective_cap: int | None, accept_length: float | None) -> None:
        self.effective_cap, self.accept_length = effective_cap, accept_length

    def record_missing(self, missing: frozenset[str]) -> bool:
        """The optional endpoints it lacks now; True when that changed."""
        changed = missing != self.missing_endpoints
        self.missing_endpoints = missing
        return changed
