"""The agent day minute by minute, in virtual time: output tokens each minute of one phase for
plain and the adaptive MTP server owning the GPUs, and for the pair taking turns with the turn
rule before the payback (``payback_turns`` 0: hand over as soon as the load crosses) and with it
(gateway/turns/decision.py). Says when plain is ahead inside the phase, by how much, and what
the turn the earlier rule made there threw away.

    python3 lab/scripts/agent_day_minutes.py h200 > lab/results/verdict/agent-day-minutes-h200.md
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from gateway.bench.stats import RequestRecord
from gateway.bench.targets import build_targets, deciding, turns_calibration
from gateway.bench.turns_virtual import parse_schedule, phase_windows, run_virtual, tokens_within
from gateway.bench.virtual import routing_for
from gateway.bench.workloads import make_workload
from gateway.config import Routing

SCHEDULE = "4:600,16:600,64:600,32:600,4:600"
PHASE = 2  # the 64-session phase
MINUTE_S = 60.0


def in_flight(records: Sequence[RequestRecord], t0: float, t1: float) -> float:
    """Requests in flight, averaged over [t0, t1] (a request still running at the end counts to t1)."""
    busy = sum(max(0.0, min(t1, r.end if r.end is not None else t1) - max(t0, r.start)) for r in records)
    return busy / (t1 - t0)


def main(hardware: str) -> None:
    routing, phases = Routing(), parse_schedule(SCHEDULE)
    t0, t1 = phase_windows(phases)[PHASE]
    plain, adaptive, pair = build_targets(["single-plain", "single-adaptive", "pair-turns"], hardware)
    calibration = turns_calibration(pair, lambda: make_workload("agent"), routing, workload_key="agent")
    rows, turned = {}, {}
    for target in (plain, adaptive):
        run = run_virtual(make_workload("agent"), routing_for(target.policy, routing), target.profiles,
                          phases=phases)
        rows[target.name] = run.records
    for label, payback in (("pair-turns, turning at the crossover (before)", 0.0),
                           ("pair-turns, repaying the caches (now)", 1.0)):
        turns, decide_on = deciding(dataclasses.replace(
            pair, turns=dataclasses.replace(pair.turns, payback_turns=payback)), calibration, routing)
        run = run_virtual(make_workload("agent"), routing, pair.profiles, phases=phases, turns=turns,
                          turns_routing=decide_on)
        rows[label], turned[label] = run.records, run.turns
    minutes = [(t0 + k * MINUTE_S, t0 + (k + 1) * MINUTE_S) for k in range(int((t1 - t0) // MINUTE_S))]
    print(f"## The agent day's {phases[PHASE].concurrency}-session phase minute by minute "
          f"({hardware}, virtual time)\n")
    print(f"Schedule {SCHEDULE}; the phase runs t = {t0:.0f}-{t1:.0f} s. Output tokens a second, each minute "
          f"(turns crossover {calibration.crossover}, plain's gain per crossover past it "
          f"{calibration.gain_per_crossover:.3f}). Command: `python3 lab/scripts/agent_day_minutes.py "
          f"{hardware}`.\n")
    print("| target | " + " | ".join(f"min {k + 1}" for k in range(len(minutes))) + " | phase |")
    print("|---|" + "---|" * (len(minutes) + 1))
    for label, records in rows.items():
        cells = [f"{tokens_within(records, a, b) / MINUTE_S:,.0f}" for a, b in minutes]
        print(f"| {label} | " + " | ".join(cells) + f" | {tokens_within(records, t0, t1) / (t1 - t0):,.0f} |")
    print("\nRequests in flight at once, the minute's average (sessions between calls are thinking):\n")
    print("| target | " + " | ".join(f"min {k + 1}" for k in range(len(minutes))) + " |")
    print("|---|" + "---|" * len(minutes))
    for label in (plain.name, adaptive.name):
        cells = [f"{in_flight(rows[label], a, b):.0f}" for a, b in minutes]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nTurns over the day (start s, to, sessions at work, their contexts prefilled again):\n")
    for label, turns_made in turned.items():
        said = "; ".join(f"{t.start:.0f} s to {t.to}, {t.sessions} sessions, {t.prefill_tokens:,} tokens"
                         for t in turns_made) or "none"
        print(f"- {label}: {said}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "h200")
