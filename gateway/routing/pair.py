"""One pair of the pool: its two backends, its own mode, routing and learned crossover."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config import Backend, EngineName, Role, Routing, Settings
from gateway.routing.backend import BackendState
from gateway.routing.crossover import Advice, CrossoverEstimator
from gateway.routing.policy import effective_crossover
from gateway.routing.sessions import SessionActivity


@dataclass(frozen=True, slots=True)
class PairSpec:
    name: str
    mtp: Backend
    plain: Backend
    routing: Routing
    engine: EngineName = "sglang"


def pair_specs(settings: Settings) -> list[PairSpec]:
    """The configured pairs, each with its routing section (`backends` alone: one pair)."""
    return [PairSpec(p.name, p.mtp, p.plain, settings.routing_for(p),
                     settings.engine_of(p)) for p in settings.fleet()]


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
    mode: Role = "mtp"
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
        running caps and accept length (gateway.routing.crossover); None when not learning."""
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
