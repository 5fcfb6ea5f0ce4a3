"""vLLM 0.33.0's dynamic speculative decoding (``num_speculative_tokens_per_batch_size``,
vLLM PR #32374): the number of draft tokens per step chosen from the number of scheduled
requests by a fixed schedule.

A transcription of ``v1/spec_decode/dynamic/utils.py:7-148`` (the schedule's checks and its
dense batch-size -> k lookup: the first range starts at 1, gaps and the tail carry the previous
k forward, k is clamped to ``num_speculative_tokens``) and of the scheduler's use of it
(``v1/core/sched/scheduler.py:1709-1714``). What a step at k draft tokens costs is the SGLang
simulator's model (``Profile.spec_step_s``: the MTP one-step table and plain's step as its
base); at k = 0 that is a plain step plus one draft-layer pass.

What this does **not** model: the collapse vLLM issue #49548 reports on Qwen3.5-122B MTP with
a schedule (8 concurrent requests at 24-157 tok/s against ~232 static), whose cause is not
established on CUDA (vllm-ascend #16637 blames the scheduler skipping uniform-decode padding),
and the ~14 % single-stream loss from the PIECEWISE CUDA-graph downgrade, which applies on
Model Runner V1 (config/vllm.py:1069-1086) while 0.33.0 defaults to V2 (vllm.md). The memory
stays sized for the largest k (the draft weights, the Mamba spec blocks, the lookahead slots):
the server's capacity is the MTP server's at any k.
"""

from __future__ import annotations

from collections.abc import Sequence

Schedule = tuple[tuple[int, int, int], ...]


def validate_schedule(entries: object) -> Schedule:
    """validate_and_normalize_dynamic_sd_schedule (dynamic/utils.py:13-80); ValueError with
    vLLM's messages."""
    if entries is None:
        raise ValueError("num_speculative_tokens_per_batch_size is required for dynamic speculative "
                         "decoding.")
    if not isinstance(entries, list | tuple):
        raise ValueError("num_speculative_tokens_per_batch_size must be a non-empty list of "
                         "(range_start, range_end, num_speculative_tokens) entries.")  # fmt: skip
    if not entries:
        raise ValueError("num_speculative_tokens_per_batch_size must not be empty.")
    parsed = []
    for entry in entries:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ValueError("Each num_speculative_tokens_per_batch_size entry must be a 3-item sequence: "
                             "(range_start, range_end, num_speculative_tokens).")  # fmt: skip
        start, end, k = (int(value) for value in entry)
        if start <= 0 or end <= 0:
            raise ValueError(f"Batch-size range ({start}, {end}) must be positive.")
        if start > end:
            raise ValueError(f"Batch-size range start must be <= end for ({start}, {end}, {k}).")
        if k < 0:
            raise ValueError("num_speculative_tokens_per_batch_size values must be >= 0.")
        parsed.append((start, end, k))
    parsed.sort(key=lambda entry: entry[0])
    previous_end = 0
    for start, end, _ in parsed:
        if start <= previous_end:
            raise ValueError("Batch-size ranges must be non-overlapping and sorted.")
        previous_end = end
    if parsed[0][0] != 1:
        raise ValueError("The first batch-size range must start at 1 so every runtime batch size has a "
                         "defined schedule.")  # fmt: skip
    return tuple(parsed)


def dense_schedule(entries: object, max_batch: int, num_speculative_tokens: int) -> list[int]:
    """build_dynamic_sd_schedule_lookup (dynamic/utils.py:83-148): index b is k at b requests."""
    if max_batch <= 0:
        raise ValueError("vllm_max_batch_size must be > 0.")
    if num_speculative_tokens <= 0:
        raise ValueError("vllm_num_speculative_tokens must be > 0.")
    dense = [0] * (max_batch + 1)
    next_batch, last_k = 1, None
    for start, end, k in validate_schedule(entries):
        if start > next_batch and last_k is not None:
            for batch in range(next_batch, min(start, max_batch + 1)):
                dense[batch] = min(num_speculative_tokens, last_k)
        for batch in range(max(start, next_batch), min(end, max_batch) + 1):
            dense[batch] = min(num_speculative_tokens, k)
        next_batch, last_k = max(next_batch, end + 1), k
        if next_batch > max_batch:
            break
    assert last_k is not None  # validate_schedule refuses an empty schedule
    for batch in range(next_batch, max_batch + 1):
        dense[batch] = min(num_speculative_tokens, last_k)
    return dense


class ScheduledSteps:
    """The engine's draft-step chooser (as gateway.sim.adaptive.AdaptiveSteps) for a fixed
    schedule: k from the number of requests in the step, nothing learned."""

    def __init__(self, entries: object, max_batch: int, num_speculative_tokens: int) -> None:
        self._dense = dense_schedule(entries, max_batch, num_speculative_tokens)

    def steps_for(self, batch: int) -> int:
        return self._dense[min(batch, len(self._dense) - 1)]

    def on_verify(self, batch: int, accepted_drafts: Sequence[int]) -> None:
        return None
