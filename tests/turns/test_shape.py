"""`memory: auto` decided from what both servers say of SGLang's memory saver or vLLM's sleep
mode (gateway/turns/shape.py), and how a /server_info answer is read by each engine's module
(gateway/upstream/engine/sglang.py, vllm.py)."""

from __future__ import annotations

import itertools
import json

import pytest

from gateway.turns.shape import choose_shape
from gateway.upstream.engine.sglang import memory_saver_report
from gateway.upstream.engine.vllm import sleep_mode_report

REPORTS = ("on", "off", "unsaid", "no_controls", "silent")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("mtp, plain", list(itertools.product(REPORTS, REPORTS)))
def test_auto_turns_only_where_both_servers_run_the_memory_saver(mtp, plain, engine):
    choice = choose_shape("auto", {"mtp": mtp, "plain": plain}, engine)
    if {"off", "unsaid", "no_controls"} & {mtp, plain}:
        # one server that cannot release settles it, whatever the other says or does not yet
        assert choice.shape == "split"
    elif "silent" in (mtp, plain):
        assert choice.shape is None  # decided when it answers
    else:
        assert choice.shape == "turns"
    assert choice.setting == "auto" and choice.reason.startswith("auto: ")


def test_the_reason_names_the_server_and_what_it_lacks():
    off = choose_shape("auto", {"mtp": "on", "plain": "off"})
    assert off.reason == "auto: plain runs without --enable-memory-saver"
    unsaid = choose_shape("auto", {"mtp": "unsaid", "plain": "on"})
    assert unsaid.reason == "auto: mtp does not say enable_memory_saver in /server_info"
    waiting = choose_shape("auto", {"mtp": "silent", "plain": "on"})
    assert "waiting for mtp to answer /server_info" in waiting.reason


def test_a_vllm_pair_s_reason_is_in_vllm_s_words():
    off = choose_shape("auto", {"mtp": "on", "plain": "off"}, "vllm")
    assert off.reason == "auto: plain runs without --enable-sleep-mode"
    closed = choose_shape("auto", {"mtp": "no_controls", "plain": "on"}, "vllm")
    assert closed.reason == ("auto: mtp serves no /server_info: it runs without VLLM_SERVER_DEV_MODE=1, "
                             "so no /sleep or /wake_up either")
    unsaid = choose_shape("auto", {"mtp": "on", "plain": "unsaid"}, "vllm")
    assert unsaid.reason == "auto: plain does not say model_config.enable_sleep_mode in /server_info"
    both = choose_shape("auto", {"mtp": "on", "plain": "on"}, "vllm")
    assert both.reason == "auto: both servers run with --enable-sleep-mode in dev mode"
    waiting = choose_shape("auto", {"mtp": "on", "plain": "silent"}, "vllm")
    assert "waiting for plain" in waiting.reason and "--enable-sleep-mode" in waiting.reason


@pytest.mark.parametrize("setting", ["split", "turns"])
def test_a_configured_shape_is_forced_whatever_the_servers_say(setting):
    for mtp, plain in itertools.product(REPORTS, REPORTS):
        choice = choose_shape(setting, {"mtp": mtp, "plain": plain})
        assert (choice.shape, choice.reason) == (setting, f"memory: {setting} in the configuration")


@pytest.mark.parametrize("status, body, report", [
    (200, {"enable_memory_saver": True, "tp_size": 4}, "on"),
    (200, {"enable_memory_saver": False}, "off"),
    (200, {"max_running_requests": 48}, "unsaid"),  # an engine without the setting
    (200, {"enable_memory_saver": "true"}, "unsaid"),  # not SGLang's boolean
    (200, ["not", "an", "object"], "unsaid"),
    (404, {"detail": "Not Found"}, "unsaid"),  # no /server_info: not SGLang, or its router
    (405, {}, "unsaid"),
    (503, {}, "silent"),  # starting, or busy: asked again
    (None, None, "silent"),  # no answer
])
def test_a_server_info_answer_says_on_off_unsaid_or_nothing_yet(status, body, report):
    assert memory_saver_report(status, json.dumps(body).encode()) == report


def test_a_server_info_that_is_not_json_says_nothing_of_the_saver():
    assert memory_saver_report(200, b"<html>") == "unsaid"


def _vllm_info(model_config: object) -> dict[str, object]:
    """dev/server_info/api_router.py:43-60 with config_format=json."""
    return {"vllm_config": {"model_config": model_config, "scheduler_config": {"max_num_seqs": 128}},
            "vllm_env": {"VLLM_SERVER_DEV_MODE": True}, "system_env": {}}


@pytest.mark.parametrize("status, body, report", [
    (200, _vllm_info({"enable_sleep_mode": True, "max_model_len": 262144}), "on"),
    (200, _vllm_info({"enable_sleep_mode": False}), "off"),
    (200, _vllm_info({"max_model_len": 262144}), "unsaid"),
    (200, _vllm_info("ModelConfig(...)"), "unsaid"),  # the text format: nothing to read
    (200, {"enable_memory_saver": True}, "unsaid"),  # SGLang's answer is not vLLM's
    (404, {"detail": "Not Found"}, "no_controls"),  # no VLLM_SERVER_DEV_MODE=1: no dev routes
    (405, {}, "no_controls"),
    (503, {}, "silent"),
    (None, None, "silent"),
])
def test_a_vllm_server_info_answer_says_whether_it_runs_in_sleep_mode(status, body, report):
    assert sleep_mode_report(status, json.dumps(body).encode()) == report
