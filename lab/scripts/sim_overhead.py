"""The gateway's added time to first token and CPU per 1,000 relayed chunks, in front of the
simulated SGLang pair (real time, speed 1), at C=1 (MTP) and C=64 (plain).

    python lab/scripts/sim_overhead.py [--seconds 20] [--max-tokens 200]

Starts `mtp-gateway sim` and `mtp-gateway serve` as subprocesses (gateway pinned to CPU 1,
simulator and this load generator to CPU 0 when there are two cores), then runs the same
closed-loop streaming load direct to a simulated server and through the gateway (pinned to
that server with `x-gateway-pin`), one direct run then one gateway run per level (not
interleaved: machine drift lands on the gateway figure). Gateway CPU is utime+stime from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

MODEL = "Qwen/Qwen3.5-122B-A10B"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} never became ready")


async def one_stream(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                     max_tokens: int) -> tuple[float, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    ttft, chunks = None, 0
    async with session.post(url, json=body, headers=headers) as response:
        async for line in response.content:
            # A content chunk with text (the role chunk carries "content":"" and no token).
            if line.startswith(b"data: {") and b'"content":"' in line \
                    and b'"content":""' not in line:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - started
    assert ttft is not None, "no content"
    return ttft, chunks


async def closed_loop(url: str, headers: dict[str, str], concurrency: int, seconds: float,
                      max_tokens: int, watch_pid: int | None, think_s: float = 0.1) -> dict[str, float]:
    ttfts: list[float] = []
    total_chunks = 0
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector) as session:
        cpu_before = cpu_s(watch_pid) if watch_pid else 0.0

        async def worker() -> None:
            nonlocal total_chunks
            while time.perf_counter() < deadline:
                ttft, chunks = await one_stream(session, url, headers, max_tokens)
                ttfts.append(ttft)
                total_chunks += chunks
                # Start each request from an idle simulated GPU at C=1: back to back, the
                # simulator's real-time driver pays back the previous step's oversleep.
                await asyncio.sleep(think_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu_used = (cpu_s(watch_pid) - cpu_before) if watch_pid else 0.0
    return {"ttft_p50_ms": statistics.median(ttfts) * 1000, "requests": len(ttfts),
            "chunks": total_chunks,
            "cpu_ms_per_1k_chunks": cpu_used * 1000 / total_chunks * 1000 if watch_pid else 0.0}


def pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if (os.cpu_count() or 1) >= 2 else []


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    mtp_port, plain_port, gateway_port = free_port(), free_port(), free_port()
    sim = subprocess.Popen([*pin(0), sys.executable, "-m", "gateway", "sim", "--mtp-port",
                            str(mtp_port), "--plain-port", str(plain_port), "--speed", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    config.write(f"backends:\n  mtp:\n    url: http://127.0.0.1:{mtp_port}\n"
                 f"  plain:\n    url: http://127.0.0.1:{plain_port}\n"
                 "routing:\n  allow_pin_header: true\n")
    config.close()
    gateway = subprocess.Popen([*pin(1), sys.executable, "-m", "gateway", "serve", "--config",
                                config.name, "--port", str(gateway_port), "--log-level", "warning"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_ready(f"http://127.0.0.1:{mtp_port}/v1/models")
        await wait_ready(f"http://127.0.0.1:{gateway_port}/v1/models")
        rows = []
        for concurrency, backend, port in ((1, "mtp", mtp_port), (64, "plain", plain_port)):
            direct_url = f"http://127.0.0.1:{port}/v1/chat/completions"
            gateway_url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
            pinned = {"x-gateway-pin": backend}
            # Warm both paths (prefix cache, connection pools) before measuring.
            await closed_loop(direct_url, {}, concurrency, 1.0, args.max_tokens, None)
            await closed_loop(gateway_url, pinned, concurrency, 1.0, args.max_tokens, None)
            direct = await closed_loop(direct_url, {}, concurrency, args.seconds,
                                       args.max_tokens, None)
            through = await closed_loop(gateway_url, pinned, concurrency, args.seconds,
                                        args.max_tokens, gateway.pid)
            rows.append({"concurrency": concurrency, "backend": backend, "direct": direct,
                         "gateway": through,
                         "added_ttft_p50_ms": through["ttft_p50_ms"] - direct["ttft_p50_ms"]})
        print(json.dumps(rows, indent=2))
        print("\n| C | backend | direct TTFT p50 ms | gateway TTFT p50 ms | added | "
              "gateway CPU-ms / 1k chunks | chunks relayed |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['concurrency']} | {row['backend']} | {row['direct']['ttft_p50_ms']:.2f} | "
                  f"{row['gateway']['ttft_p50_ms']:.2f} | {row['added_ttft_p50_ms']:+.2f} | "
                  f"{row['gateway']['cpu_ms_per_1k_chunks']:.1f} | {row['gateway']['chunks']} |")
        return 0
    finally:
        gateway.terminate()
        sim.terminate()
        gateway.wait(10)
        sim.wait(10)
        os.unlink(config.name)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
