"""Issue 19's verdict for the pair taking turns, from ``bench --sim`` JSONs (lab/results/bench/turns.md).

    python -m gateway_lab.turns_report lab/results/bench/turns/*.json

Level sweeps (``bench --sim --json``): per level, the turns pair's aggregate over the best
single server's (every ``single-*`` target), and for session traffic its e2e p50 and p99 over
the best single server's on each. Schedules (``bench --sim --schedule --json``): tokens over
the run against each single server, each phase's per-request tok/s against the best single
server's there, and one row per turn cost. Figures that miss issue 19's bars are marked.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

AGGREGATE_BAR = 0.95  # the pair's aggregate >= 0.95 of the best single server's
LATENCY_BAR = 1.05  # e2e p50 / p99 within 5 % of the best single server's
TOKENS_BAR = 1.05  # over a schedule, >= 5 % more tokens than every single server
QUIET_BAR = 0.95  # per-request tok/s in the quiet phases within 5 %


def _singles(names: Sequence[str]) -> list[str]:
    return [n for n in names if n.startswith("single-")]


def _pairs(names: Sequence[str]) -> list[str]:
    return [n for n in names if n.startswith("pair-turns")]


def _short(name: str) -> str:
    return name.removeprefix("single-")


def _mark(ok: bool) -> str:
    return "" if ok else " ✗"


Level = Mapping[str, Any]  # one target's figures at one level of a sweep


def _rows(data: Mapping[str, Any], cell: Callable[[Mapping[str, Any], list[str], int, Level], str]
          ) -> list[str]:
    """One Markdown row per turns target of a level sweep, `cell(results, singles, i, level)`
    at each level i."""
    results = data["results"]
    singles = _singles(list(results))
    return [" | ".join(cell(results, singles, i, r) for i, r in enumerate(results[pair]))
            for pair in _pairs(list(results))]


def _against(ratio: float, ok: bool, best: str) -> str:
    return f"{ratio:.2f}{_mark(ok)} ({_short(best)})"


def level_rows(data: Mapping[str, Any]) -> list[str]:
    """One Markdown row per turns target of a level sweep: ratio (best single) per level."""
    def aggregate(results: Mapping[str, Any], singles: list[str], i: int, r: Level) -> str:
        best = max(singles, key=lambda t: results[t][i]["aggregate_tps"] or 0.0)
        ratio = r["aggregate_tps"] / results[best][i]["aggregate_tps"]
        return _against(ratio, ratio >= AGGREGATE_BAR, best)
    return _rows(data, aggregate)


def latency_rows(data: Mapping[str, Any]) -> list[str]:
    """Per turns target: e2e p50 / p99 over the best single server's on each, per level."""
    def latency(results: Mapping[str, Any], singles: list[str], i: int, r: Level) -> str:
        figures = []
        for key in ("e2e_p50_s", "e2e_p99_s"):
            best = min(singles, key=lambda t: results[t][i][key])
            ratio = r[key] / results[best][i][key]
            figures.append(_against(ratio, ratio <= LATENCY_BAR, best))
        return " / ".join(figures)
    return _rows(data, latency)


def level_table(paths: Sequence[str]) -> str:
    lines = []
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        meta, results = data["meta"], data["results"]
        levels = [r["concurrency"] for r in next(iter(results.values()))]
        sessions = meta.get("workload") == "agentic"
        what = ("e2e p50 / p99 × the best single server's" if sessions
                else "aggregate × the best single server's")
        lines += [f"**{meta['workload']}, {meta['hardware']}, {meta['method']}** ({what}; "
                  f"crossover {meta.get('turns_crossover')}, turns per level {meta.get('turns')})", "",
                  "| target | " + " | ".join(f"C={c}" for c in levels) + " |",
                  "|---|" + "---|" * len(levels)]
        rows = latency_rows(data) if sessions else level_rows(data)
        for pair, row in zip(_pairs(list(results)), rows, strict=True):
            lines.append(f"| {pair} | {row} |")
        lines.append("")
    return "\n".join(lines)


def _best_by_aggregate(results: Mapping[str, Any], singles: Sequence[str], phase: int) -> str:
    return max(singles, key=lambda s: results[s]["phases"][phase]["aggregate_tps"])


def schedule_table(paths: Sequence[str]) -> str:
    """Per schedule JSON: each turns target's tokens over the run against every single server,
    and its per-request tok/s in the quiet phases (where a speculative single server makes
    more than the plain one) against the best single server's there."""
    lines = []
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        meta = data["meta"]
        results = {r["target"]: r for r in data["results"]}
        singles = _singles(list(results))
        if not singles:
            continue
        lines += [f"**{meta['workload']}, {meta['hardware']}, schedule {meta['schedule']}**", "",
                  "| target | tokens over the run | × each single server (✗: less than 1.05) "
                  "| per-request tok/s in the quiet phases × the best single server's |",
                  "|---|---|---|---|"]
        for pair in _pairs(list(results)):
            r = results[pair]
            versus = ", ".join(f"{_short(s)} {r['tokens'] / results[s]['tokens']:.3f}"
                               f"{_mark(r['tokens'] / results[s]['tokens'] >= TOKENS_BAR)}" for s in singles)
            quiet = []
            for i, phase in enumerate(r["phases"]):
                if _best_by_aggregate(results, singles, i) == "single-plain":
                    continue  # not quiet: the plain server is the better one there
                best = max(singles, key=lambda s: results[s]["phases"][i]["per_request_tps"])
                ratio = phase["per_request_tps"] / results[best]["phases"][i]["per_request_tps"]
                quiet.append(f"C={phase['concurrency']} {ratio:.2f}{_mark(ratio >= QUIET_BAR)}")
            lines.append(f"| {pair} | {r['tokens']:,.0f} | {versus} | {', '.join(quiet)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    kinds: dict[str, list[str]] = {"levels": [], "schedules": []}
    for path in paths:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        kinds["schedules" if "schedule" in data["meta"] else "levels"].append(path)
    print(level_table(kinds["levels"]))
    print(schedule_table(kinds["schedules"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
