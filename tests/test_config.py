"""Configuration: the shipped file loads, env overrides it, mistakes name their key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, build_settings, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_config_equals_the_defaults() -> None:
    assert load_settings(ROOT / "config.yaml") == build_settings({})


def test_environment_overrides_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ROUTING__CROSSOVER", "40")
    monkeypatch.setenv("GATEWAY_BACKENDS__MTP__URL", "http://sglang-mtp:30001")
    settings = load_settings(ROOT / "config.yaml")
    assert settings.routing.crossover == 40
    assert settings.backends.mtp.url == "http://sglang-mtp:30001"
    assert settings.backends.plain.url == "http://127.0.0.1:30002"


@pytest.mark.parametrize(("data", "key"), [
    ({"routing": {"crossover": "many"}}, "routing.crossover"),
    ({"routing": {"crossover": 4, "hysteresis": 4}}, "hysteresis must be smaller"),
    ({"backends": {"mtp": {"url": "ftp://x"}}}, "backends.mtp"),
    ({"routing": {"polcy": "crossover"}}, "routing.polcy"),
    ({"timeouts": {"idle_s": -1}}, "timeouts.idle_s"),
])
def test_invalid_config_names_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_settings(data)


def test_cli_exits_2_on_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "config.yaml"
    bad.write_text("routing:\n  crossover: -3\n")
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--config", str(bad)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "routing.crossover" in result.stderr
