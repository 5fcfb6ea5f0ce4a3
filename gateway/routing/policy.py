"""The routing decision: a pure function of a state snapshot. No I/O, no clock, no globals.

`decide(snapshot, facts, routing, now)` returns which backend serves the next request, why,
and the routing mode after the decision. The caller (pool.Pool) owns the state and applies
the returned mode; tests drive this function with plain values.

The `crossover` policy keeps a mode in {mtp, plain}, following the load (`load_signal`: the
requests in flight, or the sessions at work against `session_crossover`,
`Snapshot.against_crossover`):
- mtp -> plain as soon as the load reaches `crossover` (throughput must not wait);
- plain -> mtp only when the load has fallen to `crossover - hysteresis` and the plain
  mode has lasted `min_dwell_s`, so a busy boundary does not flap;
- inside the band (crossover - hysteresis, crossover) a session stays where its prefix is
  cached (`session_affinity`); outside it the mode decides, as for any request;
- in mtp mode, a request goes to plain at low load too: while the load is below
  `plain_below` (the learned estimate finds plain faster there: MTP's drafts accepted too
  rarely to pay for its dearer step), and `LOW_LOAD_BAND` above it while plain is the only
  server busy, so a load at the boundary stays where it runs. No mode change: a burst from
  idle sends its first request or two to plain and the rest by the mode;
- the capacity guard sends a request to plain rather than queue it behind MTP's running cap;
- an unhealthy backend is skipped; with none healthy there is no backend (503).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from gateway.config import Role, Routing

T = TypeVar("T")
Reason = Literal[
    "below_crossover",
    "above_crossover",
    "hysteresis_hold",
    "plain_at_low_load",
    "mtp_at_capacity",
    "failover",
    "session_affinity",
    "pinned",
    "static_policy",
    "no_backend",
    # Set by the pool for a turns pair (gateway/turns), not by decide(): the server that
    # holds the memory serves; none does while a turn is under way (the request waits), nor
    # while the holder, up, has its circuit open (the request waits for the circuit).
    "memory_holder",
    "memory_turn",
    "holder_circuit",
]
REASONS: tuple[Reason, ...] = Reason.__args__  # type: ignore[attr-defined]
# Above where plain is faster alone, it keeps this many more requests while MTP is idle.
LOW_LOAD_BAND = 1


@dataclass(frozen=True, slots=True)
class BackendView:
    """What the router knows about one backend at decision time."""

    healthy: bool = True
    inflight: int = 0  # requests the gateway has in flight there (exact)
    effective_cap: int | None = None  # running-request cap from /server_info, if known
    reported_load: int | None = None  # running + waiting from /v1/loads, only when fresh
    not_started: int = 0  # of `inflight`, those with no first byte yet (queued or prefilling)


    @property
    def load(self) -> int:
        """The higher of our own count and the backend's (traffic that bypasses us)."""
        return max(self.inflight, self.reported_load or 0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    mode: Role
    mode_since: float
    backends: Mapping[Role, BackendView]
    accept_length: float | None = None  # MTP's speculative accept length, when known
    learned_crossover: int | None = None  # from the relayed streams (gateway.routing.crossover)
    plain_below: int = 0  # plain is faster below this concurrency too (gateway.routing.crossover)
    # The `sessions` load signal (gateway.routing.pool.SessionActivity): sessions with a request in
    # flight or idle at most routing.session_idle_s, and the requests in flight that have one.
    sessions_at_work: int | None = None
    session_requests: int = 0

    @property
    def concurrency(self) -> int:
        return sum(view.load for view in self.backends.values())

    def against_crossover(self, routing: Routing, crossover: int) -> tuple[float, float, float]:
        """The load the mode follows, the crossover and the hysteresis, in one unit: requests
        in flight, or (`load_signal: sessions`, while sessions are at work) sessions, against
        `session_crossover` and a band of `hysteresis` sessions, each request without a
        session counting as one. A burst of sub-agent requests is one session and a session
        between two turns still counts: the signal stays put while the requests in flight jump
        with each burst. Requests this gateway does not see (another replica's, in /v1/loads)
        have no session it can count: while there are any, the requests in flight decide."""
        bypassed = any(view.load > view.inflight for view in self.backends.values())
        if routing.load_signal != "sessions" or not self.sessions_at_work or bypassed:
            return self.concurrency, crossover, routing.hysteresis
        without = max(0, self.concurrency - self.session_requests)
        return self.sessions_at_work + without, routing.session_crossover, routing.hysteresis


@dataclass(frozen=True, slots=True)
class RequestFacts:
    session_backend: Role | None = None  # where this session's last turn ran
    pin: Role | None = None  # client pin, already checked against allow_pin_header
    prompt_tokens: int = 0  # estimated from the body's size (placement.prompt_tokens_from_bytes)


@dataclass(frozen=True, slots=True)
class Moves:
    """Requests to take off MTP now and finish on plain."""

    not_started: int = 0  # no byte sent to the client yet: cancelled and re-sent whole
    running: int = 0  # streaming: continued on plain from the text generated so far

    def __bool__(self) -> bool:
        return bool(self.not_started or self.running)


@dataclass(frozen=True, slots=True)
class Decision:
    backend: Role | None  # None: no healthy backend
    reason: Reason
    mode: Role
    mode_since: float



def effective_crossover(routing: Routing, accept_length: float | None,
                        learned: int | None = None) -> int:
    """The crossover in force: the one learned from the traffic when there is one, else the
    configured one scaled to the acceptance MTP gets now.

    MTP's saturated throughput is proportional to its accept length (tokens per step), while
    plain's does not depend on it; so the load where plain overtakes MTP moves with it, to first
    order proportionally. `crossover` was measured at `reference_accept_length` (the seed's
    repeated-token benchmark accepts every draft: 2.0 with one draft step; ordinary text less).
    """
    if learned is not None:
        low, high = routing.crossover_bounds
        return max(low, min(high, learned))
    if not routing.adapt_to_accept_length or not accept_length or accept_length < 1.0:
        return routing.crossover
    return max(1, round(routing.crossover * accept_length / routing.reference_accept_length))


Load = tuple[float, float, float]  # the level, the crossover and the band, in one unit


def load_against_crossover(snapshot: Snapshot, routing: Routing) -> Load:
    """What the mode and the choice compare, computed once per decision."""
    crossover = effective_crossover(routing, snapshot.accept_length, snapshot.learned_crossover)
    return snapshot.against_crossover(routing, crossover)


def next_mode(snapshot: Snapshot, routing: Routing, now: float, load: Load) -> tuple[Role, float]:
    """Apply the hysteresis rule to the current load."""
    level, top, band = load
    if snapshot.mode == "mtp" and level >= top:
        return "plain", now
    if snapshot.mode == "plain" and level <= top - band:
        if now - snapshot.mode_since >= routing.min_dwell_s:
            return "mtp", now
    return snapshot.mode, snapshot.mode_since


def _mode_choice(
    snapshot: Snapshot, facts: RequestFacts, routing: Routing, mode: Role, load: Load
) -> tuple[Role, Reason]:
    level, top, band = load
    in_band = top - band < level < top
    if in_band and routing.session_affinity and facts.session_backend is not None:
        return facts.session_backend, "session_affinity"
    if mode == "mtp":
        if _plain_at_low_load(snapshot, level):
            return "plain", "plain_at_low_load"
        return "mtp", "below_crossover"
    if level >= top:
        return "plain", "above_crossover"
    return "plain", "hysteresis_hold"


def _plain_at_low_load(snapshot: Snapshot, level: float) -> bool:
    below = snapshot.plain_below
    if not below:
        return False
    only_plain_busy = snapshot.backends["mtp"].load == 0 and snapshot.backends["plain"].load > 0
    return level < below or (level < below + LOW_LOAD_BAND and only_plain_busy)


def _over_capacity(view: BackendView) -> bool:
    return view.effective_cap is not None and view.load >= view.effective_cap


def decide(snapshot: Snapshot, facts: RequestFacts, routing: Routing, now: float) -> Decision:
    load = load_against_crossover(snapshot, routing)
    mode, since = next_mode(snapshot, routing, now, load)
    if routing.policy == "crossover":
        backend, reason = _mode_choice(snapshot, facts, routing, mode, load)
    else:
        backend, reason = ("mtp" if routing.policy == "mtp-only" else "plain"), "static_policy"
    if facts.pin is not None:
        backend, reason = facts.pin, "pinned"

    views = snapshot.backends
    guard_applies = routing.capacity_guard and reason not in ("pinned", "static_policy")
    if guard_applies and backend == "mtp" and _over_capacity(views["mtp"]):
        if views["plain"].healthy:
            backend, reason = "plain", "mtp_at_capacity"
    if not views[backend].healthy:
        healthy = [name for name, view in views.items() if view.healthy]
        if not healthy:
            return Decision(None, "no_backend", mode, since)
        backend, reason = healthy[0], "failover"
    return Decision(backend, reason, mode, since)


def plan_moves(snapshot: Snapshot, routing: Routing, *, flipped: bool) -> Moves:
    """What to move from MTP to plain when the mode has just `flipped` to plain.

    A burst from idle sends its first `crossover` requests to MTP before the load is known;
    left there, MTP runs its cap of them and queues the rest behind long generations while
    plain takes the new ones, and the two servers time-slice the GPU until MTP drains. So at
    the flip, MTP's requests that have not sent a byte to the client move (`move_unstarted`:
    cancel, re-send whole; only a prefill is lost), and with `handoff_running` its streams
    follow, continued on plain from the text generated so far (prefilled again there).
    """
    if not flipped or routing.policy != "crossover" or snapshot.mode != "plain":
        return Moves()
    mtp, plain = snapshot.backends["mtp"], snapshot.backends["plain"]
    if not plain.healthy:
        return Moves()
    not_started = min(mtp.not_started, mtp.inflight) if routing.move_unstarted else 0
    running = mtp.inflight - not_started if routing.handoff_running else 0
    return Moves(not_started, running)


def choose_moves(unstarted: Sequence[T], count: int) -> list[T]:
    """Of the movable requests that have not started, in arrival order, the `count` newest:
    they are surely queued behind MTP's running cap, while the oldest may be prefilling
    already. They are returned in arrival order, so the other server queues them in it."""
    if count <= 0:
        return []
    return list(unstarted[max(0, len(unstarted) - count):])
