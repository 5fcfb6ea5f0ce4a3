"""The headline of docs/results.md: per hardware and workload, where the pair through the
gateway wins against the best single server owning the GPUs, and by how much, from
``bench --sim`` JSONs.

    python -m gateway.bench.headline lab/results/bench/sim-*-*.json
    python -m gateway.bench.headline --exclude single-adaptive lab/results/bench/sim-*-*.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.bench.report import verdict
from gateway.bench.stats import LevelResult


def load(path: str | Path) -> tuple[dict[str, Any], dict[str, list[LevelResult]]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    results = {t: [_level(r) for r in rows] for t, rows in data["results"].items()}
    return data["meta"], results


def _level(row: dict[str, Any]) -> LevelResult:
    # A null in the JSON is a NaN figure (JSON has none); the keys are LevelResult's fields.
    fields: dict[str, Any] = {k: (float("nan") if v is None else v) for k, v in row.items()}
    return LevelResult(**fields)


TIE = 0.02  # within 2 % either way: a tie (the same server, or noise of the window)


def _kind(ratio: float) -> str:
    return "win" if ratio > 1 + TIE else "lose" if ratio < 1 - TIE else "tie"


def _levels(rows: Sequence[dict[str, Any]], kind: str) -> str:
    picked = [r for r in rows if r["aggregate_ratio"] is not None and _kind(r["aggregate_ratio"]) == kind]
    if not picked:
        return "none"
    ratios = [r["aggregate_ratio"] for r in picked]
    levels = ", ".join(str(r["concurrency"]) for r in picked)
    lo, hi = min(ratios), max(ratios)
    span = f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}–{hi:.2f}"
    return f"C = {levels} (× {span})"


def _who(rows: Sequence[dict[str, Any]]) -> str:
    names: dict[str, list[int]] = {}
    for r in rows:
        if r["aggregate_ratio"] is not None and _kind(r["aggregate_ratio"]) == "lose":
            names.setdefault(r["best_aggregate_target"], []).append(r["concurrency"])
    return "; ".join(f"{n} at C = {', '.join(map(str, cs))}" for n, cs in names.items()) or "–"


def headline(paths: Sequence[str | Path], exclude: Sequence[str] = ()) -> str:
    lines = ["| hardware | workload | the pair wins (its aggregate × the best single server's) "
             "| a tie (within 2 %) | a single server wins (the pair's aggregate × it) "
             "| the single server that wins |",
             "|---|---|---|---|---|---|"]
    for path in paths:
        meta, results = load(path)
        rows = verdict({t: rs for t, rs in results.items() if t not in exclude})
        lines.append(f"| {meta.get('hardware', '?')} | {meta['workload']} | {_levels(rows, 'win')} "
                     f"| {_levels(rows, 'tie')} | {_levels(rows, 'lose')} | {_who(rows)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    exclude = []
    while args[:1] == ["--exclude"] and len(args) > 1:
        exclude.append(args[1])
        args = args[2:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    print(headline(args, exclude))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
