"""vLLM 0.33.0 servers as the simulator models them for the bench (``bench --sim --target vllm-*``):
one server owning the GPUs (plain, MTP with a static k, MTP with a dynamic schedule), the
split pair, and the pair taking turns in sleep mode.

What is vLLM's here, and what is not:

- **the running cap**: vLLM has no speculative reset of the cap (``config/speculative.py`` never
  touches ``max_num_seqs``, unlike SGLang's 48); ``--max-num-seqs`` defaults to 1024 on a GPU
  of 70 GiB or more (``engine/arg_utils.py:2973-2996``), and a Mamba-hybrid model does not start
  when it is above its Mamba cache blocks (``config/compilation.py:1511-1531``), so a deployment
  sets it to what the Mamba pool runs. The sizing asks for 1024 and keeps what the pool runs.
- **the draft tokens per step**: ``num_speculative_tokens`` k at every step, or the dynamic
  schedule ``num_speculative_tokens_per_batch_size`` (:mod:`gateway.sim.vllm.dynamic`, the
  scheduler's lookup), each step costed by :meth:`Profile.spec_step_s`. The memory is sized for
  k + 1 draft tokens whatever the schedule picks (vLLM issue #49548's point: k = 0 frees nothing).
- **approximate**: the memory itself is SGLang 0.5.23's sizing of the same share
  (:mod:`gateway.sim.memory`: fraction of free memory, Mamba pool and KV cache split as SGLang
  splits them, 5 Mamba slots a request), not vLLM's ``--gpu-memory-utilization`` profile run;
  the step times are the SGLang-fitted tables (``profiles/default.yaml``). The collapse vLLM
  issue #49548 reports with a schedule on this model is not modelled (dynamic.py says why).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gateway.sim import memory
from gateway.sim.profile import Profile, packaged_timings

# --max-num-seqs' default for the API server on a GPU of 70 GiB or more
# (engine/arg_utils.py:2973-2996).
MAX_NUM_SEQS = 1024
# --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}': Qwen3.5's recipe.
RECIPE_K = 1
# vLLM issue #49548's schedule on Qwen3.5-122B MTP: k = 2 up to 4 requests, then none.
ISSUE_49548_K = 2
ISSUE_49548_SCHEDULE: tuple[tuple[int, int, int], ...] = ((1, 4, 2), (5, 512, 0))


def launch(role: str, fraction: float, weights: str, k: int = RECIPE_K) -> memory.Launch:
    """A vLLM server's memory-relevant flags: ``plain`` or ``mtp`` with k draft tokens."""
    base = memory.launch_for("plain" if role == "plain" else "mtp", fraction, weights)
    if role != "plain":
        base = dataclasses.replace(base, num_draft_tokens=k + 1)
    return dataclasses.replace(base, max_running_requests=MAX_NUM_SEQS)


def _server(role: str, timings: Mapping[str, Profile], sizing: memory.Sizing, k: int,
            schedule: tuple[tuple[int, int, int], ...]) -> Profile:
    if role == "plain":
        return memory.with_sizing(timings["plain"], sizing)
    sized = memory.with_sizing(timings["mtp"], sizing)
    return dataclasses.replace(sized, num_steps=k, base_step_ms=timings["plain"].step_ms,
                               draft_schedule=schedule or ((1, 1, k),))


def single(role: str, hardware: str = memory.DEFAULT_HARDWARE, k: int = RECIPE_K,
           schedule: tuple[tuple[int, int, int], ...] = (),
           timings: Mapping[str, Profile] | None = None) -> Profile:
    """One vLLM server owning the GPUs: ``plain``, or ``mtp`` with k draft tokens a step (the
    ``schedule``'s, clamped to k, when one is given); the fraction of a single SGLang server."""
    timings = timings or packaged_timings()
    hw = memory.HARDWARE[hardware]
    fraction = memory.SINGLE_FRACTIONS["plain" if role == "plain" else "mtp"]
    sizing = memory.size_server(launch(role, fraction, memory.PAIR_WEIGHTS, k), hw.free_at_start_gib, hw)
    return _server(role, timings, sizing, k, schedule)


def pair(hardware: str = memory.DEFAULT_HARDWARE, k: int = RECIPE_K,
         timings: Mapping[str, Profile] | None = None) -> dict[str, Profile]:
    """The split vLLM pair (docker/compose.vllm.yaml): MTP with k draft tokens starts first, plain
    on what it left, at the SGLang pair's shares."""
    timings = timings or packaged_timings()
    sizes = memory.size_pair(memory.HARDWARE[hardware],
                             launch=lambda role, fraction, weights: launch(role, fraction, weights, k))
    return {role: _server(role, timings, sizes[role], k, ()) for role in ("mtp", "plain")}


def turns_pair(hardware: str = memory.DEFAULT_HARDWARE, k: int = RECIPE_K,
               timings: Mapping[str, Profile] | None = None) -> dict[str, Profile]:
    """The vLLM pair taking turns in sleep mode (docker/compose.vllm-turns.yaml): plain starts
    first on the empty GPUs and sleeps at level 1, MTP with k draft tokens sizes on what plain's
    leftovers leave. A level-1 sleep keeps the CUDA graphs on the GPU (without
    --sleep-mode-offload-cudagraph, config/vllm.py:715-728), so the leftovers are those of an
    SGLang server whose graphs are not released. Each at a single server's fraction, as the
    SGLang turns pair (gateway.bench.targets.turns_profiles)."""
    timings = timings or packaged_timings()
    hw = memory.HARDWARE[hardware]
    free = {"plain": hw.free_at_start_gib,
            "mtp": hw.free_at_start_gib - memory.turns_leftover_total(hw, cuda_graphs_released=False)}
    sized = {role: memory.size_server(launch(role, memory.SINGLE_FRACTIONS[role], memory.PAIR_WEIGHTS, k),
                                      free[role], hw)
             for role in ("mtp", "plain")}
    return {role: _server(role, timings, sized[role], k, ()) for role in ("mtp", "plain")}
