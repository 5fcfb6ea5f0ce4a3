"""`mtp-gateway demo` runs the simulated pair with the memory saver and the gateway on
`memory: auto`, which takes turns; it says on the terminal what it waits for, then `ready` once
a request is served. `--memory split` runs the split pair. `mtp-gateway sim --memory` takes the
same two shapes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway import cli
from gateway.config import build_settings
from tests.live import wait_until


async def _demo_until_ready(memory: str | None, engine: str = "sglang"
                            ) -> tuple[list[str], str, asyncio.Task[None]]:
    """The demo in this loop, every port the system's: its terminal lines up to `ready`."""
    lines: list[str] = []
    settings = build_settings({"listen": {"port": 0}, "auth": {"admin_key": "admin"},
                               "backends": {"mtp": {"url": "http://127.0.0.1:0"},
                                            "plain": {"url": "http://127.0.0.1:0"}}})
    task = asyncio.create_task(cli.demo(settings, None, "warning", speed=200, memory=memory,
                                        engine=engine, say=lines.append))
    await wait_until(lambda: task.done() or any(line.startswith("ready: ") for line in lines),
                     timeout=20)
    if task.done():
        task.result()
    url = lines[-1].removeprefix("ready: ").split()[0].removesuffix("/v1")
    return lines, url, task


@pytest.mark.timeout(40)
async def test_demo_by_default_starts_a_turns_pair_says_what_it_waits_for_and_is_ready_when_it_says():
    lines, url, task = await _demo_until_ready(None)
    try:
        # What the silent seconds were: the parked server's first release, said before it began.
        assert "parked" in lines[0] and "release" in lines[0]
        assert lines[1].startswith("simulated SGLang pair (turns memory")
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            # `ready` means a request is served at once, by the server holding the memory.
            answer = await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            state = (await client.get("/admin/state",
                                      headers={"authorization": "Bearer admin"})).json()
        assert answer.status_code == 200 and answer.headers["x-gateway-backend"] == "mtp"
        pair = state["pairs"][0]
        assert pair["memory_shape"]["setting"] == "auto"
        assert pair["memory_shape"]["shape"] == "turns"
        assert pair["memory"]["holder"] == "mtp"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.timeout(40)
async def test_demo_with_split_memory_runs_split_and_waits_for_no_park():
    lines, url, task = await _demo_until_ready("split")
    try:
        assert not any("parked" in line for line in lines)
        assert lines[0].startswith("simulated SGLang pair (split memory")
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            state = (await client.get("/admin/state",
                                      headers={"authorization": "Bearer admin"})).json()
        assert state["pairs"][0]["memory_shape"] == {
            "setting": "split", "shape": "split", "reason": "memory: split in the configuration"}
        assert state["pairs"][0]["memory"] == {"phase": "split"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.timeout(40)
async def test_demo_of_the_vllm_pair_by_default_takes_turns_in_sleep_mode():
    """auto on a vLLM pair reads sleep mode from dev mode's /server_info: the demo's servers run
    with both, so it takes turns (`--memory split` splits, below)."""
    lines, url, task = await _demo_until_ready(None, engine="vllm")
    try:
        assert "sleeps" in lines[0] and lines[1].startswith("simulated vLLM pair (turns memory")
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            state = (await client.get("/admin/state",
                                      headers={"authorization": "Bearer admin"})).json()
        assert state["pairs"][0]["memory_shape"] == {
            "setting": "auto", "shape": "turns",
            "reason": "auto: both servers run with --enable-sleep-mode in dev mode"}
        assert state["pairs"][0]["memory"]["holder"] == "mtp"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.timeout(40)
async def test_demo_of_the_vllm_pair_with_split_memory_splits_it():
    lines, url, task = await _demo_until_ready("split", engine="vllm")
    try:
        assert lines[0].startswith("simulated vLLM pair (split memory")
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            state = (await client.get("/admin/state",
                                      headers={"authorization": "Bearer admin"})).json()
        assert state["pairs"][0]["memory_shape"]["shape"] == "split"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.timeout(40)
async def test_demo_of_the_vllm_pair_with_turns_memory_takes_turns_in_sleep_mode():
    """`demo --engine vllm --memory turns`: the simulated vLLM servers in dev mode, MTP awake and
    plain asleep, the gateway on the vLLM engine module, serving on MTP."""
    lines, url, task = await _demo_until_ready("turns", engine="vllm")
    try:
        assert "sleeps" in lines[0] and lines[1].startswith("simulated vLLM pair (turns memory")
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            answer = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            state = (await client.get("/admin/state",
                                      headers={"authorization": "Bearer admin"})).json()
        assert answer.status_code == 200 and answer.headers["x-gateway-backend"] == "mtp"
        memory = state["pairs"][0]["memory"]
        assert memory["holder"] == "mtp" and memory["memory"] == {"mtp": "held", "plain": "released"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("command", ["demo", "sim"])
def test_an_unknown_memory_shape_is_refused(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--memory", "shared"])
    assert exit_.value.code == 2
    assert "invalid choice: 'shared' (choose from 'split', 'turns')" in capsys.readouterr().err
