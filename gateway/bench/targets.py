"""What ``bench --sim`` compares: the pair through the gateway against the servers a user would
otherwise run, each with the memory it would really have (gateway.sim.memory).

- ``gateway``: MTP and plain sharing the GPUs (the compose split), routed by the config;
- ``single-plain``, ``single-mtp``, ``single-adaptive``: ONE server owning the GPUs (one copy of
  the weights, all of the memory): plain, MTP (the pair's MTP flags), or MTP with
  ``--speculative-adaptive`` (SGLang 0.5.23's default tiers);
- ``pair-mtp-only``, ``pair-plain-only``: the pair's own servers with a static policy (the old
  "mtp-only" / "plain-only" baselines; on request).
- ``pair-turns``: the pair taking turns owning the memory (``gateway.bench.turns_virtual``),
  each server sized for the whole GPU less the parked one's leftovers, its MTP server
  ``--speculative-adaptive``; ``pair-turns-mtp`` the same with the pair's MTP flags (one draft
  step); ``pair-turns-finish`` lets running streams finish first (bounded) instead of
  continuing them on the incoming server, ``pair-turns-finish-back`` only on the way back to
  MTP (a draining burst);
- ``vllm-pair``, ``vllm-plain``, ``vllm-mtp``, ``vllm-mtp-k2``, ``vllm-mtp-dynamic``: vLLM 0.33.0
  (``gateway.sim.vllm.profiles``, where what is vLLM's and what is approximate is said): the split
  pair (MTP with the recipe's k = 1, and plain) through the gateway, and one server owning the
  GPUs: plain, MTP with a static k (1, the recipe's, or 2), and MTP with the dynamic schedule of
  vLLM issue #49548 (k = 2 up to 4 requests, then 0) as the simulator models it (not the
  collapse that issue reports); ``vllm-pair-turns``: the vLLM pair taking turns in sleep mode
  (level 1), as the gateway drives it (gateway/turns/state.py ``HANDOVERS``): a turn costs the
  outgoing server's sleep and the incoming one's wake (``gateway.sim.vllm.sleep.costs``,
  ~18 s against SGLang's 1.5 s), running streams finish first within the bound and are ended
  past it (no continuation), and the incoming server starts cold (level 1 discards the KV
  cache; vLLM has no HiCache store); ``vllm-pair-turns-k2`` the same with k = 2;
- ``single-mtp-tuned``, ``single-adaptive-tuned``: the strongest single MTP server a user
  could tune with SGLang 0.5.23's flags: ``--max-running-requests 128``, the plain server's
  ``--mem-fraction-static``, and ``--mamba-full-memory-ratio`` raised until the Mamba pool
  holds 128 requests (cap = Mamba slots // 5 with extra_buffer, kv_cache_configurator.py:3136).

A single server runs through the same virtual gateway with a static policy; the pair's other
server is present but never receives a request, so it never takes a turn on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.bench.arrivals import OpenLoop
from gateway.bench.levels import LevelPlan
from gateway.bench.stats import LevelResult, OpenLoopResult, summarise, summarise_open
from gateway.bench.turns_virtual import (
    Calibration,
    RunResult,
    TurnModel,
    TurnRecord,
    calibrate_crossover,
    run_virtual,
    turns_routing,
)
from gateway.bench.virtual import routing_for, run_virtual_level
from gateway.bench.workloads import Workload
from gateway.config import Routing, Turns
from gateway.routing.crossover import CrossoverEstimator
from gateway.sim import memory
from gateway.sim.profile import Profile, adaptive_timing, packaged_timings, pair_profiles, single_profile
from gateway.sim.vllm import profiles as vllm_profiles
from gateway.sim.vllm import sleep as vllm_sleep
from gateway.turns.decision import GAIN_PER_CROSSOVER

SINGLE_TARGETS = ("single-plain", "single-mtp", "single-adaptive")
TUNED_TARGETS = ("single-mtp-tuned", "single-adaptive-tuned")
TURNS_TARGETS = ("pair-turns", "pair-turns-mtp", "pair-turns-finish", "pair-turns-finish-back")
# The pair's target by memory shape; `bench --sim --memory` picks one.
PAIR_TARGET = {"split": "gateway", "turns": "pair-turns"}
DEFAULT_TARGETS = ("gateway", *SINGLE_TARGETS)
DEFAULT_MEMORY = "turns"


def default_targets(memory_shape: str) -> tuple[str, ...]:
    """The pair in that memory shape and the single servers; with turns the tuned single MTP
    servers too (the strongest single server is what turns must beat)."""
    if memory_shape == "split":
        return DEFAULT_TARGETS
    return (PAIR_TARGET[memory_shape], *SINGLE_TARGETS, *TUNED_TARGETS)
PAIR_STATIC_TARGETS = ("pair-mtp-only", "pair-plain-only")
VLLM_SINGLE_TARGETS = ("vllm-plain", "vllm-mtp", "vllm-mtp-k2", "vllm-mtp-dynamic")
VLLM_TURNS_TARGETS = ("vllm-pair-turns", "vllm-pair-turns-k2")
VLLM_TARGETS = ("vllm-pair", *VLLM_TURNS_TARGETS, *VLLM_SINGLE_TARGETS)
ALL_TARGETS = (*DEFAULT_TARGETS, *TUNED_TARGETS, *TURNS_TARGETS, *PAIR_STATIC_TARGETS, *VLLM_TARGETS)
PAIR_TARGETS = ("gateway", *TURNS_TARGETS, "vllm-pair", *VLLM_TURNS_TARGETS)  # compared with the singles

# What a parked (released) server still holds per GPU, when gateway.sim.memory does not say
# (helper deploy's size_turns): CUDA context + NCCL + custom all-reduce 1.0 GiB, attention and
# logits buffers 0.5, the named buffers' GPU clone 0.06, CUDA graphs released with
# SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 (memory-turns.md, weight_updater.py:374-377).
TURNS_LEFTOVER_GIB = 1.56
# The tuned single MTP server: what a user can raise with 0.5.23's flags.
TUNED_MAX_RUNNING = 128
TUNED_FRACTION = memory.SINGLE_FRACTIONS["plain"]
# bench --policy (the pair's policies) keeps its meaning: the pair's servers.
POLICY_TARGETS = {"crossover": "gateway", "mtp-only": "pair-mtp-only", "plain-only": "pair-plain-only"}


@dataclass(frozen=True)
class SimTarget:
    name: str
    policy: str  # the routing policy that sends every request where this target runs it
    profiles: Mapping[str, Profile]  # the simulated servers (named as the router knows them)
    turns: TurnModel | None = None  # the pair takes turns owning the memory


def turns_leftover_gib(hardware: memory.Hardware) -> float:
    leftover = getattr(memory, "turns_leftover_total", None)
    return float(leftover(hardware, True)) if leftover is not None else TURNS_LEFTOVER_GIB


def turns_profiles(hardware: str = memory.DEFAULT_HARDWARE, mtp_role: str = "adaptive",
                   timings: Mapping[str, Profile] | None = None,
                   weights: str = memory.PAIR_WEIGHTS) -> dict[str, Profile]:
    """The turns pair: plain starts first on the empty GPUs and is parked, then MTP (``mtp`` or
    ``adaptive``) sizes on what plain's leftovers leave (the start order of size_turns); each
    with the fraction of a single server owning the GPUs."""
    hw = memory.HARDWARE[hardware]
    timings = timings or packaged_timings()
    free = {"plain": hw.free_at_start_gib, "mtp": hw.free_at_start_gib - turns_leftover_gib(hw)}
    sized = {}
    for role, server in (("plain", "plain"), ("mtp", mtp_role)):
        launch = memory.launch_for(server, memory.SINGLE_FRACTIONS[server], weights)
        base = adaptive_timing(timings) if server == "adaptive" else timings[role]
        sized[role] = memory.with_sizing(base, memory.size_server(launch, free[role], hw))
    return sized


def tuned_launch(role: str, hardware: memory.Hardware, weights: str = memory.PAIR_WEIGHTS,
                 max_running: int = TUNED_MAX_RUNNING) -> memory.Launch:
    """``--max-running-requests`` raised and the smallest ``--mamba-full-memory-ratio`` (by
    tenths) whose Mamba pool runs that many; the largest cap within 10 if none does."""
    base = dataclasses.replace(memory.launch_for(role, TUNED_FRACTION, weights),
                               max_running_requests=max_running)
    best = base
    best_cap = 0
    for tenths in range(9, 101):
        launch = dataclasses.replace(base, mamba_full_memory_ratio=tenths / 10)
        cap = memory.size_server(launch, hardware.free_at_start_gib, hardware).max_running
        if cap > best_cap:
            best, best_cap = launch, cap
        if cap >= max_running:
            break
    return best


def tuned_profile(role: str, hardware: str, timings: Mapping[str, Profile]) -> Profile:
    hw = memory.HARDWARE[hardware]
    base = adaptive_timing(timings) if role == "adaptive" else timings[role]
    return memory.with_sizing(base, memory.size_server(tuned_launch(role, hw), hw.free_at_start_gib, hw))


def build_targets(names: Sequence[str], hardware: str = memory.DEFAULT_HARDWARE,
                  pair: Mapping[str, Profile] | None = None,
                  turn: TurnModel | None = None) -> list[SimTarget]:
    """Targets by name on ``hardware``. ``pair``: the pair's profiles (default: the packaged
    step times with the pair's memory); single servers take their step times from it and their
    memory from owning the GPUs. ``turn``: how the turns targets hand over (default
    TurnModel())."""
    pair = dict(pair) if pair is not None else pair_profiles(hardware)
    turn = dataclasses.replace(turn or TurnModel(), gpus=memory.HARDWARE[hardware].gpus)

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
        "single-mtp-tuned": lambda: SimTarget("single-mtp-tuned", "mtp-only",
                                              {**pair, "mtp": tuned_profile("mtp", hardware, pair)}),
        "single-adaptive-tuned": lambda: SimTarget(
            "single-adaptive-tuned", "mtp-only", {**pair, "mtp": tuned_profile("adaptive", hardware, pair)}),
        "pair-turns": lambda: SimTarget("pair-turns", "crossover",
                                        turns_profiles(hardware, "adaptive", pair), turn),
        "pair-turns-mtp": lambda: SimTarget("pair-turns-mtp", "crossover",
                                            turns_profiles(hardware, "mtp", pair), turn),
        "pair-turns-finish": lambda: SimTarget(
            "pair-turns-finish", "crossover", turns_profiles(hardware, "adaptive", pair),
            dataclasses.replace(turn, running="finish")),
        "pair-turns-finish-back": lambda: SimTarget(
            "pair-turns-finish-back", "crossover", turns_profiles(hardware, "adaptive", pair),
            dataclasses.replace(turn, running="finish-back")),
    }
    makers.update(_vllm_makers(hardware, pair, turn))
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(f"unknown target(s) {', '.join(unknown)}: one of {', '.join(ALL_TARGETS)}")
    return [makers[n]() for n in names]


def vllm_turn(hardware: str, crossover: int | None = None,
              payback_turns: float = TurnModel.payback_turns) -> TurnModel:
    """How the vLLM turns pair hands over: the outgoing server's level-1 sleep and the incoming
    one's wake, as the simulated vLLM server costs them; running streams finish first within
    turns.finish_within_s and are ended past it; no store. ``crossover`` and ``payback_turns``:
    the decision's, as for the SGLang pair."""
    costs = vllm_sleep.costs(hardware)  # (sleep, wake) of each server
    return TurnModel(cost_to=(("plain", costs["mtp"][0] + costs["plain"][1]),
                              ("mtp", costs["plain"][0] + costs["mtp"][1])),
                     running="finish", finish_bound_s=Turns().finish_within_s, past_bound="end",
                     store="none", crossover=crossover, payback_turns=payback_turns)


def _vllm_makers(hardware: str, timings: Mapping[str, Profile],
                 turn: TurnModel) -> dict[str, Callable[[], SimTarget]]:
    """The vLLM targets; each single server beside the vLLM pair's other server, which idles.
    The turns pair takes only ``turn``'s crossover: its hand-over is vLLM's (`vllm_turn`)."""
    def beside(name: str, policy: str, role: str, server: Callable[[], Profile]) -> Callable[[], SimTarget]:
        return lambda: SimTarget(name, policy,
                                 {**vllm_profiles.pair(hardware, timings=timings), role: server()})

    def mtp(k: int, schedule: tuple[tuple[int, int, int], ...] = ()) -> Callable[[], Profile]:
        return lambda: vllm_profiles.single("mtp", hardware, k, schedule, timings)

    return {
        "vllm-pair": lambda: SimTarget("vllm-pair", "crossover",
                                       vllm_profiles.pair(hardware, timings=timings)),
        "vllm-pair-turns": lambda: SimTarget("vllm-pair-turns", "crossover",
                                             vllm_profiles.turns_pair(hardware, timings=timings),
                                             vllm_turn(hardware, turn.crossover, turn.payback_turns)),
        "vllm-pair-turns-k2": lambda: SimTarget("vllm-pair-turns-k2", "crossover",
                                                vllm_profiles.turns_pair(hardware, 2, timings),
                                                vllm_turn(hardware, turn.crossover, turn.payback_turns)),
        "vllm-plain": beside("vllm-plain", "plain-only", "plain",
                             lambda: vllm_profiles.single("plain", hardware, timings=timings)),
        "vllm-mtp": beside("vllm-mtp", "mtp-only", "mtp", mtp(vllm_profiles.RECIPE_K)),
        "vllm-mtp-k2": beside("vllm-mtp-k2", "mtp-only", "mtp", mtp(2)),
        "vllm-mtp-dynamic": beside("vllm-mtp-dynamic", "mtp-only", "mtp",
                                   mtp(vllm_profiles.ISSUE_49548_K, vllm_profiles.ISSUE_49548_SCHEDULE)),
    }


def run_target_sweep(workload_factory: Callable[[], Workload], plans: Sequence[LevelPlan],
                     routing: Routing, targets: Sequence[SimTarget], *, shared_device: bool = True,
                     seed: int = 0, progress: Callable[[str, int], None] | None = None,
                     accept_drop: tuple[float, float] | None = None,
                     carry_learning: bool = False, workload_key: object = None,
                     turn_log: dict[str, list[list[TurnRecord]]] | None = None,
                     ) -> dict[str, list[LevelResult]]:
    """Every target over every level, each level in a fresh simulator; results by target name.
    ``carry_learning``: each target's learned crossover keeps its samples from level to level
    (see run_virtual_sweep). Turns targets decide on the crossover calibrated on the workload
    (memoised by ``workload_key``); ``turn_log`` collects their turns per level."""
    results: dict[str, list[LevelResult]] = {t.name: [] for t in targets}
    estimators = {t.name: CrossoverEstimator() for t in targets}
    for plan in plans:
        for target in targets:
            learned = estimators[target.name] if carry_learning else None
            if target.turns is not None:
                turns, decide_on = deciding(target, turns_calibration(
                    target, workload_factory, routing, seed=seed, workload_key=workload_key), routing)
                run = run_virtual(workload_factory(), routing, target.profiles, plan=plan,
                                  turns=turns, turns_routing=decide_on,
                                  shared_device=shared_device, seed=seed)
                records, wall = run.records, run.wall_s
                if turn_log is not None:
                    turn_log.setdefault(target.name, []).append(  # the level's, not its drain's
                        [t for t in run.turns if plan.duration_s is None or t.start < plan.duration_s])
            else:
                records, wall = run_virtual_level(workload_factory(), plan,
                                                  routing_for(target.policy, routing), target.profiles,
                                                  shared_device=shared_device, seed=seed,
                                                  accept_drop=accept_drop, learned=learned)
            results[target.name].append(summarise(target.name, plan.concurrency, records, wall, plan.window))
            if progress:
                progress(target.name, plan.concurrency)
    return results


def run_open(target: SimTarget, workload: Workload, arrivals: OpenLoop, routing: Routing, *,
             workload_factory: Callable[[], Workload] | None = None, seed: int = 0,
             shared_device: bool = True, workload_key: object = None,
             log_requests: bool = False) -> RunResult:
    """One open-loop run of one target in a fresh simulator (a turns target decides on the
    crossover calibrated, closed-loop, on ``workload_factory``'s workload)."""
    if target.turns is not None:
        factory = workload_factory or (lambda: workload)
        turns, decide_on = deciding(target, turns_calibration(target, factory, routing, seed=seed,
                                                              workload_key=workload_key), routing)
        return run_virtual(workload, routing, target.profiles, arrivals=arrivals, turns=turns,
                           turns_routing=decide_on, shared_device=shared_device, seed=seed,
                           log_requests=log_requests)
    return run_virtual(workload, routing_for(target.policy, routing), target.profiles, arrivals=arrivals,
                       shared_device=shared_device, seed=seed, log_requests=log_requests)


def run_target_open(workload_factory: Callable[[], Workload], runs: Sequence[OpenLoop], routing: Routing,
                    targets: Sequence[SimTarget], *, shared_device: bool = True, seed: int = 0,
                    progress: Callable[[str], None] | None = None, workload_key: object = None,
                    turn_log: dict[str, list[list[TurnRecord]]] | None = None,
                    ) -> dict[str, list[OpenLoopResult]]:
    """Every target over every open-loop run (a rate, or a trace), each in a fresh simulator."""
    results: dict[str, list[OpenLoopResult]] = {t.name: [] for t in targets}
    for arrivals in runs:
        for target in targets:
            run = run_open(target, workload_factory(), arrivals, routing, workload_factory=workload_factory,
                           seed=seed, shared_device=shared_device, workload_key=workload_key)
            results[target.name].append(summarise_open(target.name, arrivals.label, arrivals.unit,
                                                       run.records, run.arrivals))
            if turn_log is not None and target.turns is not None:
                turn_log.setdefault(target.name, []).append(run.turns)
            if progress:
                progress(target.name)
    return results


def turns_calibration(target: SimTarget, workload_factory: Callable[[], Workload], routing: Routing, *,
                      seed: int = 0, workload_key: object = None) -> Calibration:
    """The crossover and gain a turns target decides on: its own, else calibrated on the
    workload."""
    turns = target.turns
    assert turns is not None
    if turns.crossover is not None:
        return Calibration(turns.crossover, turns.gain_per_crossover or GAIN_PER_CROSSOVER)
    profiles = target.profiles
    key = None if workload_key is None else (
        workload_key, seed, tuple(sorted((n, p) for n, p in profiles.items())))
    calibration = calibrate_crossover(workload_factory, profiles, routing, seed=seed, key=key)
    if turns.gain_per_crossover is not None:
        return dataclasses.replace(calibration, gain_per_crossover=turns.gain_per_crossover)
    return calibration


def deciding(target: SimTarget, calibration: Calibration, routing: Routing) -> tuple[TurnModel, Routing]:
    """A turns target's turn model and the routing its turns decide on, as calibrated."""
    assert target.turns is not None
    return (dataclasses.replace(target.turns, gain_per_crossover=calibration.gain_per_crossover),
            turns_routing(routing, calibration.crossover))


def caps(targets: Sequence[SimTarget]) -> dict[str, dict[str, int]]:
    """Each target's running caps, as the report states them."""
    used = {"gateway": ("mtp", "plain"), "pair-mtp-only": ("mtp",), "pair-plain-only": ("plain",),
            "single-plain": ("plain",), "single-mtp": ("mtp",), "single-adaptive": ("mtp",),
            "single-mtp-tuned": ("mtp",), "single-adaptive-tuned": ("mtp",),
            **{name: ("mtp", "plain") for name in TURNS_TARGETS}, "vllm-pair": ("mtp", "plain"),
            **{name: ("mtp", "plain") for name in VLLM_TURNS_TARGETS},
            "vllm-plain": ("plain",), **{name: ("mtp",) for name in VLLM_SINGLE_TARGETS[1:]}}
    return {t.name: {b: t.profiles[b].effective_max_running for b in used.get(t.name, tuple(t.profiles))}
            for t in targets}
