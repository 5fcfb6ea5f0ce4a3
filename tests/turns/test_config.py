"""`memory: auto | split | turns`, per pair or for all, and the `turns` section's bounds."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, build_settings

PAIR = {"mtp": {"url": "http://a:1"}, "plain": {"url": "http://a:2"}}


def test_auto_unless_said():
    settings = build_settings({})
    assert [settings.memory_of(p) for p in settings.fleet()] == ["auto"]


def test_the_top_level_shape_is_every_pairs_unless_the_pair_says():
    settings = build_settings({"memory": "turns", "pairs": [
        {"name": "a", **PAIR}, {"name": "b", **PAIR, "memory": "split"}]})
    assert [settings.memory_of(p) for p in settings.fleet()] == ["turns", "split"]
    one = build_settings({"memory": "turns"})
    assert settings.memory_of(one.fleet()[0]) == "turns"


@pytest.mark.parametrize("data,key", [
    ({"memory": "shared"}, "memory"),
    ({"pairs": [{"name": "a", **PAIR, "memory": "both"}]}, "pairs.0.memory"),
    ({"turns": {"wait_max_s": 0}}, "turns.wait_max_s"),
    ({"turns": {"wait_max_requests": -1}}, "turns.wait_max_requests"),
    ({"turns": {"min_free_fraction": 1.5}}, "turns.min_free_fraction"),
    ({"turns": {"bogus": 1}}, "turns.bogus"),
])
def test_bad_values_name_their_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_settings(data)
