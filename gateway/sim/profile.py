"""Backend profiles: how long a simulated SGLang server takes per step, and its caps.

A profile is plain data loaded from YAML (``profiles/default.yaml`` ships with the package;
``calibrate`` can write a user's measured ones with :func:`save_profiles`). The engine reads
only the fields below; everything time-related is in milliseconds of device time.

The packaged profiles carry step times only; their caps and prefix cache come from the memory
model (:mod:`gateway.sim.memory`) for a deployment: the pair sharing the GPUs
(:func:`pair_profiles`, what :func:`load_profiles` returns by default), one server owning them
(:func:`single_profile`: plain, MTP or ``--speculative-adaptive``), or the seed's single servers
(:func:`seed_profiles`, BF16, which the step tables were fitted to).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gateway.sim import memory

DEFAULT_MODEL = "Qwen/Qwen3.5-122B-A10B"
# SGLang resets --max-running-requests to 48 for speculative decoding when it is unset.
SPECULATIVE_DEFAULT_MAX_RUNNING = 48
# Without speculation SGLang derives the cap from KV capacity; 2048 is its lower clamp and is
# what /server_info shows as the resolved argument before the Mamba cap applies.
PLAIN_DEFAULT_MAX_RUNNING = 2048


@dataclass(frozen=True)
class Profile:
    """One simulated backend. ``step_ms`` is a piecewise-linear batch -> decode step table."""

    step_ms: tuple[tuple[int, float], ...]
    prefill_ms_per_1k: float
    prefill_overhead_ms: float = 8.0
    chunked_prefill_size: int = 8192
    speculative: bool = False
    num_steps: int = 3
    eagle_topk: int = 1
    accept_prob: float = 0.7
    accept_prob_repetitive: float = 1.0
    max_running_requests: int | None = None
    mamba_slots: int | None = None
    mamba_slots_per_request: int = 5
    prefix_cache_tokens: int = 1_000_000
    max_queued_requests: int | None = None
    served_model_name: str = DEFAULT_MODEL
    context_length: int = 262_144
    # --speculative-adaptive: draft steps chosen per batch by gateway.sim.adaptive. Then
    # step_ms is the decode step at ONE draft step and base_step_ms the same server's step
    # without speculation; other step counts are derived from both (spec_step_ms).
    adaptive: bool = False
    base_step_ms: tuple[tuple[int, float], ...] = ()
    draft_layer_fraction: float = 1 / 48  # the MTP layer against the target's 48 layers
    # vLLM's draft tokens per step by the number of scheduled requests: its dynamic schedule
    # (num_speculative_tokens_per_batch_size, gateway.sim.vllm.dynamic), clamped to num_steps
    # (num_speculative_tokens); a static k is ((1, 1, k),). Steps are costed as the adaptive
    # server's (spec_step_s), so base_step_ms is needed. Empty: SGLang's fixed or adaptive steps.
    draft_schedule: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        batches = [b for b, _ in self.step_ms]
        if not batches or batches != sorted(set(batches)) or batches[0] < 1:
            raise ValueError("step_ms needs increasing batch sizes starting at >= 1")
        if not 0.0 <= self.accept_prob <= 1.0 or not 0.0 <= self.accept_prob_repetitive <= 1.0:
            raise ValueError("accept probabilities must be within [0, 1]")
        if self.adaptive and not (self.speculative and self.base_step_ms):
            raise ValueError("an adaptive profile is speculative and needs base_step_ms")
        if self.draft_schedule and not (self.speculative and self.base_step_ms):
            raise ValueError("a draft schedule is speculative and needs base_step_ms")

    @property
    def resolved_max_running_requests(self) -> int:
        """The ``max_running_requests`` server arg after SGLang's defaults (what /server_info shows)."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        return SPECULATIVE_DEFAULT_MAX_RUNNING if self.speculative else PLAIN_DEFAULT_MAX_RUNNING

    @property
    def effective_max_running(self) -> int:
        """Requests that can really run at once: the Mamba state pool caps the argument."""
        cap = self.resolved_max_running_requests
        if self.mamba_slots is not None:
            cap = min(cap, self.mamba_slots // self.mamba_slots_per_request)
        return max(cap, 1)

    @property
    def num_draft_tokens(self) -> int:
        # With topk == 1 SGLang forces draft tokens to steps + 1.
        return self.num_steps + 1 if self.speculative else 0

    def decode_step_s(self, batch: int) -> float:
        """Seconds for one decode step of ``batch`` running requests (linear between points)."""
        return _interpolate(self.step_ms, batch) / 1000.0

    def spec_step_s(self, batch: int, steps: int) -> float:
        """Seconds for one decode step with ``steps`` draft steps (adaptive profiles).

        Verify runs the target over ``steps + 1`` tokens per request (the base step of a batch
        that many times bigger); each draft step is one pass of the draft layer; the rest of
        the measured one-step cost (draft extend, sampling, bookkeeping) is ``extra``. At 0
        steps SGLang still runs the draft extend (eagle_worker_v2.py: "_draft_extend below
        still runs, keeping draft KV warm") and verifies trivially, "functionally a plain
        decode": base step + one draft-layer pass. At one step this is step_ms exactly.
        """
        base = _interpolate(self.base_step_ms, batch)
        draft = base * self.draft_layer_fraction
        if steps == 0:
            return (base + draft) / 1000.0
        one_step = _interpolate(self.step_ms, batch)
        extra = max(0.0, one_step - _interpolate(self.base_step_ms, 2 * batch) - draft)
        return (_interpolate(self.base_step_ms, batch * (steps + 1)) + steps * draft + extra) / 1000.0

    def prefill_step_s(self, tokens: int) -> float:
        """Seconds for one prefill step that computes ``tokens`` uncached prompt tokens."""
        return (self.prefill_overhead_ms + self.prefill_ms_per_1k * tokens / 1000.0) / 1000.0


def _interpolate(points: tuple[tuple[int, float], ...], x: int) -> float:
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    # Beyond the last point keep the last segment's slope: bigger batches keep costing more.
    i = min(bisect.bisect_left([p[0] for p in points], x), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _profile_from_dict(name: str, raw: Mapping[str, Any]) -> Profile:
    known = {f.name for f in dataclasses.fields(Profile)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"profile {name!r}: unknown keys {sorted(unknown)}")
    fields = dict(raw)
    for key in ("step_ms", "base_step_ms"):
        if key in raw:
            fields[key] = tuple((int(b), float(ms)) for b, ms in raw[key])
    if "draft_schedule" in raw:
        fields["draft_schedule"] = tuple((int(lo), int(hi), int(k)) for lo, hi, k in raw["draft_schedule"])
    return Profile(**fields)


def load_profiles(path: str | Path | None = None,
                  hardware: str = memory.DEFAULT_HARDWARE) -> dict[str, Profile]:
    """Profiles by backend name (``mtp``, ``plain``) from ``path`` as written, or the packaged
    timings with the memory of the pair sharing ``hardware`` (:func:`pair_profiles`)."""
    if path is None:
        return pair_profiles(hardware)
    return _parse(Path(path).read_text())


def packaged_timings() -> dict[str, Profile]:
    """The packaged step times, with no memory applied (caps as the YAML gives them)."""
    return _parse(resources.files("gateway.sim").joinpath("profiles/default.yaml").read_text())


def pair_profiles(hardware: str = memory.DEFAULT_HARDWARE) -> dict[str, Profile]:
    """MTP and plain sharing the GPUs, sized as docker/compose.yaml starts them."""
    timings = packaged_timings()
    sizing = memory.size_pair(memory.HARDWARE[hardware])
    return {name: memory.with_sizing(timings[name], sizing[name]) for name in ("mtp", "plain")}


def single_profile(role: str, hardware: str = memory.DEFAULT_HARDWARE,
                   weights: str = memory.PAIR_WEIGHTS,
                   timings: Mapping[str, Profile] | None = None) -> Profile:
    """One ``plain``, ``mtp`` or ``adaptive`` server owning the GPUs (step times from
    ``timings``, default the packaged ones)."""
    timings = timings or packaged_timings()
    sizing = memory.size_single(role, memory.HARDWARE[hardware], weights)
    base = adaptive_timing(timings) if role == "adaptive" else timings[role]
    return memory.with_sizing(base, sizing)


def seed_profiles() -> dict[str, Profile]:
    """The seed's single servers (BF16, each alone on 4x RTX PRO 6000): the calibration target."""
    return {role: single_profile(role, "rtx-pro-6000", memory.SEED_WEIGHTS) for role in ("mtp", "plain")}


def adaptive_timing(timings: Mapping[str, Profile]) -> Profile:
    """``--speculative-adaptive``: MTP's one-step table plus plain's step as the base.

    Left unset, SGLang starts it at 3 draft steps (the middle of the candidates [0, 1, 3, 5, 7];
    arg_groups/speculative_hook.py _init_adaptive_speculative_params)."""
    return dataclasses.replace(timings["mtp"], adaptive=True, num_steps=3,
                               base_step_ms=timings["plain"].step_ms)


def _parse(text: str) -> dict[str, Profile]:
    raw = yaml.safe_load(text) or {}
    backends = raw.get("backends")
    if not isinstance(backends, dict) or not backends:
        raise ValueError("profiles file needs a non-empty 'backends' mapping")
    return {name: _profile_from_dict(name, spec) for name, spec in backends.items()}


def save_profiles(profiles: Mapping[str, Profile], path: str | Path, comment: str = "") -> None:
    """Write profiles in the format :func:`load_profiles` reads (``calibrate`` uses this)."""
    backends = {}
    for name, profile in profiles.items():
        spec = dataclasses.asdict(profile)
        spec["step_ms"] = [[b, ms] for b, ms in profile.step_ms]
        spec["base_step_ms"] = [[b, ms] for b, ms in profile.base_step_ms]
        spec["draft_schedule"] = [list(entry) for entry in profile.draft_schedule]
        backends[name] = spec
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    Path(path).write_text(header + yaml.safe_dump({"backends": backends}, sort_keys=False))
