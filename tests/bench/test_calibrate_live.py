"""`calibrate` against the simulated SGLang pair on real sockets (speed 2, short outputs): on the
seed workload, on another workload (agentic) and on a trace (Mooncake's format).

The pair, the sockets and calibrate's clients share one event loop whose clock is looptime's: it
moves only when every task waits for a timer, so the curves are the modelled pair's, the same on
every run. On the wall clock a loaded machine starved the simulator (its steps came late, plain's
48 streams the most): with 2 busy loops, two runs at once and the other jobs of a shared 2-core
box (load ~8), 7 of 8 runs measured no crossover at all, and one helper's run measured 18.
"""

import argparse
import asyncio
import json
import re
from pathlib import Path

import pytest

from gateway.bench import calibrate_cli
from gateway.bench.calibrate import set_routing_values
from gateway.config import load_settings
from gateway.sim.profile import load_profiles, seed_profiles
from gateway.sim.server import SimOptions, start_sim_pair

# A venv installed before looptime joined the test extras skips with how to fix it (CI installs it).
looptime = pytest.importorskip("looptime", reason="pip install -e '.[test]' (looptime is a test extra)")

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "tests" / "data" / "traces" / "mooncake_sample.jsonl"


def _on_looptime(coroutine_function, *args):
    # A loop on looptime's clock from its first tick (its time starts at 0).
    with asyncio.Runner(loop_factory=looptime.new_event_loop) as runner:
        return runner.run(coroutine_function(*args))


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "config.yaml"
    # Start from a wrong value so the write is visible.
    config.write_text(set_routing_values((ROOT / "config.yaml").read_text(), {"crossover": 90}))
    assert load_settings(config).routing.crossover == 90
    return config


async def _calibrate_seed_pair(*argv: str) -> int:
    """calibrate ARGV against the seed's simulated servers at speed 2."""
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    # The seed's caps (68 plain, 24 MTP): the pair sharing 96 GB GPUs has a plain server of only
    # 28 running, which never overtakes MTP on the seed workload (tests/sim/test_memory.py).
    async with start_sim_pair(SimOptions(profiles=seed_profiles(), speed=2)) as pair:
        args = parser.parse_args(["--mtp", pair.urls["mtp"], "--plain", pair.urls["plain"],
                                  "--speed", "2", "--no-progress", *argv])
        return await calibrate_cli.calibrate(args)


def _chosen(out: str) -> int:
    match = re.search(r"chosen: the aggregate crossing, crossover = (\d+)", out)
    assert match, out
    return int(match.group(1))


@pytest.mark.timeout(60)
def test_calibrate_finds_the_crossover_and_writes_it(tmp_path, capsys):
    config = _config(tmp_path)
    profiles = tmp_path / "profiles.yaml"
    assert _on_looptime(_calibrate_seed_pair, "--concurrency", "8,24,32,48", "--max-tokens", "48",
                        "--write", str(config), "--profile-out", str(profiles),
                        "--hardware", "rtx-pro-6000") == 0
    out = capsys.readouterr().out
    crossover = load_settings(config).routing.crossover
    assert 24 <= crossover <= 64, out
    routing = load_settings(config).routing
    if getattr(routing, "capacity_guard", True):
        assert crossover == 24  # capped at MTP's running cap
    else:
        assert crossover > 24, out  # MTP queues past its cap while that still pays
    assert "aggregate tok/s crossing: equal at C =" in out
    assert "per-request tok/s crossing: " in out
    # and what one server owning the GPUs would have done, estimated from these curves
    assert "## The pair against one server owning the GPUs" in out
    assert "estimated in virtual time for 4x RTX PRO 6000 Blackwell (96 GB)" in out
    assert f"written to {config} (the aggregate crossing)" in out
    # Only the value changed: every comment line of the original is still there.
    original = [ln for ln in (ROOT / "config.yaml").read_text().splitlines() if ln.lstrip().startswith("#")]
    assert [ln for ln in config.read_text().splitlines() if ln.lstrip().startswith("#")] == original
    fitted = load_profiles(profiles)
    assert fitted["mtp"].effective_max_running == 24 and fitted["mtp"].speculative
    assert fitted["plain"].effective_max_running == 68


@pytest.mark.timeout(60)
def test_calibrate_on_a_mooncake_trace_writes_the_crossover(tmp_path, capsys):
    """The trace's 8 requests closed-loop at each level, in its order from its first and again
    past its end, with their exact output lengths; the crossing is written."""
    config, report = _config(tmp_path), tmp_path / "calibrate.json"
    assert _on_looptime(_calibrate_seed_pair, "--trace", str(MOONCAKE), "--concurrency", "4,24,32,48",
                        "--write", str(config), "--json", str(report)) == 0
    out = capsys.readouterr().out
    crossover = load_settings(config).routing.crossover
    assert crossover == _chosen(out) and 4 <= crossover < 48, out
    assert f"written to {config} (the aggregate crossing)" in out
    assert "## calibrate: mooncake trace mooncake_sample.jsonl" in out
    assert "Closed loop on the trace's 8 requests in its order (arrival times not used)" in out
    # every level sent 3 requests per client (makespan), the trace's outputs from its first:
    # C=4's 12 are its 8, then its first 4 again (in timestamp order)
    outputs = [json.loads(line)["output_length"] for line in MOONCAKE.read_text().splitlines()]
    stamps = [json.loads(line)["timestamp"] for line in MOONCAKE.read_text().splitlines()]
    in_order = [o for _, o in sorted(zip(stamps, outputs, strict=True), key=lambda p: p[0])]
    data = json.loads(report.read_text())
    assert data["meta"]["trace"] == str(MOONCAKE) and data["meta"]["trace_format"] == "mooncake"
    for target in ("mtp", "plain"):
        for level in data["results"][target]:
            sent = 3 * level["concurrency"]
            assert level["requests"] == sent and level["errors"] == 0
            assert level["output_tokens"] == sum(in_order[i % 8] for i in range(sent))
    assert "note: at C=4, 24, 32, 48 more than the trace's 8 requests were sent" in out


@pytest.mark.timeout(60)
def test_calibrate_on_a_session_workload_writes_the_crossover(tmp_path, capsys):
    """A workload of sessions (agentic: turns, think times, sub-agent bursts), as the agent
    workload will be: calibrate runs whatever make_workload makes."""
    config = _config(tmp_path)
    assert _on_looptime(_calibrate_seed_pair, "--workload", "agentic", "--concurrency", "2,40",
                        "--requests-per-level", "40", "--max-tokens", "16",
                        "--write", str(config)) == 0
    out = capsys.readouterr().out
    assert "## calibrate: agentic workload" in out
    assert load_settings(config).routing.crossover == _chosen(out)
    assert f"written to {config} (the aggregate crossing)" in out
