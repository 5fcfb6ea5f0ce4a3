"""calibrate's verdict: the pair (its better server per level) against one server owning the GPUs,
measured (--single) or estimated from the pair's measured curves and the memory model (--hardware).
The "measurements" here are the simulated pair's, in virtual time (deterministic)."""

import json

import pytest

from gateway.bench.calibrate import PAIR_BEST, estimated_singles, fitted_pair, pair_best
from gateway.bench.calibrate_cli import _measured_singles
from gateway.bench.levels import plan_levels
from gateway.bench.report import verdict, write_json
from gateway.bench.targets import build_targets, run_target_sweep
from gateway.bench.workloads import make_workload
from gateway.config import Routing
from gateway.sim.profile import load_profiles

pytestmark = pytest.mark.timeout(120)
PLANS = plan_levels([4, 24, 64], requests_per_level=128)


def workload():
    return make_workload("seed", max_tokens=200)


def measured_pair():
    """What calibrate measures: each of the pair's servers alone, on 4x RTX PRO 6000."""
    runs = run_target_sweep(workload, PLANS, Routing(), build_targets(["pair-mtp-only", "pair-plain-only"]))
    return {"mtp": runs["pair-mtp-only"], "plain": runs["pair-plain-only"]}


def test_pair_best_takes_the_better_server_per_level():
    results = measured_pair()
    best = pair_best(results["mtp"], results["plain"])
    for row, m, p in zip(best, results["mtp"], results["plain"], strict=True):
        assert row.target == PAIR_BEST
        assert row.aggregate_tps == max(m.aggregate_tps, p.aggregate_tps)


def test_the_estimate_gives_a_server_owning_the_gpus_its_memory_and_finds_it_ahead_at_c64():
    results = measured_pair()
    fitted = fitted_pair(load_profiles(), results, {"mtp": 24, "plain": 28}, 2.0, 1, greedy_repetitive=True)
    singles = estimated_singles(fitted, "rtx-pro-6000", workload, PLANS, Routing())
    assert set(singles) == {"single-plain", "single-mtp", "single-adaptive"}
    rows = {r["concurrency"]: r for r in
            verdict({PAIR_BEST: pair_best(results["mtp"], results["plain"]), **singles}, pair=PAIR_BEST)}
    # The same verdict as bench --sim: at C=64 a server owning the GPUs (48 or 64 running) beats
    # the pair (MTP 24 / plain 28 running).
    assert rows[64]["best_aggregate_target"] in singles and rows[64]["aggregate_ratio"] < 0.75
    plain_64 = singles["single-plain"][-1]
    assert plain_64.aggregate_tps > 1.3 * results["plain"][-1].aggregate_tps
    # At C=4 the pair's MTP server is the same server as a single MTP one: no loss.
    assert rows[4]["aggregate_ratio"] >= 0.99 or rows[4]["best_aggregate_target"] == "single-adaptive"


def test_a_measured_single_server_is_read_from_a_bench_json(tmp_path):
    results = measured_pair()
    path = tmp_path / "single.json"
    write_json(path, {"target": results["plain"]}, {"mode": "HTTP"})
    singles = _measured_singles([f"plain-alone={path}"])
    assert [r.target for r in singles["plain-alone"]] == ["plain-alone"] * 3
    assert singles["plain-alone"][2].aggregate_tps == results["plain"][2].aggregate_tps
    with pytest.raises(ValueError, match="NAME=JSON"):
        _measured_singles([str(path)])
    assert json.loads(path.read_text())["meta"]["mode"] == "HTTP"
