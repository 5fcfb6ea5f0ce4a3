"""bench --sim's vLLM 0.33.0 targets (gateway/sim/vllm/profiles.py): the split vLLM pair and the
single vLLM servers, in virtual time."""

import json
import random

import pytest

from gateway.bench.targets import VLLM_TARGETS, build_targets, caps
from gateway.cli import main
from gateway.sim.engine import Engine
from gateway.sim.engine import Request as EngineRequest
from gateway.sim.vllm import profiles as vllm_profiles

pytestmark = pytest.mark.timeout(120)


def _decode_steps(engine: Engine, requests: int) -> set[int]:
    """The draft steps of every decode step that ran exactly ``requests`` requests."""
    for i in range(requests):
        engine.submit(EngineRequest(f"{requests}-{i}", [1, 2, 3], 30))
    seen = set()
    while (step := engine.begin_step()) is not None:
        if step.kind == "decode" and len(step.seqs) == requests:
            seen.add(step.num_steps)
        engine.finish_step(step)
    return seen


def test_the_dynamic_target_chooses_its_draft_steps_by_the_batch_size():
    """v1/core/sched/scheduler.py:1709-1714 with issue #49548's schedule [[1,4,2],[5,512,0]]:
    k = 2 up to 4 scheduled requests, 0 above; the static targets draft k at every size."""
    (dynamic, static) = build_targets(["vllm-mtp-dynamic", "vllm-mtp-k2"], "h200")
    engine = Engine(dynamic.profiles["mtp"], random.Random(0))
    assert _decode_steps(engine, 1) == {2}
    assert _decode_steps(engine, 4) == {2}
    assert _decode_steps(engine, 6) == {0}
    assert _decode_steps(Engine(static.profiles["mtp"], random.Random(0)), 6) == {2}
    # k = 0 frees nothing: the dynamic server keeps the static k = 2 server's memory and cap
    assert dynamic.profiles["mtp"].effective_max_running == static.profiles["mtp"].effective_max_running


def test_vllms_mtp_server_is_not_capped_at_48_but_by_its_mamba_pool():
    """config/speculative.py never sets max_num_seqs (SGLang resets it to 48 with speculation)."""
    found = caps(build_targets(["single-mtp", "vllm-mtp", "vllm-mtp-k2"], "h200"))
    assert found["single-mtp"] == {"mtp": 48}
    profile = vllm_profiles.single("mtp", "h200")
    assert profile.resolved_max_running_requests == vllm_profiles.MAX_NUM_SEQS
    assert found["vllm-mtp"]["mtp"] == profile.mamba_slots // profile.mamba_slots_per_request > 48
    # a larger k reserves more per request, so fewer run
    assert found["vllm-mtp-k2"]["mtp"] < found["vllm-mtp"]["mtp"]


def test_bench_sim_runs_the_vllm_targets_and_the_vllm_pairs_verdict(tmp_path, capsys):
    out_json = tmp_path / "out.json"
    args = ["bench", "--sim", "--no-progress", "--workload", "chat", "--concurrency", "1,8",
            "--requests-per-level", "8", "--max-tokens", "40", "--hardware", "rtx-pro-6000",
            "--json", str(out_json)]
    code = main([*args, *(a for name in VLLM_TARGETS for a in ("--target", name))])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out_json.read_text())
    assert list(data["results"]) == list(VLLM_TARGETS)
    for name, rows in data["results"].items():
        assert [r["requests"] for r in rows] == [8, 8] and not any(r["errors"] for r in rows), name
    assert set(data["meta"]["running_caps"]["vllm-pair"]) == {"mtp", "plain"}
    assert "The pair (vllm-pair) against the best single server" in out
