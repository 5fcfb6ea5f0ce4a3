"""bench --sim compares the pair through the gateway with single servers owning the GPUs."""

import json

import pytest

from gateway.bench.levels import plan_levels
from gateway.bench.report import verdict
from gateway.bench.targets import DEFAULT_TARGETS, build_targets, caps, run_target_sweep
from gateway.bench.workloads import make_workload
from gateway.cli import main
from gateway.config import Routing

pytestmark = pytest.mark.timeout(120)


def test_default_targets_are_the_pair_and_three_single_servers_with_their_own_memory():
    targets = build_targets(DEFAULT_TARGETS, "rtx-pro-6000")
    assert caps(targets) == {"gateway": {"mtp": 24, "plain": 28}, "single-plain": {"plain": 141},
                             "single-mtp": {"mtp": 48}, "single-adaptive": {"mtp": 48}}
    assert targets[3].profiles["mtp"].adaptive
    h200 = caps(build_targets(DEFAULT_TARGETS, "h200"))
    assert h200["gateway"] == {"mtp": 48, "plain": 100} and h200["single-plain"] == {"plain": 245}


def test_a_single_server_takes_every_request_and_beats_the_pairs_plain_at_high_load():
    plans = plan_levels([64], requests_per_level=128)
    results = run_target_sweep(lambda: make_workload("seed", max_tokens=100), plans, Routing(),
                               build_targets(["single-plain", "pair-plain-only"], "rtx-pro-6000"))
    single, pair_plain = results["single-plain"][0], results["pair-plain-only"][0]
    assert single.share == {"plain": 1.0} and single.errors == 0
    assert single.aggregate_tps > 1.5 * pair_plain.aggregate_tps  # 64 running against 28


def test_bench_sim_runs_all_four_targets_and_reports_the_verdict(tmp_path, capsys):
    out_json = tmp_path / "out.json"
    code = main(["bench", "--sim", "--no-progress", "--workload", "chat", "--concurrency", "1,4",
                 "--requests-per-level", "4", "--max-tokens", "40", "--hardware", "h200",
                 "--memory", "split", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out_json.read_text())
    assert list(data["results"]) == list(DEFAULT_TARGETS)
    assert data["meta"]["hardware"] == "4x H200 (141 GB)"
    assert data["meta"]["running_caps"]["single-plain"] == {"plain": 245}
    assert "The pair (gateway) against the best single server" in out
    assert "Running caps: gateway mtp 48, plain 100; single-plain plain 245" in out


def test_verdict_names_the_best_other_target_per_level():
    plans = plan_levels([2], requests_per_level=4)
    results = run_target_sweep(lambda: make_workload("seed", max_tokens=50), plans, Routing(),
                               build_targets(DEFAULT_TARGETS, "rtx-pro-6000"))
    (row,) = verdict(results)
    # At C=2 on the seed's repeated token the adaptive server drafts up to 7 steps, all accepted.
    assert row["best_aggregate_target"] == "single-adaptive"
    assert row["aggregate_ratio"] == pytest.approx(
        results["gateway"][0].aggregate_tps / results["single-adaptive"][0].aggregate_tps)


def test_unknown_target_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown target"):
        build_targets(["single-vllm"])
