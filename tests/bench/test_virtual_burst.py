"""A burst from idle, in virtual time: all C clients start together, 3 requests each (the seed's
makespan method). Before the flip moved MTP's unstarted requests, the first `crossover` of the
burst stayed on MTP, which ran 24 and queued the rest behind 1000-token generations while plain
took the others; the two time-sliced the GPU until MTP drained (seed C=32: 1,267 tok/s against
plain-only's 1,621)."""

import json

import pytest

from gateway.bench.levels import plan_levels
from gateway.bench.stats import summarise
from gateway.bench.virtual import routing_for, run_virtual_level
from gateway.bench.workloads import make_workload
from gateway.cli import main
from gateway.config import Routing
from gateway.sim.profile import seed_profiles

pytestmark = pytest.mark.timeout(120)
ROUTING = Routing()  # the defaults: crossover 31, unstarted requests move at the flip
# The seed's caps (plain 68, MTP 24), which crossover 31 was fitted to; the pair's own memory
# (load_profiles(): plain 28 on 96 GB) is another routing problem (tests/bench/test_virtual_done_when.py).


def aggregate(policy: str, concurrency: int, routing: Routing = ROUTING) -> float:
    (plan,) = plan_levels([concurrency])
    records, wall = run_virtual_level(make_workload("seed", max_tokens=300), plan,
                                      routing_for(policy, routing), seed_profiles())
    return summarise(policy, concurrency, records, wall).aggregate_tps


@pytest.mark.parametrize("concurrency", [32, 64])
def test_a_burst_from_idle_runs_as_fast_as_the_better_server(concurrency: int) -> None:
    best = max(aggregate("mtp-only", concurrency), aggregate("plain-only", concurrency))
    assert aggregate("crossover", concurrency) >= 0.95 * best


def test_without_the_move_the_burst_is_pinned_on_mtp() -> None:
    pinned = aggregate("crossover", 32, ROUTING.model_copy(update={"move_unstarted": False}))
    assert pinned < 0.9 * aggregate("plain-only", 32)


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(["bench", "--sim", "--no-progress", *args])
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def test_the_cli_runs_the_seeds_method_with_a_routing_override(tmp_path, capsys) -> None:
    out_json = tmp_path / "burst.json"
    code, out, _ = run_cli(["--workload", "seed", "--concurrency", "32", "--makespan",
                            "--max-tokens", "300", "--policy", "crossover",
                            "--routing", "move_unstarted=false", "--json", str(out_json)], capsys)
    assert code == 0
    assert "Method: makespan: 96 requests per level." in out
    meta = json.loads(out_json.read_text())["meta"]
    assert meta["routing"]["move_unstarted"] is False


@pytest.mark.parametrize(("override", "message"), [
    ("nope=1", "KEY=VALUE with a key of the routing section"),
    ("crossover_bounds=[2, 4]", "crossover_bounds"),
])
def test_a_bad_routing_override_is_a_clear_error(override, message, capsys) -> None:
    code, _, err = run_cli(["--concurrency", "4", "--makespan", "--routing", override], capsys)
    assert code == 2 and message in err
