"""`mtp-gateway demo --memory turns` runs the simulated pair in turns mode and the gateway
with `memory: turns`; `mtp-gateway sim --memory` takes the same two shapes."""

from __future__ import annotations

from typing import Any

import pytest

from gateway import cli
from gateway.config import build_settings


@pytest.mark.timeout(30)
async def test_demo_with_turns_memory_starts_a_turns_pair(monkeypatch):
    seen: dict[str, Any] = {}

    async def serve(settings, config_path, log_level):  # instead of serving forever
        seen["memory"] = settings.memory_of(settings.fleet()[0])

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli, "_port", lambda url: 0)  # any free port
    from gateway.sim import server as sim_server
    started = sim_server.start_sim_pair

    def start(options):
        seen["sim"] = options.memory
        return started(options)

    monkeypatch.setattr(sim_server, "start_sim_pair", start)
    settings = build_settings({"backends": {"mtp": {"url": "http://127.0.0.1:0"},
                                            "plain": {"url": "http://127.0.0.1:0"}}})
    await cli.demo(settings, None, "warning", speed=200, memory="turns")
    assert seen == {"memory": "turns", "sim": "turns"}


@pytest.mark.parametrize("command", ["demo", "sim"])
def test_an_unknown_memory_shape_is_refused(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--memory", "shared"])
    assert exit_.value.code == 2
    assert "invalid choice: 'shared' (choose from 'split', 'turns')" in capsys.readouterr().err
