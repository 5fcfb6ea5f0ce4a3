"""docs/results.md's headline: wins, ties and losses of the pair per bench --sim JSON."""

from gateway.bench.headline import headline, main
from gateway.bench.report import write_json
from gateway.bench.stats import LevelResult


def level(target: str, c: int, aggregate: float) -> LevelResult:
    nan = float("nan")
    return LevelResult(target, c, 10, 0, nan, aggregate, aggregate / c, 0.0, 1.0,
                       nan, nan, nan, nan, nan, nan, {})


def test_levels_are_wins_ties_or_losses_against_the_best_single_server(tmp_path, capsys):
    path = tmp_path / "run.json"
    results = {"gateway": [level("gateway", 1, 100), level("gateway", 8, 500), level("gateway", 64, 1000)],
               "single-plain": [level("single-plain", c, a) for c, a in ((1, 90), (8, 505), (64, 2000))],
               "single-mtp": [level("single-mtp", c, a) for c, a in ((1, 80), (8, 300), (64, 1500))]}
    write_json(path, results, {"hardware": "4x test GPU", "workload": "seed"})
    row = headline([path]).splitlines()[2]
    assert row == ("| 4x test GPU | seed | C = 1 (× 1.11) | C = 8 (× 0.99) | C = 64 (× 0.50) "
                   "| single-plain at C = 64 |")
    assert main(["--exclude", "single-plain", str(path)]) == 0
    assert "C = 64 (× 0.67)" in capsys.readouterr().out
