"""What each part of a vLLM turn costs the vLLM turns pair over the agent day, in virtual time:
the pair as the gateway drives it (`vllm-pair-turns`, gateway/bench/targets.py vllm_turn), then
with one part at a time swapped for SGLang's (a 1.5 s turn; running streams continued on the
incoming server instead of finished first and ended past the bound), then both.

    python3 lab/scripts/vllm_turn_parts.py h200 > lab/results/verdict/vllm-turn-parts-h200.md

Not something the gateway can do on vLLM (a continuation needs what vLLM does not serve, and a
level-1 sleep copies the weights): it says where the pair's loss comes from.
"""

from __future__ import annotations

import dataclasses
import sys

from gateway.bench.schedule import run_schedule
from gateway.bench.targets import build_targets
from gateway.bench.turns_virtual import MEASURED_TURN_COST_S, parse_schedule
from gateway.bench.workloads import make_workload
from gateway.config import Routing

SCHEDULE = "4:600,16:600,64:600,32:600,4:600"


def main(hardware: str) -> None:
    pair, mtp_k2, plain = build_targets(["vllm-pair-turns", "vllm-mtp-k2", "vllm-plain"], hardware)
    assert pair.turns is not None
    cheap = {role: MEASURED_TURN_COST_S for role, _ in pair.turns.cost_to}
    variants = {
        "as the gateway drives it": pair.turns,
        f"a {MEASURED_TURN_COST_S:g} s turn": dataclasses.replace(pair.turns, cost_to=tuple(cheap.items())),
        "running streams continued": dataclasses.replace(pair.turns, running="continue",
                                                         past_bound="continue"),
        "both": dataclasses.replace(pair.turns, cost_to=tuple(cheap.items()), running="continue",
                                    past_bound="continue"),
    }
    targets = [dataclasses.replace(pair, name=name, turns=turn) for name, turn in variants.items()]
    results = run_schedule(lambda: make_workload("agent"), parse_schedule(SCHEDULE), Routing(),
                           [*targets, mtp_k2, plain], workload_key=("agent", None))
    best = max(r.tokens for r in results[len(targets):])
    print(f"`python3 lab/scripts/vllm_turn_parts.py {hardware}`: the agent day ({SCHEDULE}), "
          f"vllm-pair-turns with parts of its turn swapped for SGLang's.\n")
    print("| vllm-pair-turns | tokens over the day | × the best single server | turns | "
          "each turn: finishing + dark s | streams ended | streams continued |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        spans = ", ".join(f"{t.released_at - t.start:.1f} + {t.settled_at - t.released_at:.1f}"
                          for t in r.turns)
        print(f"| {r.target} | {r.tokens:,.0f} | {r.tokens / best:.3f} | {len(r.turns) or '–'} "
              f"| {spans or '–'} | {sum(t.ended for t in r.turns) if r.turns else '–'} "
              f"| {sum(t.continued for t in r.turns) if r.turns else '–'} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "h200")
