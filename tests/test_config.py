"""Configuration: the shipped file loads, env overrides it, mistakes name their key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, build_settings, load_settings
from gateway.routing.pool import Pool

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


# --- pairs -------------------------------------------------------------------------------------

def pair(name: str, routing: dict | None = None) -> dict:
    return {"name": name, "mtp": {"url": f"http://{name}:30001"},
            "plain": {"url": f"http://{name}:30002"}, "routing": routing or {}}


def test_backends_alone_are_one_pair_named_default() -> None:
    (only,) = build_settings({}).fleet()
    assert (only.name, only.mtp.url, only.plain.url) == (
        "default", "http://127.0.0.1:30001", "http://127.0.0.1:30002")


def test_each_pair_has_its_own_routing_values_over_the_section() -> None:
    settings = build_settings({"routing": {"crossover": 40, "hysteresis": 8},
                               "pairs": [pair("a", {"crossover": 20}), pair("b")]})
    a, b = (settings.routing_for(p) for p in settings.fleet())
    assert (a.crossover, a.hysteresis, b.crossover, b.hysteresis) == (20, 8, 40, 8)


@pytest.mark.parametrize(("data", "words"), [
    ({"backends": {}, "pairs": [pair("a")]}, "`backends` (one pair) or `pairs`, not both"),
    ({"pairs": [pair("a"), pair("a")]}, "pair names must differ"),
    ({"pairs": [pair("a", {"max_sessions": 3})]}, "pairs.0.routing"),
    ({"pairs": [pair("a", {"hysteresis": 40})]}, "pairs.a.routing"),
    ({"pairs": [pair("a b")]}, "pairs.0.name"),
])
def test_a_bad_pair_is_named(data: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build_settings(data)


def test_the_documented_pairs_examples_load() -> None:
    import yaml

    deploy = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    block = deploy.split("## Several pairs, several gateways")[1].split("```yaml\n")[1]
    settings = build_settings(yaml.safe_load(block.split("```")[0]))
    assert [p.name for p in settings.fleet()] == ["node-a", "node-b"]
    commented = (ROOT / "config.yaml").read_text(encoding="utf-8").split("# pairs:\n")[1]
    lines = [line[2:] for line in commented.split("\nrouting:")[0].splitlines()]
    settings = build_settings(yaml.safe_load("pairs:\n" + "\n".join(lines)))
    assert [p.name for p in settings.fleet()] == ["node-a", "node-b"]


# --- models ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("aliases", "words"), [
    ({"": "served"}, "an alias must not be empty"),
    ({"claude-*": " "}, "alias 'claude-\\*' maps to an empty model name"),
    ({"claude-[": "served"}, "alias 'claude-\\[': a '\\[' in a pattern must be closed by '\\]'"),
    ({"x[ab][": "served"}, "must be closed"),
    ({"claude-*": "qwen-*"}, "the served model is a name, not a pattern"),
    ({"claude-*": 3}, "models.aliases.claude-\\*"),
])
def test_a_bad_alias_fails_at_load_and_says_which(aliases: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        build_settings({"models": {"aliases": aliases}})


def test_the_brackets_fnmatch_reads_as_sets_are_closed() -> None:
    settings = build_settings({"models": {"aliases": {"o[0-9]*": "a", "[]x]": "b", "[!]]y": "c"}}})
    assert [settings.models.served_name(n) for n in ("o3-mini", "]", "zy")] == ["a", "b", "c"]


def test_aliases_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_MODELS__ALIASES", '{"claude-*": "Qwen/Qwen3.5-122B-A10B"}')
    settings = load_settings(ROOT / "config.yaml")
    assert settings.models.served_name("claude-sonnet-4-5") == "Qwen/Qwen3.5-122B-A10B"


def test_the_documented_alias_examples_load_and_map_the_agents_default_names() -> None:
    import yaml

    clients = (ROOT / "docs" / "clients.md").read_text(encoding="utf-8")
    block = clients.split("## Their default model names")[1].split("```yaml\n")[1]
    documented = build_settings(yaml.safe_load(block.split("```")[0])).models
    commented = (ROOT / "config.yaml").read_text(encoding="utf-8").split("  # aliases:\n")[1]
    lines = [line.replace("#", "", 1) for line in commented.split("  # GET")[0].splitlines()]
    shipped = build_settings({"models": yaml.safe_load("aliases:\n" + "\n".join(lines))}).models
    for models in (documented, shipped):
        for name in ("claude-sonnet-4-5-20250929", "claude-haiku-4-5-20251001", "gpt-5-codex"):
            assert models.served_name(name) == "Qwen/Qwen3.5-122B-A10B", name


def test_the_engine_is_the_pairs_own_else_the_top_levels_else_sglang():
    pair = {"mtp": {"url": "http://a:1"}, "plain": {"url": "http://a:2"}}
    settings = build_settings({"engine": "vllm", "pairs": [
        {"name": "a", **pair}, {"name": "b", "engine": "sglang", **pair}]})
    assert [settings.engine_of(p) for p in settings.fleet()] == ["vllm", "sglang"]
    default = build_settings({})
    assert default.engine_of(default.fleet()[0]) == "sglang"
    pool = Pool.from_settings(settings, 0.0)
    assert {name: b.engine for name, b in pool.backends.items()} == {
        "a/mtp": "vllm", "a/plain": "vllm", "b/mtp": "sglang", "b/plain": "sglang"}
    with pytest.raises(ConfigError, match="engine: Input should be 'sglang' or 'vllm'"):
        build_settings({"engine": "trtllm"})
