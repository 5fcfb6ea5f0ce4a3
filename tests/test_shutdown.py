"""Graceful shutdown of the real `mtp-gateway serve` process: SIGTERM during 20 live streams.

The gateway runs as a subprocess (its own uvicorn, its own signal handling) in front of the
simulated pair running in the test's loop. On SIGTERM it must stop accepting at once, let the
streams that finish within `timeouts.shutdown_grace_s` finish, end the others with an SSE error
event then `[DONE]` (and abort them upstream), and exit 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.sim.server import SimOptions, start_sim_pair
from tests.live import wait_until
from tests.test_gateway_live import OpenStream, chat, sse_events, text_of

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 1.5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


async def until_serving(client: httpx.AsyncClient, url: str, process: asyncio.subprocess.Process,
                        timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await client.get(url + "/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.returncode is not None or time.monotonic() > deadline:
            raise AssertionError("the gateway did not come up")
        await asyncio.sleep(0.05)


@pytest.mark.timeout(40)
async def test_sigterm_during_20_streams_drains_then_exits_0(tmp_path) -> None:
    async with start_sim_pair(SimOptions(speed=50)) as pair:
        port = free_port()
        config = tmp_path / "config.yaml"
        config.write_text(json.dumps({  # JSON is YAML
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": {name: {"url": url} for name, url in pair.urls.items()},
            "timeouts": {"shutdown_grace_s": GRACE_S},
            "monitor": {"interval_s": 0.1},
            "routing": {"crossover": 100, "hysteresis": 10},  # all on mtp: one engine to watch
        }))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--config", str(config),
            "--log-level", "warning", cwd=ROOT, stderr=asyncio.subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            limits = httpx.Limits(max_connections=40)
            async with httpx.AsyncClient(timeout=20, limits=limits) as client:
                await until_serving(client, url, process)
                # Ten that finish within the grace period, ten that never would.
                bodies = [chat(max_tokens=150, stream=True) for _ in range(10)]
                bodies += [chat(max_tokens=100000, ignore_eos=True, stream=True) for _ in range(10)]
                streams = await asyncio.gather(
                    *(OpenStream(client, url + "/v1/chat/completions", body).open()
                      for body in bodies))
                engine = pair.servers["mtp"].live.engine

                process.send_signal(signal.SIGTERM)
                sent_at = time.monotonic()

                async def finish(opened: OpenStream) -> tuple[bytes, float]:
                    rest = b"".join([chunk async for chunk in opened.chunks])
                    ended = time.monotonic()
                    await opened.close()
                    return opened.first + rest, ended

                endings = asyncio.gather(*(finish(s) for s in streams))
                port_closed = False
                while not endings.done():  # refused while streams are still draining
                    if await refused(port):
                        port_closed = True
                        break
                    await asyncio.sleep(0.02)
                results = await endings
                assert port_closed, "new connections were accepted after SIGTERM"

                for i, (raw, ended) in enumerate(results):
                    events = sse_events(raw)
                    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-300:]
                    last = json.loads(events[-2])
                    if i < 10:  # short: allowed to finish, and finished after the signal
                        assert "error" not in last, last
                        assert last["choices"][0]["finish_reason"] in ("stop", "length")
                        assert len(text_of(raw).split()) > 0
                    else:  # long: cut at the end of the grace period, in-band
                        assert last["error"]["code"] == "gateway_shutting_down", last
                        assert GRACE_S * 0.9 <= ended - sent_at < GRACE_S + 2.0
                assert any(ended > sent_at + 0.05 for _, ended in results[:10]), \
                    "no short stream was still running at SIGTERM: the test proves nothing"

                code = await asyncio.wait_for(process.wait(), timeout=GRACE_S + 5.0)
                exited_after = time.monotonic() - sent_at
                stderr = (await process.stderr.read()).decode() if process.stderr else ""
                assert code == 0, f"exit code {code}\n{stderr}"
                assert exited_after < GRACE_S + 3.0
                # What the gateway gave up on was aborted upstream, not left running.
                await wait_until(lambda: engine.num_running == 0, timeout=3)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
