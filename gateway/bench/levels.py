"""What one concurrency level runs: closed-loop client slots and their request budget.

A level has ``concurrency`` client slots that all start at once (the seed's "all requests of a
level start together"). Each slot runs one workload script after another, back to back (closed
loop), and starts a new script only while the level's budget lasts: fewer than ``requests``
requests started so far, or less than ``duration_s`` elapsed. The level ends when every slot
has finished its last script; its wall time runs from the start to that moment.

Two ways to measure a level (see :mod:`gateway.bench.stats`):
- ``requests=N``: the seed's *makespan* method: N requests, all tokens / wall time, ramp-up
  and drain included. When the load jumps from 0 to C at once this also charges the gateway
  for its one-time switch (the first ``crossover`` requests start on MTP before the load is
  known), so the figure mixes the switching transient with the level's throughput.
- ``duration_s=D`` with ``warmup_s=W``: the *steady* method: slots start scripts until D, and
  the figures cover the window [W, D] of sustained load at C (the drain is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
ROUNDS_BY_DEFAULT = 3  # requests per slot when neither a count nor a duration is given
SIM_DURATION_S = 150.0  # bench --sim's and calibrate --sim's steady level when none is given ...
SIM_WARMUP_S = 50.0  # ... and the seconds left out at its start


@dataclass(frozen=True)
class LevelPlan:
    concurrency: int
    requests: int | None = None
    duration_s: float | None = None
    warmup_s: float = 0.0

    @property
    def window(self) -> tuple[float, float] | None:
        return None if self.duration_s is None else (self.warmup_s, self.duration_s)

    def budget_left(self, started: int, elapsed_s: float) -> bool:
        if self.requests is not None and started >= self.requests:
            return False
        return self.duration_s is None or elapsed_s < self.duration_s


def plan_levels(levels: list[int] | tuple[int, ...], requests_per_level: int | None = None,
                duration_s: float | None = None, warmup_s: float = 0.0) -> list[LevelPlan]:
    """Makespan levels of N requests (default 3 per slot), or steady levels of D seconds."""
    if requests_per_level is not None and duration_s is not None:
        raise ValueError("give a request count or a duration, not both")
    if duration_s is not None and not 0 <= warmup_s < duration_s:
        raise ValueError("the warm-up must be shorter than the duration")
    if duration_s is not None:
        return [LevelPlan(c, None, duration_s, warmup_s) for c in levels]
    return [LevelPlan(c, requests=requests_per_level or ROUNDS_BY_DEFAULT * c) for c in levels]


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--concurrency takes integers separated by commas, got {text!r}") from exc
    if not levels or any(c < 1 for c in levels):
        raise ValueError("--concurrency levels must be >= 1")
    return levels
