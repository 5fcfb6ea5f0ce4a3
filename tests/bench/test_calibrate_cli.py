"""`calibrate --objective`: both crossings printed, the chosen one written and named; what the
clients send (--workload, --trace) and the flags refused together.

The sweep is replaced by fixed curves (tests/bench/test_units.py's SPLIT: aggregate tok/s cross
at 30.0, per-request tok/s at 38.1); the live sweep is in test_calibrate_live.py.
"""

import argparse
import asyncio
import re
import shutil
from pathlib import Path

import pytest

from gateway.bench import calibrate_cli
from gateway.bench.calibrate import set_routing_values
from gateway.bench.traces import RecordedSessions
from gateway.bench.workloads import WORKLOADS
from gateway.config import load_settings
from gateway.turns.decision import measured_gain_per_crossover
from tests.bench.test_units import SPLIT

ROOT = Path(__file__).resolve().parents[2]


async def _split_sweep(*_args, **_kwargs):
    return {"mtp": SPLIT[0], "plain": SPLIT[1]}


async def _calibrate(monkeypatch, tmp_path, *extra: str, sweep=_split_sweep) -> tuple[int, Path]:
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


# --- what the clients send: --workload or --trace ----------------------------------------------

TRACES = ROOT / "tests" / "data" / "traces"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("argv", "message"), [
    (["--trace", str(TRACES / "mooncake_sample.jsonl"), "--workload", "chat"],
     "--trace replaces --workload: give one of them"),
    (["--trace-format", "mooncake"], "--trace-format needs --trace"),
    (["--trace", str(TRACES / "absent.jsonl")], "absent.jsonl"),
    (["--trace", str(TRACES / "mooncake_sample.jsonl"), "--trace-format", "agentic"], "not JSON"),
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--warmup", "5"], "--warmup needs --duration"),
    (["--requests-per-level", "0"], "--requests-per-level must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--config", "elsewhere.yaml"], "--config and --write name different files"),
    (["--write", "absent/config.yaml"], "cannot read config file absent/config.yaml"),
    # agent sessions wait minutes to hours for their users: a makespan level would measure that
    (["--workload", "agent"], "the agent workload needs --duration S (the steady method)"),
    (["--sim"], "give --mtp URL and --plain URL (your servers), or --sim (the simulated pair)"),
    (["--memory", "turns"], "--memory is the simulated pair's (--sim)"),
])
async def test_flags_that_mean_nothing_together_are_refused_in_one_line(monkeypatch, tmp_path, capsys,
                                                                         argv, message):
    async def no_sweep(*_args, **_kwargs):
        raise AssertionError("refused flags must not start a sweep")

    code, config = await _calibrate(monkeypatch, tmp_path, *argv, sweep=no_sweep)
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert err.startswith("mtp-gateway calibrate: ") and err.count("\n") == 1, err
    assert config.read_text() == (ROOT / "config.yaml").read_text()


@pytest.mark.timeout(30)
async def test_a_trace_is_swept_closed_loop_with_its_requests(monkeypatch, tmp_path, capsys):
    """What calibrate hands the sweep for a trace: the trace's closed-loop view, the same
    object at every level (parsed once), its format's sessions kept (recorded: by
    x-session-id)."""
    seen = []

    async def sweep(_targets, workload_factory, _plans, **_kwargs):
        seen.extend(workload_factory() for _ in range(2))
        return await _split_sweep()

    code, config = await _calibrate(monkeypatch, tmp_path, "--trace", str(TRACES / "recorded_sample.jsonl"),
                                    sweep=sweep)
    out = capsys.readouterr().out
    assert code == 0 and load_settings(config).routing.crossover == 30
    assert seen[0] is seen[1] and isinstance(seen[0], RecordedSessions)
    assert "## calibrate: recorded trace recorded_sample.jsonl" in out
    assert "Closed loop on the trace's 3 requests in its order (arrival times not used)" in out


def test_help_lists_the_workloads_and_says_why_a_trace_runs_closed_loop():
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert all(name in help_text for name in WORKLOADS) and "file:PATH.jsonl" in help_text
    assert "--trace-format {mooncake,agentic,recorded}" in help_text
    assert "Its arrival times are not used: the crossover is a number of requests in flight" in help_text
    # the crossover's dependence on the traffic is explained where the help points
    assert "README" not in help_text
    anchor = "docs/results.md#calibrating-against-the-simulator"
    assert anchor in help_text
    assert "\n## Calibrating against the simulator\n" in (ROOT / "docs" / "results.md").read_text()


# --- the simulated pair in virtual time: --sim ----------------------------------------------------

@pytest.mark.timeout(60)
def test_sim_on_agent_sessions_writes_the_crossover_where_plain_overtakes(tmp_path, capsys):
    """No servers: both of the simulated pair's servers over the agent workload's sessions in
    virtual time, steady levels (a level stops once its counted requests end, not its sessions)."""
    config = tmp_path / "config.yaml"
    config.write_text(set_routing_values((ROOT / "config.yaml").read_text(), {"crossover": 90}))
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    args = parser.parse_args(["--sim", "--workload", "agent", "--concurrency", "4,64", "--duration", "30",
                              "--warmup", "10", "--max-tokens", "16", "--write", str(config)])
    assert asyncio.run(calibrate_cli.calibrate(args)) == 0
    out = capsys.readouterr().out
    assert "## calibrate: agent workload, the simulated pair (split memory, 4x RTX PRO 6000" in out
    rows = {(int(c), target): float(agg.replace(",", "")) for c, target, agg in
            re.findall(r"^\| (\d+) \| (mtp|plain) \| [\d.]+ \| ([\d,]+) \|", out, re.M)}
    assert set(rows) == {(c, t) for c in (4, 64) for t in ("mtp", "plain")}
    assert rows[64, "plain"] > rows[64, "mtp"]  # plain overtakes MTP at 64 sessions ...
    chosen = re.search(r"chosen: the aggregate crossing, crossover = (\d+)", out)
    assert chosen and 1 <= int(chosen[1]) < 64  # ... so a crossover below it is written
    assert load_settings(config).routing.crossover == int(chosen[1])
    assert f"written to {config} (the aggregate crossing)" in out
    # and how fast plain pulls ahead past it, from the level measured there (64 sessions)
    gain = measured_gain_per_crossover(64, int(chosen[1]), rows[64, "plain"], rows[64, "mtp"])
    assert load_settings(config).turns.gain_per_crossover == pytest.approx(gain, abs=0.002)
    assert f"turns:\n  gain_per_crossover: {load_settings(config).turns.gain_per_crossover}\n" in out
