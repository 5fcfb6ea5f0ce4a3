"""Reports: a Markdown table, ratios against the best static target, JSON, and a PNG plot."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.bench.stats import LevelResult, OpenLoopResult

GATEWAY_NAMES = ("gateway",)


def is_pair(target: str) -> bool:
    """The pair through the gateway (split memory, or taking turns: ``pair-turns*``; vLLM's:
    ``vllm-pair*``), which the single servers are compared with."""
    return target in GATEWAY_NAMES or target.startswith(("pair-turns", "vllm-pair"))


def _num(value: float, digits: int = 1) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _share(share: Mapping[str, float]) -> str:
    return " ".join(f"{name} {fraction:.0%}" for name, fraction in share.items()) or "–"


def markdown_table(results: Mapping[str, Sequence[LevelResult]]) -> str:
    head = ("| C | target | per-request tok/s | aggregate tok/s | TTFT p50 / p99 s | ITL p50 / p99 ms "
            "| e2e p50 / p99 s | requests | errors | backend share |")
    lines = [head, "|" + "---|" * 10]
    levels = sorted({r.concurrency for rows in results.values() for r in rows})
    for c in levels:
        for target, rows in results.items():
            for r in rows:
                if r.concurrency != c:
                    continue
                lines.append(
                    f"| {c} | {target} | {_num(r.per_request_tps)} | {_num(r.aggregate_tps, 0)} "
                    f"| {_num(r.ttft_p50_s, 2)} / {_num(r.ttft_p99_s, 2)} "
                    f"| {_num(r.itl_p50_s * 1000, 1)} / {_num(r.itl_p99_s * 1000, 1)} "
                    f"| {_num(r.e2e_p50_s, 1)} / {_num(r.e2e_p99_s, 1)} | {r.requests} | {r.errors} "
                    f"| {_share(r.share)} |")
    return "\n".join(lines)


def ratios(results: Mapping[str, Sequence[LevelResult]]) -> list[dict[str, Any]]:
    """Per level, each non-static target's figures over the best static target's.

    Static targets are every target that is not the pair (is_pair); with no pair among them,
    every target is compared with the best of all (the best one shows 1.00).
    """
    statics = [t for t in results if not is_pair(t)] or list(results)
    rows = []
    levels = sorted({r.concurrency for rs in results.values() for r in rs})
    by = {t: {r.concurrency: r for r in rs} for t, rs in results.items()}
    for c in levels:
        static = [by[t][c] for t in statics if c in by[t]]
        if not static:
            continue
        best_pr = max(static, key=lambda r: _val(r.per_request_tps))
        best_agg = max(static, key=lambda r: _val(r.aggregate_tps))
        row: dict[str, Any] = {"concurrency": c, "best_per_request": best_pr.target,
                               "best_aggregate": best_agg.target}
        for target in results:
            if c in by[target]:
                r = by[target][c]
                row[target] = {"per_request": _ratio(r.per_request_tps, best_pr.per_request_tps),
                               "aggregate": _ratio(r.aggregate_tps, best_agg.aggregate_tps)}
        rows.append(row)
    return rows


def _val(x: float) -> float:
    return -math.inf if x is None or math.isnan(x) else x


def _ratio(a: float, b: float) -> float | None:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return None
    return a / b


def ratios_table(rows: Sequence[Mapping[str, Any]], targets: Sequence[str]) -> str:
    cols = " | ".join(f"{t} per-req | {t} aggr" for t in targets)
    lines = [f"| C | best static per-req | best static aggr | {cols} |",
             "|" + "---|" * (3 + 2 * len(targets))]
    for row in rows:
        cells = []
        for t in targets:
            r = row.get(t) or {}
            cells += [_fmt_ratio(r.get("per_request")), _fmt_ratio(r.get("aggregate"))]
        lines.append(f"| {row['concurrency']} | {row['best_per_request']} | {row['best_aggregate']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def to_json(results: Mapping[str, Sequence[LevelResult]], meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"meta": dict(meta),
            "results": {t: [r.to_dict() for r in rs] for t, rs in results.items()},
            "ratios": ratios(results)}


def write_json(path: str | Path, results: Mapping[str, Sequence[LevelResult]],
               meta: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(to_json(results, meta), indent=2) + "\n", encoding="utf-8")


def plot(path: str | Path, results: Mapping[str, Sequence[LevelResult]], title: str = "",
         with_queueing: bool = False) -> bool:
    """Per-request and aggregate tok/s against concurrency; False when matplotlib is missing.

    ``with_queueing``: per-request is what a user gets, tokens / e2e (time queued behind a
    running cap included), instead of the seed's decode speed while running."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for target, rows in results.items():
        xs = [r.concurrency for r in rows]
        style = {"linewidth": 2.6, "zorder": 3} if is_pair(target) else {"linestyle": "--"}
        per_request = [r.user_tps if with_queueing else r.per_request_tps for r in rows]
        left.plot(xs, per_request, marker="o", label=target, **style)
        right.plot(xs, [r.aggregate_tps for r in rows], marker="o", label=target, **style)
    left_label = ("per-request tok/s incl. queueing (tokens / e2e)" if with_queueing
                  else "per-request output tok/s")
    for ax, label in ((left, left_label), (right, "aggregate output tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (clients)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        levels = sorted({r.concurrency for rs in results.values() for r in rs})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
    right.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- the pair against the single servers -------------------------------------------------------

def verdict(results: Mapping[str, Sequence[LevelResult]], pair: str = "gateway") -> list[dict[str, Any]]:
    """Per level: the pair's aggregate and user-visible per-request tok/s (tokens / e2e, queueing
    included) against the best of the other targets on each figure, and who that is."""
    if pair not in results:
        return []
    others = [t for t in results if not is_pair(t)]
    by = {t: {r.concurrency: r for r in rs} for t, rs in results.items()}
    rows = []
    for r in results[pair]:
        rivals = [by[t][r.concurrency] for t in others if r.concurrency in by[t]]
        if not rivals:
            continue
        best_agg = max(rivals, key=lambda x: _val(x.aggregate_tps))
        best_user = max(rivals, key=lambda x: _val(x.user_tps))
        rows.append({"concurrency": r.concurrency,
                     "pair_aggregate": r.aggregate_tps, "best_aggregate": best_agg.aggregate_tps,
                     "best_aggregate_target": best_agg.target,
                     "aggregate_ratio": _ratio(r.aggregate_tps, best_agg.aggregate_tps),
                     "pair_user": r.user_tps, "best_user": best_user.user_tps,
                     "best_user_target": best_user.target,
                     "user_ratio": _ratio(r.user_tps, best_user.user_tps)})
    return rows


def verdict_table(rows: Sequence[Mapping[str, Any]], pair_label: str = "gateway") -> str:
    p = pair_label
    lines = [f"| C | {p} aggregate tok/s | best single server | its aggregate | {p} / it "
             f"| {p} per-request tok/s (incl. queueing) | best single server | its per-request "
             f"| {p} / it |", "|" + "---|" * 9]
    for row in rows:
        lines.append(
            f"| {row['concurrency']} | {_num(row['pair_aggregate'], 0)} | {row['best_aggregate_target']} "
            f"| {_num(row['best_aggregate'], 0)} | {_fmt_ratio(row['aggregate_ratio'])} "
            f"| {_num(row['pair_user'])} | {row['best_user_target']} | {_num(row['best_user'])} "
            f"| {_fmt_ratio(row['user_ratio'])} |")
    return "\n".join(lines)


# --- open loop ----------------------------------------------------------------------------------

def _rate(value: float, unit: str) -> str:
    per = "req/s" if unit == "request" else "sessions/s"
    if value is None or math.isnan(value):
        return "–"
    return f"inf {per}" if math.isinf(value) else f"{value:,.3g} {per}"


def open_loop_table(results: Mapping[str, Sequence[OpenLoopResult]]) -> str:
    """One row per run and target: offered against achieved rate, then the request figures
    (latencies from each request's scheduled arrival, queueing included)."""
    head = ("| arrivals | target | offered | achieved | completed | aggregate tok/s | per-request tok/s "
            "| TTFT p50 / p99 s | ITL p50 / p99 ms | e2e p50 / p99 s | requests | errors "
            "| client lag p99 / max s | backend share |")
    lines = [head, "|" + "---|" * 14]
    runs = max((len(rows) for rows in results.values()), default=0)
    for i in range(runs):
        for target, rows in results.items():
            if i >= len(rows):
                continue
            r, lv = rows[i], rows[i].level
            lines.append(
                f"| {r.label} | {target} | {_rate(r.offered_rate, r.unit)} "
                f"| {_rate(r.achieved_rate, r.unit)} | {r.completed}/{r.arrivals} "
                f"| {_num(lv.aggregate_tps, 0)} | {_num(lv.per_request_tps)} "
                f"| {_num(lv.ttft_p50_s, 2)} / {_num(lv.ttft_p99_s, 2)} "
                f"| {_num(lv.itl_p50_s * 1000, 1)} / {_num(lv.itl_p99_s * 1000, 1)} "
                f"| {_num(lv.e2e_p50_s, 1)} / {_num(lv.e2e_p99_s, 1)} | {lv.requests} | {lv.errors} "
                f"| {_num(r.client_lag_p99_s, 2)} / {_num(r.client_lag_max_s, 2)} | {_share(lv.share)} |")
    return "\n".join(lines)


def write_open_json(path: str | Path, results: Mapping[str, Sequence[OpenLoopResult]],
                    meta: Mapping[str, Any]) -> None:
    data = {"meta": dict(meta), "results": {t: [r.to_dict() for r in rs] for t, rs in results.items()}}
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
