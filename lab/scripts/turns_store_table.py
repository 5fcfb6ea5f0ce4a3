"""A turn's cost to the sessions at work, with each server's store and without, from the JSON of
``mtp-gateway bench --sim --schedule ... --json`` (the turns targets' ``turns``).

    python3 lab/scripts/turns_store_table.py lab/results/turns-store/h200-pair-store.json

Each turn's record holds, read from the simulator's stores when the turn starts: the sessions at
work, their contexts (what the incoming server prefills without a store), what its own store
lacks (prefilled with one) and the seconds to load the rest; seconds at the incoming server's
prefill rate (``prefill_s``) plus the load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gateway.sim.profile import packaged_timings


def rows(path: str) -> list[str]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    lines = []
    for result in data["results"]:
        for turn in result["turns"]:
            sessions = max(turn["sessions"], 1)
            context, prefill = turn["context_tokens"], turn["prefill_tokens"]
            # without a store every context is prefilled, at the incoming server's rate
            ms_per_1k = (turn["prefill_s"] * 1e6 / prefill if prefill
                         else packaged_timings()[turn["to"]].prefill_ms_per_1k)
            without_s = context * ms_per_1k / 1e6
            with_s = turn["prefill_s"] + turn["load_s"]
            lines.append(
                f"| {Path(path).stem} ({result['target']}) | {turn['start']:,.0f} s | to {turn['to']} "
                f"| {turn['sessions']} "
                f"| {context:,} ({context / sessions:,.0f}) | {without_s:,.1f} ({without_s / sessions:.2f}) "
                f"| {prefill:,} ({prefill / sessions:,.0f}) | {turn['load_s']:.2f} "
                f"| {with_s:,.1f} ({with_s / sessions:.2f}) | {turn['drain_s']:.2f} "
                f"| {turn['dropped_tokens']:,} |")
    return lines


def main(paths: list[str]) -> None:
    print("| run (target) | turn at | to | sessions at work "
          "| without a store: tokens prefilled (per session) "
          "| seconds (per session) | with its own store: tokens prefilled (per session) | load s "
          "| seconds (per session) | drain s | writes dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        print("\n".join(rows(path)))


if __name__ == "__main__":
    main(sys.argv[1:])
