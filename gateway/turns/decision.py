"""When a pair whose two servers take turns owning the GPUs' memory hands it over.

A pure function of the pair's state: no clock (``now`` is passed in), no I/O. The caller (the
turns controller live, ``gateway.bench.turns_virtual`` in virtual time) owns the state, asks
between turns only (never while one is in progress), and keeps ``TurnDecision.across`` for
the next call.

    decision = decide_turn(Holding(holder="mtp", since=t0, across=None),
                           LoadSignal(level, crossover, band),   # routing.policy.load_against_crossover
                           TurnRules(turn_cost_s=1.5), now,
                           cached_tokens=..., continued_tokens=...)
    if decision.turn: ...start a turn to decision.to...

The rule:
- the load wants plain at or above the crossover, MTP at or below ``crossover - band``, and
  inside the band the holder keeps the memory (hysteresis);
- the load must have stood on the other side for ``to_plain_after_s`` / ``to_mtp_after_s``
  (a burst of sub-agent requests is not a change of load);
- **the turn must repay the caches it throws away** (:meth:`TurnRules.price`): while the
  load stands on the other side the holder forgoes what the other server would add, a
  fraction :meth:`TurnRules.gain` of the machine's output a second (``gain_per_crossover``
  for each crossover's worth of distance from the crossover), and the pair turns once it has
  forgone ``payback_turns`` times what the sessions at work would pay for their contexts on
  the incoming server (prefilled again, or loaded from a store). A deterministic ski rental:
  rent (keep the holder) until the rent paid equals the price of buying (the turn), which
  never pays more than twice the best choice made in hindsight, whether the load then stays
  or goes back. Short prompts and new sessions have no warm context to lose, so their turn
  comes as soon as the load crosses; tens of agent sessions' contexts (a minute of prefill)
  only if the load stays across long enough to repay them. The turn's own seconds and the
  streams it continues are not in the price: every turn pays them, and the dwell below
  already keeps them to a tenth of the time;
- the holder keeps the memory at least its *dwell*: ``min_dwell_s``, and at least
  ``dwell_turns`` times what a turn costs, so turns never take more than about
  ``1 / dwell_turns`` of the time however the load swings.

A turn costs its own pause, release, resume and continue (``turn_cost_s``), the re-prefill of
the streams continued on the incoming server (``continued_tokens``), and what the sessions at
work pay on the incoming server for their contexts (``cached_tokens`` at
``prefill_tokens_per_s``, and ``load_s``). Without a store the release flushes the outgoing
server's prefix cache and the incoming server prefills every context (``cached_tokens``: all
of it). With each server keeping its own L3 store (SGLang's HiCache, gateway/sim/hicache.py)
the incoming server prefills only what its store lacks and loads the rest:
:func:`carried_cost` gives both. A server holding a large warm cache (agentic sessions)
therefore holds longer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from gateway.config import Role

TurnReason = Literal[
    "holder_fits",  # the load is on the holder's side (or inside the band)
    "confirming",  # on the other side, not yet for long enough
    "paying_back",  # on the other side, not yet long enough to repay what the turn costs
    "dwell",  # the holder has not held the memory long enough for another turn to pay
    "load_above_crossover",  # hand over to plain
    "load_below_crossover",  # hand over to MTP
]
NEVER = -math.inf  # `since` of a pair that has never turned: the first turn needs no dwell
# What the other server adds across the crossover, a fraction of the machine's output for each
# crossover's worth of distance, until calibrate measures it: the seed's tradeoff (MTP 32 %
# behind plain at 64 requests, about twice its crossover) puts plain 1 / 0.68 - 1 = 0.47 ahead.
GAIN_PER_CROSSOVER = 0.5


@dataclass(frozen=True, slots=True)
class TurnRules:
    turn_cost_s: float = 1.5  # pause + release + resume + continue, host copy retained (H200)
    dwell_turns: float = 10.0  # hold >= this many turns' cost: turns take <= ~1/10 of the time
    min_dwell_s: float = 5.0
    to_plain_after_s: float = 0.0  # throughput must not wait for a saturated MTP server
    to_mtp_after_s: float = 5.0
    prefill_tokens_per_s: float = 16_000.0  # what a thrown-away or re-sent token costs
    gain_per_crossover: float = GAIN_PER_CROSSOVER
    payback_turns: float = 1.0  # forgo this many times the caches a turn loses (0: turn at once)

    def __post_init__(self) -> None:
        values = (self.turn_cost_s, self.dwell_turns, self.min_dwell_s, self.to_plain_after_s,
                  self.to_mtp_after_s, self.payback_turns)
        if any(v < 0 for v in values) or self.prefill_tokens_per_s <= 0 or self.gain_per_crossover <= 0:
            raise ValueError("turn rules take non-negative times and a positive prefill rate and gain")

    def turn_cost(self, cached_tokens: int = 0, continued_tokens: int = 0, load_s: float = 0.0) -> float:
        """Seconds a turn costs the pair now: the turn itself, the tokens it makes the
        incoming server compute again, and the seconds it loads stored contexts."""
        return self.turn_cost_s + (cached_tokens + continued_tokens) / self.prefill_tokens_per_s + load_s

    def price(self, cached_tokens: int = 0, load_s: float = 0.0) -> float:
        """Seconds of the machine's output the holder must have forgone before a turn: what
        the sessions at work pay for their contexts on the incoming server, payback_turns
        times."""
        return self.payback_turns * (cached_tokens / self.prefill_tokens_per_s + load_s)

    def gain(self, to: Role, load: LoadSignal) -> float:
        """The fraction of the machine's output that ``to`` would add over the holder at this
        load (the load stands on ``to``'s side): ``gain_per_crossover`` for each crossover's
        worth of distance past it (:func:`distance_past`); at most 1 (the other server twice
        as fast)."""
        return min(1.0, self.gain_per_crossover * distance_past(to, load.level, load.crossover))

    def dwell(self, cached_tokens: int = 0, continued_tokens: int = 0, load_s: float = 0.0) -> float:
        cost = self.turn_cost(cached_tokens, continued_tokens, load_s)
        return max(self.min_dwell_s, self.dwell_turns * cost)


def distance_past(to: Role, level: float, crossover: float) -> float:
    """How far past the crossover a load stands on ``to``'s side, in crossovers; a level at
    the crossover counts as one request past (plain takes the crossover itself)."""
    past = level - crossover + 1 if to == "plain" else crossover - level
    return max(past, 1.0) / max(crossover, 1.0)


def measured_gain_per_crossover(level: int, crossover: int, plain_tps: float, mtp_tps: float) -> float:
    """``gain_per_crossover`` from one measured level past the crossover: plain's aggregate
    over MTP's there, less one, per crossover's worth of distance (what ``calibrate``
    writes). At least a tenth of the default, so a turn can always pay back."""
    gain = plain_tps / mtp_tps - 1 if mtp_tps > 0 else 1.0
    return max(GAIN_PER_CROSSOVER / 10, gain / distance_past("plain", level, crossover))


@dataclass(frozen=True, slots=True)
class CarriedCost:
    """What the sessions at work pay for their contexts on the incoming server."""

    prefill_tokens: int  # not in its store: prefilled again
    load_s: float  # in its store: loaded instead


def carried_cost(contexts: Mapping[str, int], stored: Mapping[str, int],
                 load_s: Callable[[int], float]) -> CarriedCost:
    """``contexts``: each session at work's context (its last prompt, tokens); ``stored``: what
    of it the incoming server's store holds (a session missing: nothing); ``load_s``: seconds to
    load that many stored tokens. Loads queue on the server's IO thread, so they add up."""
    prefill, seconds = 0, 0.0
    for session, context in contexts.items():
        have = min(stored.get(session, 0), context)
        prefill += context - have
        seconds += load_s(have) if have else 0.0
    return CarriedCost(prefill, seconds)


@dataclass(frozen=True, slots=True)
class Across:
    """The load has stood on the other server's side since ``since``; by ``at`` the holder had
    forgone ``forgone_s`` seconds of the machine's output, and it forgoes ``gain`` of it a
    second since (the gain at the load as of ``at``)."""

    since: float
    at: float
    forgone_s: float = 0.0
    gain: float = 0.0

    def forgone(self, now: float) -> float:
        return self.forgone_s + self.gain * max(0.0, now - self.at)

    def repaid_at(self, cost_s: float) -> float:
        """When the holder will have forgone ``cost_s`` if the load stays where it is."""
        owed = cost_s - self.forgone_s
        return self.at if owed <= 0 else self.at + owed / self.gain if self.gain > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Holding:
    """Who holds the memory, since when (NEVER: since the start), and how long and how much the
    load has stood on the other server's side (None: it does not)."""

    holder: Role
    since: float = NEVER
    across: Across | None = None


@dataclass(frozen=True, slots=True)
class LoadSignal:
    """The load the mode follows and its crossover and hysteresis band, in one unit (requests
    in flight, or sessions at work): ``gateway.routing.policy.load_against_crossover``."""

    level: float
    crossover: float
    band: float = 0.0


@dataclass(frozen=True, slots=True)
class TurnDecision:
    turn: bool
    to: Role | None  # the incoming server when turn
    reason: TurnReason
    across: Across | None  # keep it in Holding for the next call


def wanted(holder: Role, load: LoadSignal) -> Role:
    """The server the load wants, with the band holding the current holder."""
    if load.level >= load.crossover:
        return "plain"
    if load.level <= load.crossover - load.band:
        return "mtp"
    return holder


def decide_turn(memory: Holding, load: LoadSignal, rules: TurnRules, now: float, *,
                cached_tokens: int = 0, continued_tokens: int = 0, load_s: float = 0.0) -> TurnDecision:
    """Whether to hand the memory over now, and to whom (see the module docstring).
    ``cached_tokens``: the sessions' contexts the incoming server must prefill again, which
    the traffic would have reused (without a store: the outgoing server's prefix cache that a
    release throws away; a cache of one-off prompts costs nothing to lose);
    ``continued_tokens``: prompt + generated tokens of the streams the incoming server would
    continue (prefilled again there);
    ``load_s``: seconds the incoming server loads the contexts its store holds."""
    to = wanted(memory.holder, load)
    if to == memory.holder:
        return TurnDecision(False, None, "holder_fits", None)
    before = memory.across
    across = Across(since=before.since if before else now, at=now,
                    forgone_s=before.forgone(now) if before else 0.0, gain=rules.gain(to, load))
    confirm = rules.to_plain_after_s if to == "plain" else rules.to_mtp_after_s
    if now - across.since < confirm:
        return TurnDecision(False, None, "confirming", across)
    if across.forgone_s < rules.price(cached_tokens, load_s):
        return TurnDecision(False, None, "paying_back", across)
    if now - memory.since < rules.dwell(cached_tokens, continued_tokens, load_s):
        return TurnDecision(False, None, "dwell", across)
    reason: TurnReason = "load_above_crossover" if to == "plain" else "load_below_crossover"
    return TurnDecision(True, to, reason, None)
