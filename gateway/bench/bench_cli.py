"""`mtp-gateway bench`: closed-loop concurrency sweeps over HTTP, or in the simulator's virtual time.

    mtp-gateway bench --url http://127.0.0.1:8000 --workload chat --json out.json --plot out.png
    mtp-gateway bench --compare mtp=http://:30001 plain=http://:30002 gateway=http://:8000
    mtp-gateway bench --sim --workload agentic --hardware h200
        # the pair against one plain, one MTP and one adaptive server owning the GPUs (and,
        # with --memory turns, the tuned single MTP servers)
    mtp-gateway bench --sim --memory turns --schedule 4:600,64:600,16:600,128:600,2:600
    mtp-gateway bench --sim --target pair-turns --turn-cost 0.5,1.5,5,15

Open loop (arrivals on a clock, latency from each request's scheduled arrival; docs/workloads.md):

    mtp-gateway bench --sim --workload chat --request-rate 2,4,8 --duration 120
    mtp-gateway bench --url http://127.0.0.1:8000 --workload agentic --session-rate 0.2 --requests 50
    mtp-gateway bench --sim --trace mooncake_trace.jsonl --trace-time-scale 2
    mtp-gateway bench --url http://127.0.0.1:30002 --trace conversations.json --session-rate 1
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from gateway.bench import report
from gateway.bench.arrivals import DEFAULT_MAX_IN_FLIGHT, OpenLoop, arrival_times, poisson_label
from gateway.bench.levels import (
    DEFAULT_LEVELS,
    SIM_DURATION_S,
    SIM_WARMUP_S,
    LevelPlan,
    parse_levels,
    plan_levels,
)
from gateway.bench.progress import Progress
from gateway.bench.stats import LevelResult, OpenLoopResult
from gateway.bench.targets import ALL_TARGETS, DEFAULT_MEMORY, POLICY_TARGETS, default_targets
from gateway.bench.traces import FORMATS, Trace, closed_loop, workload_or_trace
from gateway.bench.workloads import WORKLOADS, Outcome, Send, Workload, make_workload
from gateway.config import ConfigError, Routing, build_routing
from gateway.sim.memory import DEFAULT_HARDWARE, HARDWARE
from gateway.sim.speed import add_speed_argument
from gateway.turns.decision import TurnRules

# Open loop with a rate and no bound: bench_serving's --num-prompts default (sglang 0.5.23
# wheel: sglang/benchmark/serving.py:2394-2397).
OPEN_DEFAULT_ARRIVALS = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    where = parser.add_argument_group("targets (one of)")
    where.add_argument("--url", help="one OpenAI-compatible base URL (gateway or backend)")
    where.add_argument("--compare", nargs="+", metavar="NAME=URL",
                       help="several targets, run interleaved level by level; ratios against the "
                            "best static target (every target not named 'gateway')")
    where.add_argument("--sim", action="store_true",
                       help="virtual time: the real router over the simulator, no HTTP")
    parser.add_argument("--concurrency", default=",".join(map(str, DEFAULT_LEVELS)),
                        help="levels, comma-separated (default %(default)s)")
    parser.add_argument("--workload", default=None,
                        help=f"{' | '.join(WORKLOADS)} | agent:CLIENT[,human=SCALE] (gateway/bench/agent.py)"
                             " | file:PATH.jsonl (default seed)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--requests-per-level", type=int, metavar="N",
                      help="makespan method: N requests per level (default over HTTP: 3 per client)")
    size.add_argument("--makespan", action="store_true",
                      help="makespan method, the seed's: all clients start together, 3 requests each")
    size.add_argument("--duration", type=float, metavar="S",
                      help="steady method: keep the level busy S seconds (--sim default "
                           f"{SIM_DURATION_S:g}); open loop: the arrivals before S")
    parser.add_argument("--warmup", type=float, metavar="S", default=None,
                        help=f"steady method: seconds left out at the start (--sim default {SIM_WARMUP_S:g})")
    parser.add_argument("--max-tokens", type=int, help="cap every request's output (quick runs)")
    parser.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    parser.add_argument("--model", help="model name to send (default: the target's /v1/models)")
    parser.add_argument("--api-key", help="sent as Authorization: Bearer")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    add_speed_argument(parser, reported=True)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_open_loop_arguments(parser)
    sim = parser.add_argument_group("--sim options")
    sim.add_argument("--target", action="append", choices=ALL_TARGETS,
                     help="targets to run (repeatable; default: the pair in the --memory shape, "
                          "and single servers owning the GPUs: " + ", ".join(default_targets("turns")[1:])
                          + "; with --memory split the tuned ones are left out)")
    sim.add_argument("--memory", choices=("split", "turns"), default=DEFAULT_MEMORY,
                     help="the pair's memory: split between its servers (target gateway), or the "
                          "servers take turns owning it (target pair-turns; default %(default)s)")
    sim.add_argument("--turn-cost", default="1.5", metavar="S[,S...]",
                     help="seconds a turn costs (pause + release + resume + continue; default "
                          "%(default)s, measured on an H200 with the host copy retained); several: "
                          "each turns target once per cost, named TARGET@Ss")
    sim.add_argument("--turns-store", choices=("own", "none", "shared"), default="none",
                     help="the turns pair's prefix caches across a turn (SGLang's HiCache, an L3 "
                          "file store on the host): none = no HiCache, every turn re-prefills "
                          "(default, as the deploy files run: the stores bought nothing on agent "
                          "days, lab/results/turns-store/turns.md); own = each server its own "
                          "namespace, found again on its next turn; shared = one namespace for "
                          "both, refused: the plain server would load MTP's pages as its own")
    sim.add_argument("--turns-store-gb", type=float, metavar="GB",
                     help="each turns server's L3 cap, GB over all its ranks (default: the deploy "
                          "files', python -m gateway.sim.memory)")
    sim.add_argument("--turns-crossover", type=int, metavar="N",
                     help="the load at which the turns hand the memory to plain (default: "
                          "calibrated on the workload: where plain alone overtakes MTP alone)")
    sim.add_argument("--turns-payback", type=float, metavar="TURNS", default=TurnRules().payback_turns,
                     help="a turn waits until the holder has forgone this many times its cost "
                          "(turns.payback_turns; default %(default)s; 0: turn as soon as the load "
                          "crosses, the rule before it)")
    sim.add_argument("--schedule", metavar="C:SECONDS,...",
                     help="one run whose load changes: C clients for SECONDS, then the next "
                          "(e.g. 4:600,64:600,16:600,128:600,2:600); replaces --concurrency")
    sim.add_argument("--policy", action="append", choices=tuple(POLICY_TARGETS),
                     help="the pair's servers under a policy (repeatable): crossover = gateway, "
                          "mtp-only = pair-mtp-only, plain-only = pair-plain-only")
    sim.add_argument("--hardware", choices=tuple(HARDWARE), default=DEFAULT_HARDWARE,
                     help="GPUs whose memory sizes every server (default %(default)s)")
    sim.add_argument("--config", help="config file for the routing section (default ./config.yaml)")
    sim.add_argument("--profiles", help="simulator profiles YAML (default: the packaged ones)")
    sim.add_argument("--routing", action="append", metavar="KEY=VALUE", default=[],
                     help="override one key of the config's routing section (repeatable), "
                          "e.g. --routing handoff_running=true")
    sim.add_argument("--carry-learning", action="store_true",
                     help="the learned crossover keeps its samples from level to level, as a live "
                          "gateway's would while the load rises (default: each level starts cold)")
    sim.add_argument("--accept-drop", metavar="BEFORE:AFTER",
                     help="MTP accepts each draft with probability BEFORE, then AFTER from half "
                          "the level on (e.g. 0.9:0.5): does the routing follow?")
    sim.add_argument("--separate-devices", action="store_true",
                     help="give each simulated backend its own GPU (default: one shared device)")


def add_open_loop_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "open loop (instead of closed-loop levels: requests arrive on a clock, whatever the "
        "server does; latency counts from each request's scheduled arrival)")
    rate = group.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", metavar="R[,R...]",
                      help="requests per second, Poisson (see --burstiness); inf = all at once; "
                           "several: one run each. Each arrival is one request (workloads whose "
                           "scripts are sessions take --session-rate)")
    rate.add_argument("--session-rate", metavar="R[,R...]",
                      help="sessions per second: each arrival starts one workload script (e.g. an "
                           "agentic session, or an agentic trace's conversation), closed-loop inside")
    group.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                       help="arrival intervals are gamma of shape B and mean 1/R: 1 = Poisson "
                            "(default), < 1 burstier, > 1 more regular (vLLM's --burstiness)")
    group.add_argument("--requests", type=int, metavar="N",
                       help=f"open loop: the first N arrivals (default {OPEN_DEFAULT_ARRIVALS} with a "
                            "rate and no --duration, as bench_serving's --num-prompts; a trace: all); "
                            "--duration S bounds them too (the arrivals before S)")
    group.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, metavar="N",
                       help="at most N arrivals (requests, or sessions) alive at once; later ones "
                            "wait at the client, in order, and that wait counts in their latency "
                            "(default %(default)s)")
    group.add_argument("--trace", metavar="PATH",
                       help="replay a trace (instead of --workload): Mooncake's JSON lines at their "
                            "timestamps, SGLang's agentic trace (conversations, round by round), or "
                            "recorded requests (file:PATH's format, with an optional timestamp)")
    group.add_argument("--trace-format", choices=FORMATS, help="the trace's format (default: detected)")
    group.add_argument("--trace-time-scale", type=float, default=1.0, metavar="S",
                       help="a timed trace's intervals times S: 2 = twice as slow (SGLang's "
                            "--mooncake-slowdown-factor; default 1)")
    group.add_argument("--trace-rate-scale", type=float, default=1.0, metavar="R",
                       help="a timed trace's arrival rate times R: its intervals divided by R "
                            "(default 1)")


def _open_loop(args: argparse.Namespace) -> bool:
    return bool(args.request_rate or args.session_rate or args.trace)


def run(args: argparse.Namespace) -> int:
    chosen = sum(bool(x) for x in (args.url, args.compare, args.sim))
    if chosen != 1:
        print("mtp-gateway bench: give exactly one of --url, --compare, --sim", file=sys.stderr)
        return 2
    if _open_loop(args):
        return _run_open(args)
    if args.workload is None:
        args.workload = "seed"
    try:
        levels = parse_levels(args.concurrency)
        make_workload(args.workload, args.seed, args.max_tokens)  # validate early
        if args.sim and args.schedule:
            return _run_schedule(args)
        if args.sim:
            results, meta = _run_sim(args, levels)
        else:
            results, meta = _run_http(args, levels)
    except (ValueError, OSError) as exc:
        print(f"mtp-gateway bench: {exc}", file=sys.stderr)
        return 2
    _output(args, results, meta)
    return 0


def _plans(args: argparse.Namespace, levels: list[int], sim: bool) -> list[LevelPlan]:
    duration = args.duration
    if sim and duration is None and args.requests_per_level is None and not args.makespan:
        duration = SIM_DURATION_S
    warmup = args.warmup if args.warmup is not None else (SIM_WARMUP_S if sim and duration else 0.0)
    return plan_levels(levels, args.requests_per_level, duration, warmup if duration else 0.0)


def _method(plans: list[LevelPlan]) -> str:
    plan = plans[0]
    if plan.window is None:
        return f"makespan: {plan.requests if plan.requests else '?'} requests per level" + (
            "" if len({p.requests for p in plans}) == 1 else " (3 per client)")
    return f"steady: {plan.duration_s:g} s per level, window after a {plan.warmup_s:g} s warm-up"


def _run_sim(args: argparse.Namespace,
             levels: list[int]) -> tuple[dict[str, list[LevelResult]], dict[str, Any]]:
    from gateway.bench.targets import caps, run_target_sweep
    from gateway.config import load_settings
    from gateway.sim.profile import load_profiles

    config = args.config or ("config.yaml" if Path("config.yaml").exists() else None)
    routing = _routing_with(load_settings(config).routing, args.routing)
    pair = load_profiles(args.profiles, hardware=args.hardware)
    plans = _plans(args, levels, sim=True)
    targets = _targets(args, pair)
    progress = Progress(enabled=not args.no_progress)
    progress.start("virtual sweep", len(plans) * len(targets))
    turn_log: dict[str, list[list[Any]]] = {}
    results = run_target_sweep(lambda: make_workload(args.workload, args.seed, args.max_tokens), plans,
                               routing, targets, shared_device=not args.separate_devices, seed=args.seed,
                               progress=lambda *_: progress.advance(),
                               accept_drop=_accept_drop(args.accept_drop),
                               carry_learning=args.carry_learning,
                               workload_key=(args.workload, args.max_tokens), turn_log=turn_log)
    progress.finish()
    meta = {"mode": "virtual time (simulator, no HTTP)", "workload": args.workload,
            "method": _method(plans), "routing": routing.model_dump(mode="json"),
            "hardware": HARDWARE[args.hardware].label, "running_caps": caps(targets),
            "profiles": args.profiles or "packaged default", "shared_device": not args.separate_devices,
            "seed": args.seed, "max_tokens": args.max_tokens, "accept_drop": args.accept_drop,
            "carry_learning": args.carry_learning, "memory": args.memory,
            "turn_cost_s": args.turn_cost, "turn_cost_to_s": _turn_costs_to(targets),
            "turns_crossover": _crossovers(targets, args, routing),
            "turns_gain_per_crossover": _gains(targets, args, routing),
            "turns": {name: [len(level) for level in levels] for name, levels in turn_log.items()}}
    return results, meta


def _turn_costs(text: str) -> list[float]:
    try:
        costs = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--turn-cost takes seconds separated by commas, got {text!r}") from exc
    if not costs or any(c < 0 for c in costs):
        raise ValueError("--turn-cost takes seconds >= 0")
    return costs


def _targets(args: argparse.Namespace, pair: Any) -> list[Any]:
    """The targets asked for, each turns target once per --turn-cost."""
    import dataclasses

    from gateway.bench.targets import build_targets
    from gateway.bench.turns_virtual import TurnModel

    names = list(dict.fromkeys([*(args.target or []), *(POLICY_TARGETS[p] for p in args.policy or [])]))
    names = names or list(default_targets(args.memory))
    costs = _turn_costs(args.turn_cost)
    store_gb = args.turns_store_gb
    built = [build_targets(names, args.hardware, pair,
                           turn=TurnModel(cost_s=cost, crossover=args.turns_crossover,
                                          payback_turns=args.turns_payback,
                                          store=args.turns_store,
                                          l3_capacity_bytes=None if store_gb is None else store_gb * 1e9))
             for cost in costs]
    targets = []
    for i, target in enumerate(built[0]):
        if target.turns is None:
            targets.append(target)
            continue
        for cost, by_cost in zip(costs, built, strict=True):
            name = target.name if len(costs) == 1 else f"{target.name}@{cost:g}s"
            targets.append(dataclasses.replace(by_cost[i], name=name))
    return targets


def _turn_costs_to(targets: list[Any]) -> dict[str, dict[str, float]]:
    """The turns targets whose turn costs their own (a vLLM pair's sleep + wake), per direction."""
    return {t.name: dict(t.turns.cost_to) for t in targets if t.turns is not None and t.turns.cost_to}


def _turn_cost_said(targets: list[Any], args: argparse.Namespace) -> str:
    own = "".join(f"; {name}'s " + ", ".join(f"{cost:g} s to {role}" for role, cost in costs.items())
                  for name, costs in _turn_costs_to(targets).items())
    return f"{args.turn_cost} s{own}"


def _calibrations(targets: list[Any], args: argparse.Namespace, routing: Routing) -> dict[str, Any]:
    """Each turns target's crossover and plain's gain past it, as its turns decide on them."""
    from gateway.bench.targets import turns_calibration

    factory = lambda: make_workload(args.workload, args.seed, args.max_tokens)  # noqa: E731
    return {t.name: turns_calibration(t, factory, routing, seed=args.seed,
                                      workload_key=(args.workload, args.max_tokens))
            for t in targets if t.turns is not None}


def _crossovers(targets: list[Any], args: argparse.Namespace, routing: Routing) -> dict[str, int]:
    return {name: c.crossover for name, c in _calibrations(targets, args, routing).items()}


def _gains(targets: list[Any], args: argparse.Namespace, routing: Routing) -> dict[str, float]:
    return {name: round(c.gain_per_crossover, 3) for name, c in _calibrations(targets, args, routing).items()}


def _run_schedule(args: argparse.Namespace) -> int:
    import json

    from gateway.bench import schedule
    from gateway.bench.turns_virtual import parse_schedule
    from gateway.config import load_settings
    from gateway.sim.profile import load_profiles

    phases = parse_schedule(args.schedule)
    config = args.config or ("config.yaml" if Path("config.yaml").exists() else None)
    routing = _routing_with(load_settings(config).routing, args.routing)
    targets = _targets(args, load_profiles(args.profiles, hardware=args.hardware))
    progress = Progress(enabled=not args.no_progress)
    progress.start("virtual schedule", len(targets))
    results = schedule.run_schedule(lambda: make_workload(args.workload, args.seed, args.max_tokens),
                                    phases, routing, targets, seed=args.seed,
                                    workload_key=(args.workload, args.max_tokens),
                                    progress=lambda _: progress.advance())
    progress.finish()
    print(f"## bench: {args.workload} workload, schedule {args.schedule}, virtual time\n")
    print(f"Hardware: {HARDWARE[args.hardware].label}; turns crossover "
          f"{_crossovers(targets, args, routing) or '–'} (plain's gain per crossover past it "
          f"{_gains(targets, args, routing) or '–'}); turn cost {_turn_cost_said(targets, args)}.\n")
    print(schedule.markdown(results, phases))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "meta": {"command": "mtp-gateway bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
                     "schedule": args.schedule, "workload": args.workload,
                     "hardware": HARDWARE[args.hardware].label, "turn_cost_s": args.turn_cost,
                     "turn_cost_to_s": _turn_costs_to(targets),
                     "turns_crossover": _crossovers(targets, args, routing),
                     "turns_gain_per_crossover": _gains(targets, args, routing),
                     "routing": routing.model_dump(mode="json")},
            "results": [r.to_dict() for r in results]}, indent=2) + "\n", encoding="utf-8")
    return 0


def _routing_with(routing: Routing, overrides: list[str]) -> Routing:
    data = routing.model_dump()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in data:
            raise ValueError(f"--routing takes KEY=VALUE with a key of the routing section, got {item!r}")
        data[key] = yaml.safe_load(value)
    try:
        return build_routing(data)
    except ConfigError as exc:
        raise ValueError(str(exc)) from exc


def _accept_drop(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        before, after = (float(part) for part in text.split(":"))
    except ValueError as exc:
        raise ValueError(f"--accept-drop takes BEFORE:AFTER probabilities, got {text!r}") from exc
    if not (0 <= before <= 1 and 0 <= after <= 1):
        raise ValueError("--accept-drop probabilities must be within [0, 1]")
    return before, after


def _run_http(args: argparse.Namespace,
              levels: list[int]) -> tuple[dict[str, list[LevelResult]], dict[str, Any]]:
    from gateway.bench.loadgen import Target, parse_target, run_http_sweep

    targets = [parse_target(s) for s in args.compare] if args.compare else [Target("target", args.url)]
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("--compare names must be distinct")
    plans = _plans(args, levels, sim=False)
    progress = Progress(enabled=not args.no_progress)
    results = asyncio.run(run_http_sweep(
        targets, lambda: make_workload(args.workload, args.seed, args.max_tokens), plans,
        model=args.model, api_key=args.api_key, progress=progress,
        speed=args.speed))
    meta = {"mode": "HTTP", "targets": {t.name: t.url for t in targets}, "workload": args.workload,
            "method": _method(plans), "seed": args.seed, "max_tokens": args.max_tokens,
            "speed": args.speed}
    return results, meta


def _output(args: argparse.Namespace, results: dict[str, list[LevelResult]], meta: dict[str, Any]) -> None:
    meta = {"command": "mtp-gateway bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
            if sys.argv[1:2] == ["bench"] else None, **meta}
    print(f"## bench: {meta['workload']} workload, {meta['mode']}\n")
    print(f"Method: {meta['method']}.\n")
    if meta.get("hardware"):
        caps = "; ".join(f"{t} {', '.join(f'{b} {c}' for b, c in cs.items())}"
                         for t, cs in meta["running_caps"].items())
        print(f"Hardware: {meta['hardware']}, memory from gateway/sim/memory.py. Running caps: {caps}.\n")
    print(report.markdown_table(results))
    for pair in (t for t in results if report.is_pair(t)):
        rows = report.verdict(results, pair)
        if rows and len(results) > 1:
            print(f"\nThe pair ({pair}) against the best single server at each level:\n")
            print(report.verdict_table(rows, pair))
    if len(results) > 1:
        print("\nRatios against the best static target at each level (1.00 = as good as it):\n")
        print(report.ratios_table(report.ratios(results), list(results)))
    if args.json:
        report.write_json(args.json, results, meta)
        print(f"\nJSON: {args.json}", file=sys.stderr)
    if args.plot:
        title = f"{meta['workload']} workload — {meta['mode']}" + (
            f"\n{meta['hardware']}" if meta.get("hardware") else "")
        if report.plot(args.plot, results, title, with_queueing=bool(meta.get("hardware"))):
            print(f"plot: {args.plot}", file=sys.stderr)
        else:
            print("plot skipped: matplotlib is not installed (pip install 'mtp-gateway[plot]')",
                  file=sys.stderr)


# --- open loop ----------------------------------------------------------------------------------

def _run_open(args: argparse.Namespace) -> int:
    try:
        workload, runs, meta = _open_setup(args)
        if args.sim:
            results, more = _run_open_sim(args, workload, runs, meta["workload"])
        else:
            results, more = _run_open_http(args, workload, runs)
    except (ValueError, OSError) as exc:
        print(f"mtp-gateway bench: {exc}", file=sys.stderr)
        return 2
    _output_open(args, results, {**meta, **more})
    return 0


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"a rate takes numbers per second separated by commas, got {text!r}") from exc
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("a rate must be > 0 (inf: all at once)")
    return rates


def _single_requests(workload: Workload) -> bool:
    """Script 0 is one Send of one request and nothing after it (so one arrival = one request)."""
    script = workload.script(0)
    try:
        action = next(script)
        if not isinstance(action, Send) or len(action.jobs) != 1:
            return False
        script.send([Outcome(1)])
    except StopIteration:
        return True
    finally:
        script.close()
    return False


def _open_setup(args: argparse.Namespace) -> tuple[Workload, list[OpenLoop], dict[str, Any]]:
    """The workload (or trace) and its open-loop runs: one per rate, or the trace's times."""
    refused = [flag for flag, given in (
        ("--concurrency", args.concurrency != ",".join(map(str, DEFAULT_LEVELS))),
        ("--requests-per-level", args.requests_per_level is not None), ("--makespan", args.makespan),
        ("--warmup", args.warmup is not None), ("--schedule", args.schedule),
        ("--accept-drop", args.accept_drop), ("--carry-learning", args.carry_learning)) if given]
    if refused:
        raise ValueError(f"{', '.join(refused)}: closed-loop options, not for an open loop "
                         "(--request-rate, --session-rate, --trace)")
    if args.requests is not None and args.requests < 1:
        raise ValueError("--requests must be >= 1")
    if args.duration is not None and not args.duration > 0:
        raise ValueError("--duration must be > 0")
    rate_text = args.request_rate or args.session_rate
    rates = _rates(rate_text) if rate_text else None
    scaled = args.trace_time_scale != 1.0 or args.trace_rate_scale != 1.0
    if scaled and not args.trace:
        raise ValueError("--trace-time-scale and --trace-rate-scale need --trace")
    workload, name = workload_or_trace(args.workload, args.trace, args.trace_format, seed=args.seed,
                                       max_tokens=args.max_tokens, time_scale=args.trace_time_scale,
                                       rate_scale=args.trace_rate_scale)
    if isinstance(workload, Trace):
        trace, unit = workload, workload.unit
        if trace.times is not None:
            if rates is not None or args.burstiness != 1.0:
                raise ValueError(f"the {trace.format} trace has its own arrival times: no --request-rate, "
                                 "--session-rate or --burstiness (scale them with --trace-time-scale, "
                                 "--trace-rate-scale)")
            times = [t for t in trace.times if args.duration is None or t < args.duration]
            times = times[:args.requests] if args.requests is not None else times
            scale = args.trace_time_scale / args.trace_rate_scale
            label = "the trace's times" + (f" x{scale:g}" if scale != 1.0 else "")
            if not times:
                raise ValueError("no arrival of the trace within --duration")
            runs = [OpenLoop(tuple(times), unit, label, None, args.max_in_flight)]
            return workload, runs, _open_meta(args, name, runs)
        if scaled:
            raise ValueError(f"the {trace.format} trace has no timestamps to scale: give a rate instead")
        wanted = "--session-rate" if unit == "session" else "--request-rate"
        given = "--session-rate" if args.session_rate else "--request-rate" if args.request_rate else None
        if given is not None and given != wanted:
            raise ValueError(f"the {trace.format} trace's arrivals are {unit}s: give {wanted}")
        count: int | None = args.requests or len(trace)
        rates = rates or [math.inf]  # bench_serving's default --request-rate inf: all at once
    else:
        unit = "session" if args.session_rate else "request"
        if unit == "request" and not _single_requests(workload):
            raise ValueError(f"--request-rate sends one request per arrival, and the {name}'s "
                             "scripts are sessions of several requests: give --session-rate")
        count = args.requests if args.requests is not None else (
            None if args.duration is not None else OPEN_DEFAULT_ARRIVALS)
        assert rates is not None
    runs = []
    for rate in rates:
        times = arrival_times(rate, burstiness=args.burstiness, seed=args.seed, count=count,
                              duration_s=None if math.isinf(rate) else args.duration)
        if not times:
            raise ValueError("no arrival within the bound")
        runs.append(OpenLoop(tuple(times), unit, poisson_label(rate, args.burstiness, unit), rate,
                             args.max_in_flight))
    return workload, runs, _open_meta(args, name, runs)


def _open_meta(args: argparse.Namespace, name: str, runs: list[OpenLoop]) -> dict[str, Any]:
    unit = runs[0].unit
    bound = (f"arrivals before {args.duration:g} s" if args.duration is not None
             else f"{', '.join(str(len(r.times)) for r in runs)} arrivals")
    method = (f"open loop: {'; '.join(r.label for r in runs)}; {bound}; every request's TTFT and e2e "
              f"count from its scheduled arrival (time queued at the client, the gateway and the server "
              f"included); offered = the arrivals' rate, achieved = the rate they completed at; at most "
              f"{args.max_in_flight} {unit}s in flight, later arrivals wait at the client")
    return {"workload": name, "method": method, "open_loop": True, "unit": unit,
            "runs": [{"label": r.label, "rate": r.rate, "arrivals": len(r.times)} for r in runs],
            "burstiness": args.burstiness, "max_in_flight": args.max_in_flight, "seed": args.seed,
            "max_tokens": args.max_tokens, "trace": args.trace,
            "trace_time_scale": args.trace_time_scale, "trace_rate_scale": args.trace_rate_scale}


def _run_open_sim(args: argparse.Namespace, workload: Workload, runs: list[OpenLoop], name: str,
                  ) -> tuple[dict[str, list[OpenLoopResult]], dict[str, Any]]:
    from gateway.bench.targets import caps, run_target_open, turns_calibration
    from gateway.config import load_settings
    from gateway.sim.profile import load_profiles

    config = args.config or ("config.yaml" if Path("config.yaml").exists() else None)
    routing = _routing_with(load_settings(config).routing, args.routing)
    targets = _targets(args, load_profiles(args.profiles, hardware=args.hardware))
    key = ("open", name, args.seed, args.max_tokens, args.trace_format)
    progress = Progress(enabled=not args.no_progress)
    progress.start("virtual open loop", len(runs) * len(targets))
    turn_log: dict[str, list[list[Any]]] = {}
    results = run_target_open(lambda: workload, runs, routing, targets,
                              shared_device=not args.separate_devices, seed=args.seed,
                              progress=lambda _: progress.advance(), workload_key=key, turn_log=turn_log)
    progress.finish()
    closed = closed_loop(workload)
    crossovers = {t.name: turns_calibration(t, lambda: closed, routing, seed=args.seed,
                                            workload_key=key).crossover
                  for t in targets if t.turns is not None}
    return results, {
        "mode": "virtual time (simulator, no HTTP)", "routing": routing.model_dump(mode="json"),
        "hardware": HARDWARE[args.hardware].label, "running_caps": caps(targets),
        "profiles": args.profiles or "packaged default", "shared_device": not args.separate_devices,
        "memory": args.memory, "turn_cost_s": args.turn_cost, "turns_crossover": crossovers,
        "turns": {n: [len(run) for run in per_run] for n, per_run in turn_log.items()}}


def _run_open_http(args: argparse.Namespace, workload: Workload, runs: list[OpenLoop],
                   ) -> tuple[dict[str, list[OpenLoopResult]], dict[str, Any]]:
    from gateway.bench.loadgen import Target, parse_target, run_http_open_sweep

    targets = [parse_target(s) for s in args.compare] if args.compare else [Target("target", args.url)]
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("--compare names must be distinct")
    progress = Progress(enabled=not args.no_progress)
    results = asyncio.run(run_http_open_sweep(targets, lambda: workload, runs, model=args.model,
                                              api_key=args.api_key, progress=progress, speed=args.speed))
    return results, {"mode": "HTTP", "targets": {t.name: t.url for t in targets}, "speed": args.speed}


def _output_open(args: argparse.Namespace, results: dict[str, list[OpenLoopResult]],
                 meta: dict[str, Any]) -> None:
    meta = {"command": "mtp-gateway bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
            if sys.argv[1:2] == ["bench"] else None, **meta}
    print(f"## bench: {meta['workload']}, open loop, {meta['mode']}\n")
    print(f"Method: {meta['method']}.\n")
    if meta.get("hardware"):
        caps = "; ".join(f"{t} {', '.join(f'{b} {c}' for b, c in cs.items())}"
                         for t, cs in meta["running_caps"].items())
        print(f"Hardware: {meta['hardware']}, memory from gateway/sim/memory.py. Running caps: {caps}.\n")
    print(report.open_loop_table(results))
    if meta.get("turns"):
        print("\nTurns (the memory handed from one server to the other), per run: "
              + "; ".join(f"{t} {', '.join(map(str, n))}" for t, n in meta["turns"].items()) + ".")
    rows = [(target, r) for target, rs in results.items() for r in rs]
    short = [f"- {t}, {r.label}: {r.level.output_tokens:,.0f} / {r.output_asked:,}"
             for t, r in rows if r.level.output_tokens != r.output_asked]
    if short:
        print("\nOutput tokens received / asked where they differ (requests cut short or failed):\n")
        print("\n".join(short))
    else:
        print("\nOutput tokens: every run received exactly the max_tokens its requests asked for "
              "(ignore_eos).")
    if meta["mode"] == "HTTP":
        print("Prompt tokens as the servers' usage reported them: " + "; ".join(
            f"{t}, {r.label}: {'–' if r.prompt_tokens_reported is None else f'{r.prompt_tokens_reported:,}'}"
            for t, r in rows) + ".")
    if args.json:
        report.write_open_json(args.json, results, meta)
        print(f"\nJSON: {args.json}", file=sys.stderr)
    if args.plot:
        print("--plot draws closed-loop levels; an open loop has none (see the table)", file=sys.stderr)
