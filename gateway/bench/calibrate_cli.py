"""`mtp-gateway calibrate`: sweep both backends directly and find the crossover.

    mtp-gateway calibrate --mtp http://127.0.0.1:30001 --plain http://127.0.0.1:30002 \\
        --write config.yaml --profile-out my-profiles.yaml
    mtp-gateway calibrate --mtp URL --plain URL --workload agentic --write config.yaml
    mtp-gateway calibrate --mtp URL --plain URL --trace my-requests.jsonl --write config.yaml
    mtp-gateway calibrate --sim --memory turns --workload agent --duration 300 --warmup 60 \\
        --write config.yaml   # the simulated pair in virtual time, no servers

The rule is in gateway/bench/calibrate.py (find_crossover). --write changes only the values of
routing.crossover (and routing.hysteresis when it no longer fits) in the file, comments kept.
The saved profile replays the measured curves in the simulator (`mtp-gateway bench --sim
--profiles my-profiles.yaml`, `mtp-gateway sim --profiles ...`).

The crossover moves with the traffic (MTP's acceptance, the lengths, the shared prefixes), so
calibrate on yours: a workload, or a trace of your own requests, run closed-loop like a
workload: its arrival times are not used (docs/workloads.md, "Calibrating on a workload or a
trace").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from gateway.bench import report
from gateway.bench.agent import Agent
from gateway.bench.calibrate import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    PAIR_BEST,
    estimated_singles,
    find_crossover,
    fitted_pair,
    gain_past_crossover,
    pair_best,
    set_routing_values,
    suggested_hysteresis,
)
from gateway.bench.levels import SIM_DURATION_S, SIM_WARMUP_S, LevelPlan, parse_levels, plan_levels
from gateway.bench.loadgen import Target, _join, run_http_sweep
from gateway.bench.progress import Progress
from gateway.bench.stats import LevelResult
from gateway.bench.traces import FORMATS, Trace, closed_loop, workload_or_trace
from gateway.bench.workloads import WORKLOADS, Workload, make_workload
from gateway.config import Routing
from gateway.sim.memory import DEFAULT_HARDWARE, HARDWARE
from gateway.sim.profile import Profile
from gateway.sim.speed import add_speed_argument

CALIBRATE_LEVELS = "1,2,4,8,16,24,32,48,64,128"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--mtp", help="base URL of the MTP (NEXTN) server")
    parser.add_argument("--plain", help="base URL of the plain server")
    parser.add_argument("--sim", action="store_true",
                        help="instead of --mtp and --plain: the simulated pair `mtp-gateway sim "
                             "--hardware HW --memory M` would serve, in virtual time (no HTTP; "
                             f"steady levels of {SIM_DURATION_S:g} s after {SIM_WARMUP_S:g} s by default)")
    parser.add_argument("--memory", choices=("split", "turns"), default="split",
                        help="--sim: the simulated pair's memory, as `mtp-gateway sim --memory` "
                             "(default %(default)s)")
    parser.add_argument("--concurrency", default=CALIBRATE_LEVELS, help="levels (default %(default)s)")
    source = parser.add_argument_group("what the clients send (one of)")
    source.add_argument("--workload", help=f"{' | '.join(WORKLOADS)} | file:PATH.jsonl (default seed; "
                        "the crossover moves with acceptance: docs/results.md"
                        "#calibrating-against-the-simulator)")
    source.add_argument("--trace", metavar="PATH",
                        help="your own traffic instead of --workload: Mooncake's JSON lines, SGLang's "
                             "agentic trace or recorded requests (docs/workloads.md). Each level runs "
                             "its requests closed-loop, in the trace's order from its first, with their "
                             "own input and output lengths and prompts (shared prefixes stay shared); "
                             "a conversation's (or recorded x-session-id's) rounds in order on one "
                             "client; past its end it starts again. Its arrival times are not used: "
                             "the crossover is a number of requests in flight, which a closed loop "
                             "holds at each level for both servers alike, while on the trace's clock "
                             "the slower server would hold more in flight and the two would be "
                             "compared at different loads")
    source.add_argument("--trace-format", choices=FORMATS, help="the trace's format (default: detected)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--requests-per-level", type=int, metavar="N",
                      help="requests per level (default: 3 per client)")
    size.add_argument("--duration", type=float, metavar="S", help="steady method: seconds per level")
    parser.add_argument("--warmup", type=float, default=0.0, metavar="S",
                        help="steady method: seconds left out at the start of each level (needs --duration)")
    parser.add_argument("--max-tokens", type=int,
                        help="cap every request's output (quick runs; a trace's too)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model")
    parser.add_argument("--api-key")
    parser.add_argument("--config",
                        help="config whose routing.hysteresis is the starting point (default: the "
                             "--write file, else ./config.yaml)")
    parser.add_argument("--objective", choices=list(OBJECTIVES), default=DEFAULT_OBJECTIVE,
                        help="which crossing becomes routing.crossover (both are printed): aggregate, "
                             "where plain serves more tok/s in total (the default: the pair's "
                             "capacity, the figure config.yaml's default is stated in), or "
                             "per-request, where MTP's requests stop being faster for their users")
    parser.add_argument("--write", metavar="CONFIG", help="update routing.crossover in this file in place")
    parser.add_argument("--profile-out", metavar="PATH", help="save the measured curves as sim profiles")
    parser.add_argument("--hardware", choices=tuple(HARDWARE),
                        help="your GPUs: also estimate, in virtual time, what one server owning them "
                             "would do (your measured step times, that server's memory) and compare; "
                             f"--sim: the simulated pair's GPUs too (default {DEFAULT_HARDWARE})")
    parser.add_argument("--single", action="append", default=[], metavar="NAME=JSON",
                        help="a measured single server owning the GPUs to compare with (repeatable): "
                             "the JSON of `mtp-gateway bench --url URL --json JSON`, run while the "
                             "pair is stopped")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH")
    add_speed_argument(parser, reported=True)
    parser.add_argument("--no-progress", action="store_true")


async def _server_info(url: str, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(_join(url, "/server_info"), headers=headers) as resp:
                if resp.status == 200:
                    data = await resp.json()
                    return data if isinstance(data, dict) else {}
    except (TimeoutError, aiohttp.ClientError, ValueError):
        pass
    return {}


def run(args: argparse.Namespace) -> int:
    return asyncio.run(calibrate(args))


async def calibrate(args: argparse.Namespace) -> int:
    """The whole command in the running event loop (tests run it beside a simulated pair)."""
    from gateway.config import ConfigError, build_routing, load_settings
    from gateway.sim.profile import load_profiles, save_profiles
    from gateway.upstream.engine.sglang import parse_server_info

    try:
        _refuse_nonsense(args)
        levels = parse_levels(args.concurrency)
        source, name = workload_or_trace(args.workload, args.trace, args.trace_format,
                                         seed=args.seed, max_tokens=args.max_tokens)
        plans = _plans(args, levels, source)
        singles = _measured_singles(args.single)
        # the starting point, read before the sweep so that a wrong path costs no sweep
        config = args.write or args.config or ("config.yaml" if Path("config.yaml").exists() else None)
        current = load_settings(config).routing
    except (ValueError, OSError, ConfigError) as exc:
        print(f"mtp-gateway calibrate: {exc}", file=sys.stderr)
        return 2
    trace = source if isinstance(source, Trace) else None
    closed = closed_loop(source)

    def workload_factory() -> Workload:  # a workload afresh per level; a trace parsed once
        return closed if trace else make_workload(args.workload or "seed", args.seed, args.max_tokens)

    if args.sim:
        from gateway.sim.server import SimOptions

        hardware = args.hardware or DEFAULT_HARDWARE
        simulated = SimOptions(memory=args.memory, hardware=hardware).resolved_profiles()
        results = _virtual_sweep(workload_factory, plans, current, simulated)
        infos: dict[str, dict[str, Any]] = {"mtp": {}, "plain": {}}
        caps: dict[str, int | None] = {role: simulated[role].effective_max_running
                                       for role in ("mtp", "plain")}
        accept = None
        against = f"the simulated pair ({args.memory} memory, {HARDWARE[hardware].label}) in virtual time"
    else:
        targets = [Target("mtp", args.mtp), Target("plain", args.plain)]
        infos = {t.name: await _server_info(t.url, args.api_key) for t in targets}
        caps = {name: parse_server_info(info)[0] if info else None for name, info in infos.items()}
        progress = Progress(enabled=not args.no_progress)
        results = await run_http_sweep(targets, workload_factory, plans, model=args.model,
                                       api_key=args.api_key, progress=progress, speed=args.speed)
        accept = parse_server_info(infos["mtp"])[1] if infos["mtp"] else None
        after = await _server_info(args.mtp, args.api_key)  # accept length after the sweep
        accept = (parse_server_info(after)[1] if after else None) or accept
        against = f"mtp {args.mtp} vs plain {args.plain}"

    print(f"## calibrate: {name}, {against}\n")
    if trace:
        print(f"Closed loop on the trace's {trace.requests} requests in its order (arrival times not "
              "used), every level from its first.\n")
    print(report.markdown_table(results))
    repeated = [r.concurrency for r in results["mtp"] if trace and r.requests > trace.requests]
    if trace and repeated:
        print(f"\nnote: at C={', '.join(map(str, repeated))} more than the trace's {trace.requests} "
              "requests were sent: they started again from its first, and a repeated prompt finds "
              "its prefix cached")
    errors = sum(r.errors for rows in results.values() for r in rows)
    if errors:
        print(f"\nwarning: {errors} requests failed; the curves may be wrong", file=sys.stderr)
    guard = getattr(current, "capacity_guard", True)
    outcome = find_crossover(results["mtp"], results["plain"], caps["mtp"] if guard else None,
                             args.objective)
    print("\n" + outcome.explain())
    json_meta = {
        "mode": "virtual calibrate" if args.sim else "HTTP calibrate",
        "memory": args.memory if args.sim else None, "workload": None if trace else args.workload or "seed",
        "trace": args.trace, "trace_format": trace.format if trace else None, "speed": args.speed,
        "caps": caps, "accept_length": accept,
        "objective": args.objective, "aggregate_crossing": outcome.aggregate.level,
        "per_request_crossing": outcome.per_request.level,
        "crossover": outcome.crossover, "uncapped_crossover": outcome.uncapped,
        "gain_per_crossover": (gain_past_crossover(results["mtp"], results["plain"], outcome.crossover)
                               if outcome.crossover is not None else None)}
    if args.plot:
        report.plot(args.plot, results, f"calibrate: {name}")
    if args.hardware or args.profile_out:
        steps = infos["mtp"].get("speculative_num_steps")
        fitted = fitted_pair(load_profiles(), results, caps, accept, steps,
                             greedy_repetitive=not trace and args.workload in (None, "seed"))
    if args.hardware:
        singles |= estimated_singles(fitted, args.hardware, workload_factory, plans, current)
    rows = _print_verdict(results, singles, args.hardware, bool(args.single))
    if args.json:
        report.write_json(args.json, results, {**json_meta, "verdict": rows,
                                               "hardware": args.hardware, "singles": list(singles)})
    if args.profile_out:
        save_profiles(fitted, args.profile_out, comment=(
            f"Measured by `mtp-gateway calibrate` ({name}) against\n"
            f"mtp {args.mtp} and plain {args.plain}: step_ms = tokens per step * 1000 /\n"
            f"per-request tok/s at each concurrency up to the running cap (caps {caps});\n"
            f"MTP accept length {accept}. Prefill and cache fields are the packaged defaults'."))
        print(f"\nprofiles written to {args.profile_out}")
    if outcome.crossover is None:
        print("\nconfig unchanged: keep MTP at every load (or use policy: mtp-only)")
        return 0
    try:
        hysteresis = suggested_hysteresis(outcome.crossover, current.hysteresis)
        values: dict[str, int | float] = {"crossover": outcome.crossover}
        if hysteresis != current.hysteresis:
            values["hysteresis"] = hysteresis
        if accept and hasattr(current, "reference_accept_length"):
            values["reference_accept_length"] = round(accept, 2)
        build_routing({**current.model_dump(), **values})  # the new pair must validate
    except ConfigError as exc:
        print(f"mtp-gateway calibrate: {exc}", file=sys.stderr)
        return 2
    print("\nrouting:\n" + "".join(f"  {k}: {v}\n" for k, v in values.items()), end="")
    gain = json_meta["gain_per_crossover"]
    turns = {"gain_per_crossover": round(gain, 3)} if gain is not None else {}
    if turns:  # how fast plain pulls ahead past it: how long a turn that loses caches waits
        print("turns:\n" + "".join(f"  {k}: {v}\n" for k, v in turns.items()), end="")
    if args.write:
        path = Path(args.write)
        try:
            text = set_routing_values(path.read_text(encoding="utf-8"), values)
            path.write_text(set_routing_values(text, turns, "turns") if turns else text, encoding="utf-8")
            load_settings(path)
        except (OSError, ValueError, ConfigError) as exc:
            print(f"mtp-gateway calibrate: cannot update {path}: {exc}", file=sys.stderr)
            return 2
        print(f"written to {path} (the {args.objective} crossing)")
    else:
        print("not written: pass --write CONFIG to update routing.crossover")
    return 0


def _virtual_sweep(workload_factory: Callable[[], Workload], plans: Sequence[LevelPlan], routing: Routing,
                   profiles: Mapping[str, Profile]) -> dict[str, list[LevelResult]]:
    """Each of the simulated pair's servers alone over every level, in virtual time."""
    from gateway.bench.virtual import run_virtual_sweep

    swept = run_virtual_sweep(workload_factory, plans, routing, profiles,
                              policies=("mtp-only", "plain-only"))
    return {role: [replace(r, target=role) for r in swept[f"{role}-only"]] for role in ("mtp", "plain")}


def _plans(args: argparse.Namespace, levels: list[int], source: Workload) -> list[LevelPlan]:
    """The levels' plans; --sim's default is bench --sim's steady method. Agent sessions wait
    minutes to hours for their users between requests, and a makespan level runs every session
    it starts to its end: its tok/s would be the users' waits, the same for both servers."""
    duration, warmup = args.duration, args.warmup
    if args.sim and duration is None and args.requests_per_level is None:
        duration, warmup = SIM_DURATION_S, warmup or SIM_WARMUP_S
    if isinstance(source, Agent) and duration is None:
        raise ValueError("the agent workload needs --duration S (the steady method): its sessions wait "
                         "minutes to hours for their users, and a makespan level, which runs every "
                         "session it starts to its end, would measure those waits, not the servers")
    return plan_levels(levels, args.requests_per_level, duration, warmup)


def _refuse_nonsense(args: argparse.Namespace) -> None:
    """Flags that mean nothing together, or nothing at all, refused with a one-line reason (the
    workload and the trace: workload_or_trace)."""
    urls = (args.mtp, args.plain)
    if (args.sim and any(urls)) or (not args.sim and not all(urls)):
        raise ValueError("give --mtp URL and --plain URL (your servers), or --sim (the simulated pair)")
    if args.memory != "split" and not args.sim:
        raise ValueError("--memory is the simulated pair's (--sim); your servers' memory is theirs")
    if args.warmup and args.duration is None:
        raise ValueError("--warmup needs --duration: a makespan level (the default) counts all of it")
    if args.requests_per_level is not None and args.requests_per_level < 1:
        raise ValueError("--requests-per-level must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if args.config and args.write and Path(args.config).resolve() != Path(args.write).resolve():
        raise ValueError("--config and --write name different files: the file --write updates is "
                         "also the starting point; give one of them")


def _measured_singles(specs: list[str]) -> dict[str, list[LevelResult]]:
    """``NAME=JSON`` files of `bench --url` runs: each file's first target, named NAME."""
    from gateway.bench.headline import load

    singles = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--single takes NAME=JSON, got {spec!r}")
        _, results = load(path)
        if not results:
            raise ValueError(f"{path}: no results")
        singles[name] = [replace(r, target=name) for r in next(iter(results.values()))]
    return singles


def _print_verdict(results: Mapping[str, Sequence[LevelResult]], singles: Mapping[str, Sequence[LevelResult]],
                   hardware: str | None, measured: bool) -> list[dict[str, Any]]:
    """The pair (its better server at each level) against single servers owning the GPUs."""
    if not singles:
        print("\nagainst one server owning the GPUs: pass --hardware (an estimate) or --single "
              "NAME=JSON (a measurement) to compare")
        return []
    source = []
    if measured:
        source.append("measured (--single)")
    if hardware:
        source.append(f"estimated in virtual time for {HARDWARE[hardware].label}: your measured step "
                      "times with the memory of one server owning the GPUs (gateway/sim/memory.py); "
                      "batches above the pair's caps follow the last measured segment")
    rows = report.verdict({PAIR_BEST: pair_best(results["mtp"], results["plain"]), **singles}, pair=PAIR_BEST)
    print("\n## The pair against one server owning the GPUs\n")
    print("Single servers: " + "; ".join(source) + ". The pair: its better server at each level, each "
          "measured alone (an upper bound for the gateway: switching and time-slicing cost more).\n")
    print(report.verdict_table(rows, pair_label="pair"))
    return rows
