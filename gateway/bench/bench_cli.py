"""`mtp-gateway bench`: closed-loop concurrency sweeps over HTTP, or in the simulator's virtual time.

    mtp-gateway bench --url http://127.0.0.1:8000 --workload chat --json out.json --plot out.png
    mtp-gateway bench --compare mtp=http://:30001 plain=http://:30002 gateway=http://:8000
    mtp-gateway bench --sim --workload agentic --hardware h200
        # the pair against one plain, one MTP and one adaptive server owning the GPUs (and,
        # with --memory turns, the tuned single MTP servers)
    mtp-gateway bench --sim --memory turns --schedule 4:600,64:600,16:600,128:600,2:600
    mtp-gateway bench --sim --target pair-turns --turn-cost 0.5,1.5,5,15
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from gateway.bench import report
from gateway.bench.levels import DEFAULT_LEVELS, LevelPlan, parse_levels, plan_levels
from gateway.bench.progress import Progress
from gateway.bench.stats import LevelResult
from gateway.bench.targets import ALL_TARGETS, DEFAULT_MEMORY, POLICY_TARGETS, default_targets
from gateway.bench.workloads import WORKLOADS, make_workload
from gateway.config import ConfigError, Routing, build_routing
from gateway.sim.memory import DEFAULT_HARDWARE, HARDWARE
from gateway.sim.speed import add_speed_argument

SIM_DURATION_S = 150.0
SIM_WARMUP_S = 50.0


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
    parser.add_argument("--workload", default="seed",
                        help=f"{' | '.join(WORKLOADS)} | file:PATH.jsonl (default %(default)s)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--requests-per-level", type=int, metavar="N",
                      help="makespan method: N requests per level (default over HTTP: 3 per client)")
    size.add_argument("--makespan", action="store_true",
                      help="makespan method, the seed's: all clients start together, 3 requests each")
    size.add_argument("--duration", type=float, metavar="S",
                      help=f"steady method: keep the level busy S seconds (--sim default {SIM_DURATION_S:g})")
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
    sim.add_argument("--turns-crossover", type=int, metavar="N",
                     help="the load at which the turns hand the memory to plain (default: "
                          "calibrated on the workload: where plain alone overtakes MTP alone)")
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


def run(args: argparse.Namespace) -> int:
    chosen = sum(bool(x) for x in (args.url, args.compare, args.sim))
    if chosen != 1:
        print("mtp-gateway bench: give exactly one of --url, --compare, --sim", file=sys.stderr)
        return 2
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
            "turn_cost_s": args.turn_cost, "turns_crossover": _crossovers(targets, args, routing),
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
    built = [build_targets(names, args.hardware, pair,
                           turn=TurnModel(cost_s=cost, crossover=args.turns_crossover)) for cost in costs]
    targets = []
    for i, target in enumerate(built[0]):
        if target.turns is None:
            targets.append(target)
            continue
        for cost, by_cost in zip(costs, built, strict=True):
            name = target.name if len(costs) == 1 else f"{target.name}@{cost:g}s"
            targets.append(dataclasses.replace(by_cost[i], name=name))
    return targets


def _crossovers(targets: list[Any], args: argparse.Namespace, routing: Routing) -> dict[str, int]:
    from gateway.bench.targets import turns_crossover

    factory = lambda: make_workload(args.workload, args.seed, args.max_tokens)  # noqa: E731
    return {t.name: turns_crossover(t, factory, routing, seed=args.seed,
                                    workload_key=(args.workload, args.max_tokens))
            for t in targets if t.turns is not None}


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
          f"{_crossovers(targets, args, routing) or '–'}; turn cost {args.turn_cost} s.\n")
    print(schedule.markdown(results, phases))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "meta": {"command": "mtp-gateway bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
                     "schedule": args.schedule, "workload": args.workload,
                     "hardware": HARDWARE[args.hardware].label, "turn_cost_s": args.turn_cost,
                     "turns_crossover": _crossovers(targets, args, routing),
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
