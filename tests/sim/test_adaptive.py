"""--speculative-adaptive as SGLang 0.5.23 runs it: tiers of draft steps by batch size."""

import dataclasses

import pytest

from gateway.sim.adaptive import AdaptiveSteps, spec_cuda_graph_batch_sizes
from gateway.sim.profile import packaged_timings, single_profile
from gateway.sim.virtual import run_seed_benchmark


def feed(steps: AdaptiveSteps, batch: int, accepted: int, batches: int = 40) -> int:
    for _ in range(batches):
        current = steps.steps_for(batch)
        steps.on_verify(batch, [min(accepted, current)] * batch)
    return steps.steps_for(batch)


@pytest.mark.parametrize(("batch", "start", "all_accepted", "none_accepted"), [
    (1, 3, 7, 1),     # tier 1: candidates [1, 3, 5, 7]
    (7, 3, 7, 1),
    (8, 3, 3, 0),     # tier 8: [0, 1, 3]
    (31, 1, 1, 0),    # padded to the CUDA-graph size 32: tier 32, [0, 1]
    (48, 1, 1, 0),
    (64, 0, 0, 0),    # tier 64: [0], drafting off
    (128, 0, 0, 0),
])
def test_steps_per_batch_tier_follow_sglang_defaults(batch, start, all_accepted, none_accepted):
    assert AdaptiveSteps(3, 128).steps_for(batch) == start
    assert feed(AdaptiveSteps(3, 128), batch, accepted=99) == all_accepted
    final = feed(AdaptiveSteps(3, 128), batch, accepted=0, batches=41)
    assert final == none_accepted or (none_accepted == 0 and final == 1)  # 0 probes 1 and back


def test_spec_graph_sizes_pad_like_sglang():
    assert spec_cuda_graph_batch_sizes(48) == [*range(1, 9), *range(10, 33, 2), 40, 44, 48]


def test_step_cost_at_one_step_is_mtps_and_at_zero_is_plain_plus_the_draft_layer():
    adaptive = single_profile("adaptive")
    timings = packaged_timings()
    for batch in (1, 8, 24, 48):
        assert adaptive.spec_step_s(batch, 1) == pytest.approx(timings["mtp"].decode_step_s(batch))
        plain = timings["plain"].decode_step_s(batch)
        assert adaptive.spec_step_s(batch, 0) == pytest.approx(plain * (1 + 1 / 48))
    assert adaptive.spec_step_s(1, 7) > adaptive.spec_step_s(1, 3) > adaptive.spec_step_s(1, 1)


def test_adaptive_keeps_speculations_cap_and_stops_drafting_only_above_it():
    adaptive = single_profile("adaptive")
    assert adaptive.effective_max_running == 48  # 0 steps start at batch 64: never reached
    seed = run_seed_benchmark({"a": adaptive}, {"a": 128}, rounds=1)["a"]
    assert seed.max_running == 48 and seed.accept_length == pytest.approx(2.0)
    # --max-running-requests 128 with room for it (on 96 GB the Mamba pool would stop it at 60)
    uncapped = dataclasses.replace(adaptive, max_running_requests=128, mamba_slots=1000)
    run = run_seed_benchmark({"a": uncapped}, {"a": 128}, rounds=1)["a"]
    assert run.max_running == 128 and run.accept_length < 1.1  # plain decode at batch >= 64


def test_adaptive_climbs_to_seven_steps_on_the_seeds_repeated_token():
    result = run_seed_benchmark({"a": single_profile("adaptive")}, {"a": 1})["a"]
    assert result.accept_length > 7.5
