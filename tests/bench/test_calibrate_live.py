"""`calibrate` against the simulated SGLang pair on real sockets (speed 2, short outputs).

The pair, the sockets and calibrate's clients share one event loop whose clock is looptime's: it
moves only when every task waits for a timer, so the curves are the modelled pair's, the same on
every run. On the wall clock a loaded machine starved the simulator (its steps came late, plain's
48 streams the most): with 2 busy loops, two runs at once and the other jobs of a shared 2-core
box (load ~8), 7 of 8 runs measured no crossover at all, and one helper's run measured 18.
"""

import argparse
import asyncio
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


@pytest.mark.timeout(60)
def test_calibrate_finds_the_crossover_and_writes_it(tmp_path, capsys):
    # A loop on looptime's clock from its first tick (its time starts at 0).
    with asyncio.Runner(loop_factory=looptime.new_event_loop) as runner:
        runner.run(_calibrate_finds_the_crossover_and_writes_it(tmp_path, capsys))


async def _calibrate_finds_the_crossover_and_writes_it(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    # Start from a wrong value so the write is visible.
    config.write_text(set_routing_values((ROOT / "config.yaml").read_text(), {"crossover": 90}))
    assert load_settings(config).routing.crossover == 90
    profiles = tmp_path / "profiles.yaml"
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    # The seed's caps (68 plain, 24 MTP): the pair sharing 96 GB GPUs has a plain server of only
    # 28 running, which never overtakes MTP on the seed workload (tests/sim/test_memory.py).
    async with start_sim_pair(SimOptions(profiles=seed_profiles(), speed=2)) as pair:
        args = parser.parse_args([
            "--mtp", pair.urls["mtp"], "--plain", pair.urls["plain"],
            "--concurrency", "8,24,32,48", "--max-tokens", "48", "--speed", "2",
            "--write", str(config), "--profile-out", str(profiles), "--no-progress",
            "--hardware", "rtx-pro-6000"])
        assert await calibrate_cli.calibrate(args) == 0
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
