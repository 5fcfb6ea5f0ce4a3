"""``bench --sim --schedule C:SECONDS,...``: a load that changes within one run, as a team's day
does, on every target: tokens served over the whole run, and each phase's figures.

Each target runs the whole schedule in one simulator (turns and their costs inside it). The
whole-run figure counts the tokens that reached the clients between the start and the end of
the last phase, and the turns that began in it; each phase's figures are the steady method's
over that phase's window (requests that started in it, to their ends). The run stops, the same
for every target, once the last request that started before the schedule's end has ended: what
the sessions send after the end is counted nowhere (without the stop, a day of agent sessions
drained for hours of virtual time after its last phase).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.bench.report import is_pair
from gateway.bench.stats import LevelResult, summarise
from gateway.bench.targets import SimTarget, deciding, turns_calibration
from gateway.bench.turns_virtual import (
    Phase,
    TurnRecord,
    phase_windows,
    run_virtual,
    tokens_within,
)
from gateway.bench.virtual import routing_for
from gateway.bench.workloads import Workload
from gateway.config import Routing


@dataclass
class ScheduleResult:
    target: str
    tokens: float  # over the whole schedule
    seconds: float
    phases: list[LevelResult]
    turns: list[TurnRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"target": self.target, "tokens": self.tokens, "seconds": self.seconds,
                "phases": [p.to_dict() for p in self.phases],
                "turns": [vars(t) for t in self.turns]}


def run_schedule(workload_factory: Callable[[], Workload], phases: Sequence[Phase], routing: Routing,
                 targets: Sequence[SimTarget], *, seed: int = 0, workload_key: object = None,
                 progress: Callable[[str], None] | None = None) -> list[ScheduleResult]:
    windows = phase_windows(phases)
    results = []
    for target in targets:
        if target.turns is not None:
            calibration = turns_calibration(target, workload_factory, routing, seed=seed,
                                            workload_key=workload_key)
            turns, decide_on = deciding(target, calibration, routing)
            run = run_virtual(workload_factory(), routing, target.profiles, phases=phases,
                              turns=turns, turns_routing=decide_on, seed=seed)
        else:
            run = run_virtual(workload_factory(), routing_for(target.policy, routing), target.profiles,
                              phases=phases, seed=seed)
        end = windows[-1][1]
        per_phase = [summarise(target.name, phase.concurrency, run.records, run.wall_s, window)
                     for phase, window in zip(phases, windows, strict=True)]
        results.append(ScheduleResult(target.name, tokens_within(run.records, 0.0, end), end,
                                      per_phase, [t for t in run.turns if t.start < end]))
        if progress:
            progress(target.name)
    return results


def _best_single(results: Sequence[ScheduleResult]) -> list[ScheduleResult]:
    return [r for r in results if not is_pair(r.target)]


def markdown(results: Sequence[ScheduleResult], phases: Sequence[Phase]) -> str:
    """The whole run per target against the best single server, then each phase's figures."""
    singles = _best_single(results)
    best = max(singles, key=lambda r: r.tokens) if singles else None
    lines = ["| target | tokens over the run | tok/s over the run | × the best single server | turns |",
             "|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r.tokens / best.tokens:.3f}" if best and best.tokens else "–"
        lines.append(f"| {r.target} | {r.tokens:,.0f} | {r.tokens / r.seconds:,.0f} | {ratio} "
                     f"| {len(r.turns) if is_pair(r.target) and r.target != 'gateway' else '–'} |")
    lines += ["", "Per phase: aggregate tok/s, per-request tok/s (decode) and tokens / e2e "
              "(queueing included):", ""]
    head = "| target | " + " | ".join(f"C={p.concurrency} ({p.seconds:g} s)" for p in phases) + " |"
    lines += [head, "|---|" + "---|" * len(phases)]
    for r in results:
        cells = [f"{x.aggregate_tps:,.0f} / {x.per_request_tps:.1f} / {x.user_tps:.1f}" for x in r.phases]
        lines.append(f"| {r.target} | " + " | ".join(cells) + " |")
    pairs = [r for r in results if is_pair(r.target)]
    if pairs and singles:
        lines += ["", "The pair against the best single server in each phase (aggregate, per-request "
                  "decode, tokens / e2e; the best single server's name):", ""]
        lines += [head, "|---|" + "---|" * len(phases)]
        for r in pairs:
            cells = []
            for i, x in enumerate(r.phases):
                agg = max(singles, key=lambda s: s.phases[i].aggregate_tps).phases[i]
                per = max(singles, key=lambda s: s.phases[i].per_request_tps).phases[i]
                user = max(singles, key=lambda s: s.phases[i].user_tps).phases[i]
                cells.append(f"{x.aggregate_tps / agg.aggregate_tps:.2f} ({agg.target}) / "
                             f"{x.per_request_tps / per.per_request_tps:.2f} ({per.target}) / "
                             f"{x.user_tps / user.user_tps:.2f} ({user.target})")
            lines.append(f"| {r.target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
