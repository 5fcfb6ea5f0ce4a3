import asyncio
import re
import signal
import sys

import httpx


async def test_sim_command_serves_both_backends_until_interrupted():
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.sim", "--mtp-port", "0", "--plain-port", "0",
        "--speed", "20", "--plain-faults", '{"fail_status": 500}', "--max-queued-requests", "0",
        "--enable-response-store", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        lines = [(await asyncio.wait_for(process.stdout.readline(), 20)).decode() for _ in range(3)]
        urls = dict(re.findall(r"sim: (mtp|plain) .* on (http://\S+)", "".join(lines)))
        async with httpx.AsyncClient() as http:
            info = (await http.get(urls["mtp"] + "/server_info")).json()
            failing = await http.post(urls["plain"] + "/v1/completions", json={"prompt": "hi"})
            full = await http.post(urls["mtp"] + "/v1/completions", json={"prompt": "hi", "stream": True})
            stored = await http.get(urls["mtp"] + "/v1/responses/resp_x")
        assert info["speculative_algorithm"] == "EAGLE"
        assert failing.status_code == 500
        assert full.status_code == 200 and '"code": 503' in full.text  # no room in a 0-long queue
        assert stored.status_code == 404  # the store is on: not found, rather than "disabled"
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_sim_command_rejects_bad_options():
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.sim", "--speed", "0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 2 and b"--speed" in err
