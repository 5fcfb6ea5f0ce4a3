"""What ``bench --sim`` compares: the pair through the gateway against the servers a user would
otherwise run, each with the memory it would really have (gateway.sim.memory).

- ``gateway``: MTP and plain sharing the GPUs (the compose split), routed by the config;
- ``single-plain``, ``single-mtp``, ``single-adaptive``: ONE server owning the GPUs (one copy of
  the weights, all of the memory): plain, MTP (the pair's MTP flags), or MTP with
  ``--speculative-adaptive`` (SGLang 0.5.23's default tiers);
- ``pair-mtp-only``, ``pair-plain-only``: the pair's own servers with a static policy (the old
  "mtp-only" / "plain-only" baselines; on request).

A single server runs through the same virtual gateway with a static policy; the pair's other
server is present but never receives a request, so it never takes a turn on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.adaptive import CrossoverEstimator
from gateway.bench.levels import LevelPlan
from gateway.bench.stats import LevelResult, summarise
from gateway.bench.virtual import routing_for, run_virtual_level
from gateway.bench.workloads import Workload
from gateway.config import Routing
from gateway.sim import memory
from gateway.sim.profile import Profile, pair_profiles, single_profile

SINGLE_TARGETS = ("single-plain", "single-mtp", "single-adaptive")
DEFAULT_TARGETS = ("gateway", *SINGLE_TARGETS)
PAIR_STATIC_TARGETS = ("pair-mtp-only", "pair-plain-only")
ALL_TARGETS = (*DEFAULT_TARGETS, *PAIR_STATIC_TARGETS)
# bench --policy (the pair's policies) keeps its meaning: the pair's servers.
POLICY_TARGETS = {"crossover": "gateway", "mtp-only": "pair-mtp-only", "plain-only": "pair-plain-only"}


@dataclass(frozen=True)
class SimTarget:
    name: str
    policy: str  # the routing policy that sends every request where this target runs it
    profiles: Mapping[str, Profile]  # the simulated servers (named as the router knows them)


def build_targets(names: Sequence[str], hardware: str = memory.DEFAULT_HARDWARE,
                  pair: Mapping[str, Profile] | None = None) -> list[SimTarget]:
    """Targets by name on ``hardware``. ``pair``: the pair's profiles (default: the packaged
    step times with the pair's memory); single servers take their step times from it and their
    memory from owning the GPUs."""
    pair = dict(pair) if pair is not None else pair_profiles(hardware)

    def single(role: str) -> Profile:
        return single_profile(role, hardware, timings=pair)

    makers: dict[str, Callable[[], SimTarget]] = {
        "gateway": lambda: SimTarget("gateway", "crossover", pair),
        "single-plain": lambda: SimTarget("single-plain", "plain-only", {**pair, "plain": single("plain")}),
        "single-mtp": lambda: SimTarget("single-mtp", "mtp-only", {**pair, "mtp": single("mtp")}),
        "single-adaptive": lambda: SimTarget("single-adaptive", "mtp-only",
                                             {**pair, "mtp": single("adaptive")}),
        "pair-mtp-only": lambda: SimTarget("pair-mtp-only", "mtp-only", pair),
        "pair-plain-only": lambda: SimTarget("pair-plain-only", "plain-only", pair),
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(f"unknown target(s) {', '.join(unknown)}: one of {', '.join(ALL_TARGETS)}")
    return [makers[n]() for n in names]


def run_target_sweep(workload_factory: Callable[[], Workload], plans: Sequence[LevelPlan],
                     routing: Routing, targets: Sequence[SimTarget], *, shared_device: bool = True,
                     seed: int = 0, progress: Callable[[str, int], None] | None = None,
                     accept_drop: tuple[float, float] | None = None,
                     carry_learning: bool = False) -> dict[str, list[LevelResult]]:
    """Every target over every level, each level in a fresh simulator; results by target name.
    ``carry_learning``: each target's learned crossover keeps its samples from level to level
    (see run_virtual_sweep)."""
    results: dict[str, list[LevelResult]] = {t.name: [] for t in targets}
    estimators = {t.name: CrossoverEstimator() for t in targets}
    for plan in plans:
        for target in targets:
            records, wall = run_virtual_level(workload_factory(), plan, routing_for(target.policy, routing),
                                              target.profiles, shared_device=shared_device, seed=seed,
                                              accept_drop=accept_drop,
                                              learned=estimators[target.name] if carry_learning else None)
            results[target.name].append(summarise(target.name, plan.concurrency, records, wall, plan.window))
            if progress:
                progress(target.name, plan.concurrency)
    return results


def caps(targets: Sequence[SimTarget]) -> dict[str, dict[str, int]]:
    """Each target's running caps, as the report states them."""
    used = {"gateway": ("mtp", "plain"), "pair-mtp-only": ("mtp",), "pair-plain-only": ("plain",),
            "single-plain": ("plain",), "single-mtp": ("mtp",), "single-adaptive": ("mtp",)}
    return {t.name: {b: t.profiles[b].effective_max_running for b in used.get(t.name, tuple(t.profiles))}
            for t in targets}
