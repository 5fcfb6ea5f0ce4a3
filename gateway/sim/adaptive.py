"""``--speculative-adaptive``: draft steps per batch size, as SGLang 0.5.23 chooses them.

A transcription of ``sglang/srt/speculative/adaptive_spec_params.py`` (0.5.23): the batch is
padded up to the speculative CUDA-graph batch sizes (``arg_groups/cuda_graph_hook.py:500``),
routed to the tier whose lower bound is the largest at or below it, and that tier's slot keeps
an EMA of accepted drafts per request, moving its step count among its candidates after a
warm-up and every few batches (``AdaptiveStepSlot``). Step 0 means no drafting.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# DEFAULT_ADAPTIVE_CONFIG (adaptive_spec_params.py:28): tier lower bound -> its settings.
DEFAULT_TIERS: dict[int, dict[str, object]] = {
    1: {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25},
    8: {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
    32: {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
    64: {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
}
EMA_ALPHA = 0.2
UPDATE_INTERVAL = 5
WARMUP_BATCHES = 10


def spec_cuda_graph_batch_sizes(max_bs: int) -> list[int]:
    """generate_decode_cuda_graph_batch_sizes for speculative decoding."""
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8),
             *range(272, max_bs + 1, 16)]
    sizes = [bs for bs in sizes if bs <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


@dataclass
class StepSlot:
    """AdaptiveStepSlot: one tier's current step count and its EMA of accepted drafts."""

    candidates: Sequence[int]
    up_hysteresis: float
    down_hysteresis: float
    current: int
    ema: float
    batches: int = 0

    @classmethod
    def start(cls, initial_steps: int, settings: Mapping[str, object]) -> StepSlot:
        candidates = sorted(set(settings["candidate_steps"]))  # type: ignore[call-overload]
        current = initial_steps if initial_steps in candidates else candidates[len(candidates) // 2]
        return cls(candidates, float(settings["up_hysteresis"]),  # type: ignore[arg-type]
                   float(settings["down_hysteresis"]), current, float(current - 1))  # type: ignore[arg-type]

    def update(self, accepted_drafts: Sequence[int]) -> None:
        if not accepted_drafts:
            return
        if self.current > 0:
            mean = sum(accepted_drafts) / len(accepted_drafts)
            self.ema = (1 - EMA_ALPHA) * self.ema + EMA_ALPHA * mean
        self.batches += 1
        if self.batches > WARMUP_BATCHES and (self.batches - WARMUP_BATCHES) % UPDATE_INTERVAL == 0:
            self._recompute()

    def _recompute(self) -> None:
        idx = self.candidates.index(self.current)
        if self.current == 0:  # probe the smallest positive step after a no-drafting interval
            target = self.candidates[min(idx + 1, len(self.candidates) - 1)]
            if target > 0 and self.ema < 0:
                self.ema = float(target - 1)
            self.current = target
            return
        start = idx
        while idx > 0:
            below = self.candidates[idx - 1]
            threshold = (0.5 if below == 0 else below - 0.5) + self.down_hysteresis
            if self.ema > threshold:
                break
            idx -= 1
        if idx == start:
            top = len(self.candidates) - 1
            while idx < top and self.ema > self.candidates[idx] - 0.5 + self.up_hysteresis:
                idx += 1
        self.current = self.candidates[idx]


class AdaptiveSteps:
    """AdaptiveSpeculativeParams: routes a batch size to its tier's slot."""

    def __init__(self, initial_steps: int, max_bs: int,
                 tiers: Mapping[int, Mapping[str, object]] = DEFAULT_TIERS) -> None:
        self._bounds = sorted(tiers)
        self._slots = {bound: StepSlot.start(initial_steps, tiers[bound]) for bound in self._bounds}
        self._graph_bs = spec_cuda_graph_batch_sizes(max_bs)

    def slot(self, batch: int) -> StepSlot:
        i = bisect.bisect_left(self._graph_bs, batch)
        padded = self._graph_bs[i] if i < len(self._graph_bs) else batch
        bound = self._bounds[max(0, bisect.bisect_right(self._bounds, padded) - 1)]
        return self._slots[bound]

    def steps_for(self, batch: int) -> int:
        return self.slot(batch).current

    def on_verify(self, batch: int, accepted_drafts: Sequence[int]) -> None:
        self.slot(batch).update(accepted_drafts)
