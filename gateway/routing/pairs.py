"""Which pair takes a new request: a pure function of what the pool knows. No I/O, no clock.

A pair is an MTP server and a plain server on the same GPUs. Across pairs the question is only
where there is room: the least loaded pair by its combined load (both servers, every replica's
traffic as far as the pool can see it). A session stays on the pair holding its prefix cache
(moving it costs a full prefill of a long context), unless that pair is `affinity_slack`
requests busier than the least loaded one: then the cache is worth less than the queue.
Inside the chosen pair, `gateway.routing.policy.decide` picks MTP or plain by that pair's own load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PairReason = Literal["least_loaded", "session_affinity", "holder", "no_pair"]


@dataclass(frozen=True, slots=True)
class PairView:
    name: str
    load: int  # requests on the pair's two servers, as the pool sees them now
    usable: bool  # at least one of its servers may take the request


@dataclass(frozen=True, slots=True)
class PairChoice:
    pair: str | None  # None: no pair can take it
    reason: PairReason


def choose_pair(pairs: Sequence[PairView], session_pair: str | None,
                affinity_slack: int) -> PairChoice:
    """The least loaded usable pair (the first of equals, so the choice is reproducible), or
    the session's pair while it is within `affinity_slack` of that."""
    usable = [p for p in pairs if p.usable]
    if not usable:
        return PairChoice(None, "no_pair")
    least = min(usable, key=lambda p: p.load)
    if session_pair is not None and session_pair != least.name:
        for pair in usable:
            if pair.name == session_pair and pair.load <= least.load + affinity_slack:
                return PairChoice(pair.name, "session_affinity")
    return PairChoice(least.name, "session_affinity" if session_pair == least.name
                      else "least_loaded")
