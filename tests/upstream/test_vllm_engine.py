"""gateway/upstream/engine/vllm.py against a simulated vLLM 0.33.0 pair (live, port 0): the
seam's names read vLLM's answers, and the sleep-mode calls a turns pair of vLLM servers needs
succeed, fail and report as the engine does (docs/compat.md, the vLLM section)."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.config import Backend
from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from gateway.sim.vllm.app import VllmOptions
from gateway.upstream.client import Upstream
from gateway.upstream.engine import sglang, vllm
from gateway.upstream.engine.probe import Probe
from tests.sim.conftest import wait_until


@contextlib.asynccontextmanager
async def vllm_pair(**kw) -> AsyncIterator[tuple[SimPair, Upstream]]:
    sleeps = VllmOptions(dev_mode=True, enable_sleep_mode=True)
    options = SimOptions(**{"speed": 50, "engine": "vllm", "vllm": sleeps, **kw})
    async with start_sim_pair(options) as pair:
        upstream = Upstream(connect_timeout_s=2)
        await upstream.start()
        try:
            yield pair, upstream
        finally:
            await upstream.close()


def test_the_seam_names_every_name_the_core_uses_of_sglangs():
    """A second engine is a module with the same names (gateway/upstream/engine/__init__.py)."""
    used = {"RID_FIELDS", "RESPONSE_ID_PREFIX", "RID_HEADER", "RID_HEADER_PATHS", "new_rid", "abort_rids",
            "abort", "LOADS", "SERVER_INFO", "MODELS", "NOT_PROVIDED", "probe_headers", "parse_loads",
            "parse_server_info", "usage_by_default", "USAGE_CHUNK", "ASK_USAGE", "CallFailed", "ABORT",
            "control", "read_memory_saver"}
    assert used <= set(dir(sglang)) and used <= set(vllm.__all__)


def test_no_rid_is_set_or_aborted_by_name():
    """No abort endpoint outside dev mode: closing the connection aborts (serve/utils/
    api_utils.py:53-100), so nothing names a request to abort; a Responses request's
    request_id is its response's id (entrypoints/openai/responses/protocol.py:357, :989)."""
    assert vllm.RID_FIELDS == {"/v1/responses": "request_id"} and vllm.RID_HEADER_PATHS == frozenset()
    assert vllm.abort_rids("r", 1, None) == () and vllm.abort_rids("r", 1, 3) == ()
    assert sglang.abort_rids("r", 1, None) == ("r",)  # what SGLang's module would abort


async def test_the_load_and_the_running_cap_are_read_from_vllms_answers():
    """v1/metrics/loggers.py:527-545 (the gauges on /metrics, text) and
    dev/server_info/api_router.py:43-60 (max_num_seqs in the JSON configuration)."""
    capped = VllmOptions(dev_mode=True, enable_sleep_mode=True, max_num_seqs=2)
    async with vllm_pair(vllm=capped) as (pair, upstream), \
            httpx.AsyncClient(timeout=10) as http:
        url = pair.urls["plain"]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "ignore_eos": True}
        running = [asyncio.create_task(http.post(url + "/v1/chat/completions", json=body)) for _ in range(3)]
        await wait_until(lambda: pair.servers["plain"].live.engine.num_waiting == 1)
        status, metrics = await upstream.request("GET", url + vllm.LOADS, [], None, 5)
        assert status == 200 and vllm.parse_loads(metrics) == (2, 1)
        _, info = await upstream.request("GET", url + vllm.SERVER_INFO, [], None, 5)
        assert vllm.parse_server_info(httpx.Response(200, content=info).json()) == (2, None)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    assert vllm.parse_loads(b"sglang:num_running_reqs 3\n") is None  # not vLLM's
    assert vllm.parse_loads({"loads": []}) is None


async def test_a_turn_by_sleep_mode_and_a_wake_that_finds_the_memory_taken():
    """dev/sleep/api_router.py:26-61 with v1/engine/core.py:1848-1851: in the turns shape
    (plain asleep, MTP holding the memory) waking plain fails, the failure says why, plain is
    still asleep and alive (/health 200 while asleep, async_llm.py:1129-1134); MTP sleeps,
    plain wakes and is ready."""
    async with vllm_pair(memory="turns") as (pair, upstream):
        mtp = vllm.SleepControl(upstream, Backend(url=pair.urls["mtp"]), "mtp")
        plain = vllm.SleepControl(upstream, Backend(url=pair.urls["plain"]), "plain")
        assert await plain.probe(5) == Probe(alive=True, ready=False, scheduler_answers=True,
                                             memory_saver=True, asleep=True)
        with pytest.raises(vllm.CallFailed, match="Call to wake_up method failed") as failed:
            await plain.wake_up(10)
        assert failed.value.kind == "error"
        assert await plain.is_sleeping(5)
        await mtp.sleep(10)
        await plain.wake_up(10)
        assert (await plain.probe(5)).ready and not (await mtp.probe(5)).ready
        assert (await mtp.probe(5)).alive


@pytest.mark.parametrize("dev_mode, sleep_mode, saver", [(True, True, True), (True, False, False),
                                                         (False, True, False), (False, False, False)])
async def test_the_probe_says_whether_a_sleep_would_free_anything(dev_mode, sleep_mode, saver):
    """In dev mode /is_sleeping answers with or without --enable-sleep-mode (v1/engine/core.py:
    1078-1080), so the probe reads sleep mode from /server_info (model_config.enable_sleep_mode):
    discovery then refuses to turn a pair whose sleep would free nothing (gateway/turns/discovery.py
    cannot_turn). Without dev mode nothing answers: it cannot sleep at all."""
    options = VllmOptions(dev_mode=dev_mode, enable_sleep_mode=sleep_mode)
    async with vllm_pair(vllm=options) as (pair, upstream):
        probe = await vllm.SleepControl(upstream, Backend(url=pair.urls["plain"]), "plain").probe(5)
        assert probe.alive and probe.ready and probe.asleep is False
        assert probe.memory_saver is saver
        report = await vllm.read_memory_saver(upstream, Backend(url=pair.urls["plain"]), 5)
        assert report == ("no_controls" if not dev_mode else "on" if sleep_mode else "off")


async def test_a_server_that_is_gone_is_not_alive():
    async with vllm_pair() as (pair, upstream):
        url = pair.urls["plain"]
    control = vllm.SleepControl(upstream, Backend(url=url), "plain")
    fresh = Upstream(connect_timeout_s=1)
    await fresh.start()
    try:
        control.upstream = fresh
        assert await control.probe(1) == Probe(alive=False)
        with pytest.raises(vllm.CallFailed) as gone:
            await control.sleep(1)
        assert gone.value.kind == "gone" and not gone.value.sent
    finally:
        await fresh.close()


async def test_the_accept_length_is_read_from_the_spec_decode_counters():
    """v1/spec_decode/metrics.py:114: 1 + accepted tokens / drafts over one short greedy
    completion; none on a server that does not draft; ~1 once a level-2 sleep lost the draft
    (vLLM issue #52479), which the turn's speculation check catches."""
    async with vllm_pair() as (pair, upstream), httpx.AsyncClient() as http:
        mtp = vllm.SleepControl(upstream, Backend(url=pair.urls["mtp"]), "mtp")
        plain = vllm.SleepControl(upstream, Backend(url=pair.urls["plain"]), "plain")
        healthy = await mtp.accept_length(10)
        assert healthy is not None and healthy > 1.5
        assert await plain.accept_length(10) is None
        await http.post(pair.urls["mtp"] + "/sleep?level=2", timeout=10)
        await http.post(pair.urls["mtp"] + "/wake_up", timeout=10)
        lost = await mtp.accept_length(10)
        assert lost is not None and lost < 1.2


async def test_busy_and_ready_come_from_metrics_and_is_sleeping():
    async with vllm_pair() as (pair, upstream):
        mtp = vllm.SleepControl(upstream, Backend(url=pair.urls["mtp"]), "mtp")
        assert await mtp.busy(5) == 0 and await mtp.ready(5)
        await mtp.sleep(10)
        assert not await mtp.ready(5)  # /health is 200 all the while
        assert (await mtp.probe(5)).alive
        await mtp.wake_up(10)
        assert await mtp.ready(5)
