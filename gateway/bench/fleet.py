"""A fleet in virtual time: gateway replicas in front of simulated pairs, through the real pool.

Each *pair* is an MTP and a plain simulated server on a device of their own (they share it, as
the real pair shares its GPUs; pairs do not share). Each *replica* is a `gateway.routing.pool.Pool` of
its own: its own in-flight counts, its own mode per pair, and, every `loads_interval_s` (its
polls spread over the interval, as independent processes would be), a `/v1/loads` reading of
every backend: running + waiting as the engine has them at that instant. Client sessions are
split evenly over the replicas (script k goes to replica k mod R, like a round-robin load
balancer). Placement, modes, sessions and leases are the production code's
(`Pool.admit`, `Lease.end`); only the clock and the HTTP are replaced.

    python -m gateway.bench.fleet --workload seed --staleness 0.25,1,3 \\
        --json lab/results/fleet/fleet-seed.json --markdown lab/results/fleet/fleet-seed.md \
        --plot lab/results/fleet/fleet.png

Every figure is deterministic: the same arguments give the same numbers bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gateway.bench.flights import Flights, drive_script
from gateway.bench.levels import LevelPlan, parse_levels, plan_levels
from gateway.bench.stats import LevelResult, RequestRecord, summarise
from gateway.bench.workloads import Job, Outcome, Workload, make_workload
from gateway.config import Backend, Routing, load_settings
from gateway.routing.pool import Ask, Lease, PairSpec, Pool
from gateway.sim.profile import Profile, load_profiles, seed_profiles
from gateway.sim.virtual import VirtualSim

# The monitor reads /server_info (MTP's accept length) every few rounds of monitor.interval_s.
ACCEPT_REFRESH_S = 5.0
LEVELS = (1, 8, 16, 32, 64, 128, 256)
DURATION_S, WARMUP_S = 150.0, 50.0


@dataclass(frozen=True)
class Setup:
    """A fleet: how many pairs, how many gateway replicas, how often they read /v1/loads."""

    name: str
    pairs: int
    replicas: int
    loads_interval_s: float | None = 1.0  # None: each replica routes on its own counts alone

    @property
    def loads_max_age_s(self) -> float:
        # As monitor.backend_loads_max_age_s (3 s) is to monitor.interval_s (1 s).
        return 3.0 * (self.loads_interval_s or 1.0)


ONE_PAIR = Setup("1 gateway, 1 pair", pairs=1, replicas=1)
ONE_GATEWAY = Setup("1 gateway, 2 pairs", pairs=2, replicas=1)


def replicas_setup(interval_s: float | None) -> Setup:
    if interval_s is None:
        return Setup("2 gateways, 2 pairs, own counts only", 2, 2, None)
    return Setup(f"2 gateways, 2 pairs, /v1/loads every {interval_s:g} s", 2, 2, interval_s)


def engine_name(pair: str, role: str) -> str:
    return f"{pair}/{role}"


def _pool(setup: Setup, routing: Routing, profiles: Mapping[str, Profile]) -> Pool:
    specs = [PairSpec(f"p{k}", Backend(url=f"http://sim/p{k}/mtp"),
                      Backend(url=f"http://sim/p{k}/plain"), routing) for k in range(setup.pairs)]
    pool = Pool(specs, now=0.0, use_backend_loads=setup.loads_interval_s is not None,
                loads_max_age_s=setup.loads_max_age_s, max_sessions=routing.max_sessions)
    for backend in pool.backends.values():  # what the monitor reads from /server_info
        backend.record_server_info(profiles[backend.role].effective_max_running, None)
    return pool


def run_fleet_level(workload: Workload, plan: LevelPlan, routing: Routing,
                    profiles: Mapping[str, Profile], setup: Setup, *, seed: int = 0,
                    ramp_s: float = 0.0) -> tuple[list[RequestRecord], float]:
    """Run one level on one fleet; returns every request's record and the level's wall time.
    The level's client slots start together, or spread evenly over `ramp_s`."""
    pair_names = [f"p{k}" for k in range(setup.pairs)]
    engines = {engine_name(p, role): profiles[role] for p in pair_names for role in ("mtp", "plain")}
    sim = VirtualSim(engines, seed=seed, devices={name: name.split("/")[0] for name in engines})
    pools = [_pool(setup, routing, profiles) for _ in range(setup.replicas)]
    records: list[RequestRecord] = []
    flights = Flights(sim, lambda backend: engine_name(backend.pair, backend.role))
    counters = {"started": 0, "scripts": 0}

    def busy() -> bool:
        return bool(flights.live) or plan.budget_left(counters["started"], sim.now)

    def read_loads(pool: Pool) -> None:
        for backend in pool.backends.values():
            engine = sim.engines[engine_name(backend.pair, backend.role)]
            backend.record_loads(engine.num_running, engine.num_waiting, sim.now)
        if busy() and setup.loads_interval_s is not None:
            sim.at(sim.now + setup.loads_interval_s, lambda: read_loads(pool))

    def read_accept_length() -> None:
        for pool in pools:
            for backend in pool.backends.values():
                engine = sim.engines[engine_name(backend.pair, backend.role)]
                if engine.profile.speculative:
                    backend.record_server_info(backend.effective_cap,
                                               engine.stats.avg_spec_accept_length or None)
        if busy():
            sim.at(sim.now + ACCEPT_REFRESH_S, read_accept_length)

    def next_script() -> None:
        if not plan.budget_left(counters["started"], sim.now):
            return
        index = counters["scripts"]
        counters["scripts"] += 1
        pool = pools[index % len(pools)]
        drive_script(sim, workload.script(index), lambda job, done: send(pool, job, done), next_script)

    def send(pool: Pool, job: Job, done: Callable[[Outcome], None]) -> None:
        counters["started"] += 1
        record = RequestRecord(start=sim.now)
        records.append(record)
        admitted = pool.admit(Ask(session=job.session), sim.now)
        if not isinstance(admitted, Lease):
            record.error, record.end = "no_backend", sim.now
            done(Outcome(0, error="no_backend"))
            return
        flights.start(job, admitted, record, done)
        flights.apply_moves(admitted.flip)

    sim.at(0.0, read_accept_length)
    if setup.loads_interval_s is not None:
        for r, pool in enumerate(pools):  # independent processes: polls spread over the interval
            sim.at(setup.loads_interval_s * r / len(pools), partial(read_loads, pool))
    for slot in range(plan.concurrency):
        sim.at(ramp_s * slot / plan.concurrency, next_script)
    sim.run_until_idle()
    wall = max((r.end for r in records if r.end is not None), default=0.0)
    return records, wall


def run_fleet_sweep(workload_factory: Callable[[], Workload], plans: Sequence[LevelPlan],
                    routing: Routing, profiles: Mapping[str, Profile], setups: Sequence[Setup],
                    *, seed: int = 0, ramp_s: float = 0.0,
                    progress: Callable[[str, int], None] | None = None,
                    ) -> dict[str, list[LevelResult]]:
    """Every setup over every level; results by setup name."""
    results: dict[str, list[LevelResult]] = {s.name: [] for s in setups}
    for plan in plans:
        for setup in setups:
            records, wall = run_fleet_level(workload_factory(), plan, routing, profiles, setup,
                                            seed=seed, ramp_s=ramp_s)
            results[setup.name].append(summarise(setup.name, plan.concurrency, records, wall,
                                                 plan.window))
            if progress:
                progress(setup.name, plan.concurrency)
    return results


# --- the report ------------------------------------------------------------------------------


def ratios(results: Mapping[str, list[LevelResult]], over: str,
           under: str) -> list[tuple[int, float]]:
    """Aggregate tok/s of `over` / `under`, level by level."""
    return [(a.concurrency, a.aggregate_tps / b.aggregate_tps)
            for a, b in zip(results[over], results[under], strict=True)]


def markdown(results: Mapping[str, list[LevelResult]], workload: str, command: str) -> str:
    names = list(results)
    levels = [r.concurrency for r in results[names[0]]]
    lines = [f"# Fleet in virtual time: `{workload}` workload", "", "```sh", command, "```", "",
             "Aggregate output tok/s (steady window; p0, p1 = the pairs):", "",
             "| setup | " + " | ".join(f"C={c}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for name in names:
        cells = [f"{r.aggregate_tps:,.0f}" for r in results[name]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios of aggregate tok/s:", "",
              "| ratio | " + " | ".join(f"C={c}" for c in levels) + " |",
              "|---|" + "---|" * len(levels)]
    for name in names:
        if name in (ONE_GATEWAY.name, ONE_PAIR.name):
            continue
        cells = [f"{x:.3f}" for _, x in ratios(results, name, ONE_GATEWAY.name)]
        lines.append(f"| {name} / {ONE_GATEWAY.name} | " + " | ".join(cells) + " |")
    if ONE_PAIR.name in results and ONE_GATEWAY.name in results:
        cells = [f"{x:.3f}" for _, x in ratios(results, ONE_GATEWAY.name, ONE_PAIR.name)]
        lines.append(f"| {ONE_GATEWAY.name} / {ONE_PAIR.name} | " + " | ".join(cells) + " |")
    lines += ["", "Where the requests ran (share of requests per server):", ""]
    for name in names:
        shares = "; ".join(f"C={r.concurrency}: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                               r.share.items())
                           for r in results[name])
        lines.append(f"- {name}: {shares}")
    errors = sum(r.errors for rs in results.values() for r in rs)
    lines += ["", f"Errors: {errors}.", ""]
    return "\n".join(lines)


def plot(per_workload: Mapping[str, Mapping[str, list[LevelResult]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(per_workload), figsize=(6.5 * len(per_workload), 4.5),
                             squeeze=False)
    for ax, (workload, results) in zip(axes[0], per_workload.items(), strict=True):
        for name in results:
            if name in (ONE_GATEWAY.name, ONE_PAIR.name):  # the baseline; one pair is far below
                continue
            points = ratios(results, name, ONE_GATEWAY.name)
            ax.plot([c for c, _ in points], [x for _, x in points], marker="o", label=name)
        ax.axhline(0.95, color="grey", linestyle="--", linewidth=1, label="target 0.95")
        ax.set_ylim(0.75, 1.05)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency C (all clients, over every replica)")
        ax.set_ylabel(f"aggregate tok/s / '{ONE_GATEWAY.name}'")
        ax.set_title(f"{workload}: 2 pairs, replicas vs one gateway")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parse_staleness(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        if part:
            out.append(None if part == "none" else float(part))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", help="seed | chat | agentic (repeatable)")
    parser.add_argument("--concurrency", default=",".join(map(str, LEVELS)))
    parser.add_argument("--staleness", default="1",
                        help="/v1/loads intervals in s for the 2-replica fleet, comma-separated; "
                             "'none' = own counts only (default %(default)s)")
    parser.add_argument("--config", default="config.yaml", help="routing section from here")
    parser.add_argument("--profiles", choices=("seed", "pair"), default="seed",
                        help="seed: the seed's calibrated caps (plain 68, MTP 24 running), which "
                             "issue 13's targets were set with; pair: each pair's own memory "
                             "(gateway.sim.memory) (default %(default)s)")
    parser.add_argument("--duration", type=float, default=DURATION_S)
    parser.add_argument("--warmup", type=float, default=WARMUP_S)
    parser.add_argument("--ramp", type=float, default=0.0, metavar="S",
                        help="client slots start spread over S seconds (default: all at once)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH", help="one file per workload: PATH with "
                        "the workload's name before the suffix when several are given")
    parser.add_argument("--plot", metavar="PATH")
    args = parser.parse_args(argv)
    workloads = args.workload or ["seed"]
    routing = load_settings(args.config if Path(args.config).exists() else None).routing
    plans = plan_levels(parse_levels(args.concurrency), duration_s=args.duration,
                        warmup_s=args.warmup)
    profiles = seed_profiles() if args.profiles == "seed" else load_profiles()
    setups = [*(replicas_setup(s) for s in _parse_staleness(args.staleness)), ONE_GATEWAY,
              ONE_PAIR]
    command = "python -m gateway.bench.fleet " + " ".join(argv if argv is not None else sys.argv[1:])
    per_workload: dict[str, dict[str, list[LevelResult]]] = {}
    for workload in workloads:
        per_workload[workload] = run_fleet_sweep(
            partial(make_workload, workload), plans, routing, profiles, setups,
            ramp_s=args.ramp, progress=lambda name, c: print(f"{name} C={c}", file=sys.stderr))
        text = markdown(per_workload[workload], workload, command)
        if args.markdown:
            path = Path(args.markdown)
            if len(workloads) > 1:
                path = path.with_name(f"{path.stem}-{workload}{path.suffix}")
            path.write_text(text)
        print(text)
    if args.json:
        data: dict[str, Any] = {w: {name: [r.to_dict() for r in rs] for name, rs in res.items()}
                                for w, res in per_workload.items()}
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.plot:
        plot(per_workload, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
