"""`calibrate --objective`: both crossings printed, the chosen one written and named.

The sweep is replaced by fixed curves (tests/bench/test_units.py's SPLIT: aggregate tok/s cross
at 30.0, per-request tok/s at 38.1); the live sweep is in test_calibrate_live.py.
"""

import argparse
import shutil
from pathlib import Path

import pytest

from gateway.bench import calibrate_cli
from gateway.config import load_settings
from tests.bench.test_units import SPLIT

ROOT = Path(__file__).resolve().parents[2]


async def _calibrate(monkeypatch, tmp_path, *extra: str) -> tuple[int, Path]:
    async def sweep(*_args, **_kwargs):
        return {"mtp": SPLIT[0], "plain": SPLIT[1]}

    async def no_server_info(*_args):
        return {}

    monkeypatch.setattr(calibrate_cli, "run_http_sweep", sweep)
    monkeypatch.setattr(calibrate_cli, "_server_info", no_server_info)
    config = tmp_path / "config.yaml"
    shutil.copy(ROOT / "config.yaml", config)
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    args = parser.parse_args(["--mtp", "http://mtp.invalid", "--plain", "http://plain.invalid",
                              "--write", str(config), "--no-progress", *extra])
    return await calibrate_cli.calibrate(args), config


@pytest.mark.timeout(30)
async def test_default_objective_writes_the_aggregate_crossing(monkeypatch, tmp_path, capsys):
    code, config = await _calibrate(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert code == 0 and load_settings(config).routing.crossover == 30
    assert "aggregate tok/s crossing: equal at C = 30.0" in out
    assert "per-request tok/s crossing: equal at C = 38.1" in out
    assert "objective: aggregate (the default)" in out
    assert f"written to {config} (the aggregate crossing)" in out


@pytest.mark.timeout(30)
async def test_per_request_objective_writes_the_per_request_crossing(monkeypatch, tmp_path, capsys):
    code, config = await _calibrate(monkeypatch, tmp_path, "--objective", "per-request")
    out = capsys.readouterr().out
    assert code == 0 and load_settings(config).routing.crossover == 38
    assert "aggregate tok/s crossing: equal at C = 30.0" in out
    assert "chosen: the per-request crossing, crossover = 38" in out
    assert f"written to {config} (the per-request crossing)" in out


def test_objective_help_states_the_default(capsys):
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert "--objective {aggregate,per-request}" in help_text
    assert "(the default: the pair's capacity" in help_text
