#!/usr/bin/env python
"""A bounded soak of mtp-gateway: C concurrent clients, backend faults, client disconnects.

    python lab/scripts/soak.py --minutes 3

Loopback only. The simulated SGLang pair runs in this process; the gateway is a real
`python -m gateway serve` subprocess (its own event loop, its own RSS). For the whole run,
`--concurrency` workers each send one request after another: mostly streams read to the end,
some non-streaming requests, some streams the client abandons after a few chunks. Every
`--fault-every-s` seconds one backend gets a fault from the simulator's set (crash mid-stream,
SGLang error event, 5xx burst, hang before the first byte, slow steps, refused connections)
for `--fault-hold-s` seconds.

At the end it reports requests served, outcomes by kind, the gateway's in-flight count once
the load has stopped (read from /admin/state: it must be 0), what the backends still run, the
gateway's RSS after start-up, after the warm-up and at the end, and the exit code on SIGTERM.
Exit status 0 when: no stream ended without [DONE], no torn event, no client-side transport
error, in-flight drift 0, RSS growth after warm-up < 10 %, exit code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.sim import server as sim_server  # noqa: E402
from gateway.sim.faults import Faults  # noqa: E402
from gateway.sim.server import SimOptions, start_sim_pair  # noqa: E402
from gateway.sim.speed import add_speed_argument  # noqa: E402

MODEL = "Qwen/Qwen3.5-122B-A10B"
MAX_MINUTES = 10.0

FAULTS: list[tuple[str, Faults]] = [
    ("crash_after_chunks=5", Faults(crash_after_chunks=5)),
    ("error_after_chunks=5", Faults(error_after_chunks=5)),
    ("fail_status=500 x30", Faults(fail_status=500, fail_count=30)),
    ("hang_before_first_byte", Faults(hang_before_first_byte=True)),
    ("slow_factor=8", Faults(slow_factor=8.0)),
    ("refuse_connections", Faults(refuse_connections=True)),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)  # by what the client meant to do
    faults: list[str] = field(default_factory=list)
    active: int = 0  # workers allowed to send right now (the load swings, see `swing`)
    rss: list[str] = field(default_factory=list)  # the gateway's RSS every 30 s
    latest_error: dict[str, str] = field(default_factory=dict)

    def add(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if detail:
            self.latest_error[outcome] = detail[:200]


def classify_stream(raw: bytes) -> str:
    """ok | sse_error <code> | truncated | torn_event (an event that is not whole JSON)."""
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return "truncated (no [DONE])"
    if events.count(b"[DONE]") != 1:
        return "several [DONE]"
    last = None
    for event in events[:-1]:
        try:
            last = json.loads(event)
        except ValueError:
            return "torn event"
    if isinstance(last, dict) and "error" in last:
        error = last["error"]
        code = error.get("code") if isinstance(error, dict) else None
        return f"sse_error {code}"
    return "ok"


async def worker(index: int, session: aiohttp.ClientSession, url: str, stop_at: float,
                 tally: Tally, rng: random.Random) -> None:
    while time.monotonic() < stop_at:
        if index >= tally.active:
            await asyncio.sleep(0.1)
            continue
        roll = rng.random()
        kind = "stream" if roll < 0.70 else "non_stream" if roll < 0.80 else "disconnect"
        body = {"model": MODEL, "max_tokens": rng.randint(16, 200),
                "messages": [{"role": "user", "content": f"soak {rng.random()}"}],
                "stream": kind != "non_stream"}
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        tally.requests[kind] += 1
        try:
            async with session.post(url, json=body,
                                    headers={"x-session-id": f"s{rng.randint(0, 200)}"}) as response:
                if response.status != 200:
                    text = await response.text()
                    try:
                        code = json.loads(text)["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = "not OpenAI-shaped"
                    tally.add(f"http {response.status} {code}", text)
                    continue
                if kind == "non_stream":
                    data = await response.json()
                    tally.add("ok" if data.get("choices") else "bad body", json.dumps(data))
                    continue
                if kind == "disconnect":
                    wanted, seen = rng.randint(1, 5), 0
                    async for _ in response.content.iter_any():
                        seen += 1
                        if seen >= wanted:
                            break
                    response.close()  # leave mid-stream
                    tally.add("client disconnect (intended)")
                    continue
                raw = await response.read()
                outcome = classify_stream(raw)
                tally.add(outcome, raw[-300:].decode("utf-8", "replace") if outcome != "ok" else "")
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            tally.add(f"client transport error {type(exc).__name__}", repr(exc))


async def swing(tally: Tally, concurrency: int, stop_at: float) -> None:
    """C for 25 s, C/4 for 15 s, again: the crossover router moves between plain and MTP, so
    faults on either backend meet traffic (at a steady C=64 the MTP server would sit idle)."""
    while time.monotonic() < stop_at:
        tally.active = concurrency
        await asyncio.sleep(25)
        tally.active = max(1, concurrency // 4)
        await asyncio.sleep(15)


async def fault_toggler(pair: sim_server.SimPair, stop_at: float, every_s: float, hold_s: float,
                        tally: Tally, rng: random.Random, started: float, state) -> None:  # type: ignore[no-untyped-def]
    while True:
        await asyncio.sleep(max(0.0, every_s - hold_s))
        if time.monotonic() + hold_s > stop_at:
            return
        name, faults = rng.choice(FAULTS)
        # Mostly the backend carrying the traffic now (the router may have left the other idle).
        inflight = {n: b["inflight"] for n, b in (await state())["backends"].items()}
        busiest = max(inflight, key=inflight.__getitem__)
        backend = busiest if rng.random() < 0.75 else rng.choice(["mtp", "plain"])
        tally.faults.append(f"t={time.monotonic() - started:6.1f}s  {backend:5s} {name}")
        await pair.servers[backend].set_faults(faults)
        try:
            await asyncio.sleep(hold_s)
        finally:
            await pair.servers[backend].clear_faults()


async def wait_for(predicate, timeout: float, every: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(every)
    return False


async def soak(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tally = Tally()
    admin = secrets.token_hex(16)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # The simulator logs every injected crash as a traceback: keep its uvicorn quiet.
    options = SimOptions(speed=args.speed, seed=args.seed, log_level="critical")
    async with start_sim_pair(options) as pair:
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": {name: {"url": url} for name, url in pair.urls.items()},
            "timeouts": {"first_byte_s": 4.0, "idle_s": 3.0, "total_s": 120.0,
                         "keepalive_s": 1.0, "shutdown_grace_s": 5.0},
            "monitor": {"interval_s": 0.25, "fall": 2, "rise": 2, "circuit_failures": 5,
                        "circuit_open_s": 3.0},
            "auth": {"admin_key": admin},
        }
        workdir = Path(tempfile.mkdtemp(prefix="mtp-soak-"))
        (workdir / "config.yaml").write_text(json.dumps(config))
        log_path = workdir / "gateway.log"
        with open(log_path, "wb") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "serve", "--config", str(workdir / "config.yaml"),
                "--log-level", "warning", cwd=ROOT, stdout=log, stderr=log)
        headers = {"authorization": f"Bearer {admin}"}
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=30)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

                async def up() -> bool:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(base + "/health") as response:
                            return response.status == 200
                    return False

                if not await wait_for(up, 20):
                    print(log_path.read_text(), file=sys.stderr)
                    raise SystemExit("the gateway did not come up")
                rss_start = rss_mib(process.pid)

                async def state() -> dict:  # type: ignore[type-arg]
                    async with session.get(base + "/admin/state", headers=headers) as response:
                        return await response.json()

                started = time.monotonic()
                stop_at = started + args.minutes * 60
                warmup_s = min(30.0, args.minutes * 60 * 0.15)
                workers = [asyncio.create_task(worker(i, session, base + "/v1/chat/completions",
                                                      stop_at, tally, random.Random(rng.random())))
                           for i in range(args.concurrency)]
                swinger = asyncio.create_task(swing(tally, args.concurrency, stop_at))
                toggler = asyncio.create_task(fault_toggler(pair, stop_at, args.fault_every_s,
                                                            args.fault_hold_s, tally, rng, started,
                                                            state))
                await asyncio.sleep(warmup_s)
                rss_warm = rss_mib(process.pid)
                rss_peak = rss_warm
                last_print = time.monotonic()
                while time.monotonic() < stop_at:
                    await asyncio.sleep(1.0)
                    rss_peak = max(rss_peak, rss_mib(process.pid))
                    if time.monotonic() - last_print >= 30:
                        last_print = time.monotonic()
                        done = sum(tally.outcomes.values())
                        tally.rss.append(f"{last_print - started:.0f}s {rss_mib(process.pid):.1f}")
                        print(f"  t={last_print - started:5.0f}s  {done} requests finished, "
                              f"RSS {rss_mib(process.pid):.1f} MiB", file=sys.stderr, flush=True)
                await asyncio.gather(*workers)
                for task in (toggler, swinger):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                for server in pair.servers.values():
                    await server.clear_faults()
                elapsed = time.monotonic() - started

                async def settled() -> bool:
                    return (await state())["concurrency"] == 0

                await wait_for(settled, 15)
                final = await state()

                async def engines_idle() -> bool:
                    return all(s.live.engine.num_running == 0 and s.live.engine.num_waiting == 0
                               for s in pair.servers.values())

                await wait_for(engines_idle, 15)
                engines = {name: (s.live.engine.num_running, s.live.engine.num_waiting)
                           for name, s in pair.servers.items()}
                rss_end = rss_mib(process.pid)
                async with session.get(base + "/metrics", headers=headers) as response:
                    metrics = await response.text()
            process.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(process.wait(), 20)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    log_text = log_path.read_text(errors="replace")
    return report(args, tally, elapsed, final, engines, rss_start, rss_warm, rss_peak, rss_end,
                  warmup_s, code, log_text, metrics)


def report(args: argparse.Namespace, tally: Tally, elapsed: float, final: dict, engines: dict,  # type: ignore[type-arg]
           rss_start: float, rss_warm: float, rss_peak: float, rss_end: float, warmup_s: float,
           code: int, log_text: str, metrics: str) -> int:
    served = sum(tally.outcomes.values())
    inflight = {name: b["inflight"] for name, b in final["backends"].items()}
    drift = final["concurrency"]
    growth = (rss_end / rss_warm - 1) * 100
    bad = {k: v for k, v in tally.outcomes.items()
           if k.startswith(("truncated", "torn", "several", "client transport", "bad body"))
           or "not OpenAI-shaped" in k}
    lines = [
        f"mtp-gateway soak: {elapsed / 60:.1f} min, C={args.concurrency} (25 s) / "
        f"{max(1, args.concurrency // 4)} (15 s) alternating, loopback, "
        f"simulated pair at speed {args.speed:g}x, seed {args.seed}",
        f"faults: one backend every {args.fault_every_s:g} s for {args.fault_hold_s:g} s "
        f"({len(tally.faults)} injected)",
        "",
        f"requests finished: {served} ({served / elapsed:.1f}/s)",
        "  sent as: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.requests.items())),
        "outcomes:",
        *[f"  {count:7d}  {outcome}" for outcome, count in tally.outcomes.most_common()],
        "",
        "faults injected:",
        *[f"  {line}" for line in tally.faults],
        "",
        f"in-flight after the load stopped (/admin/state): concurrency {drift}, "
        f"per backend {inflight} -> drift {drift}",
        f"backend engines after the load stopped (running, waiting): {engines}",
        f"gateway RSS: {rss_start:.1f} MiB after start-up, {rss_warm:.1f} MiB after "
        f"{warmup_s:.0f} s warm-up, peak {rss_peak:.1f} MiB, {rss_end:.1f} MiB at the end "
        f"-> growth {growth:+.1f} % since warm-up ({(rss_end / rss_start - 1) * 100:+.1f} % "
        f"since start-up)",
        "gateway RSS every 30 s (MiB): " + ", ".join(tally.rss),
        "gateway counters (/metrics):",
        *[f"  {line}" for line in metrics.splitlines()
          if line.startswith(("gateway_retries_total", "gateway_upstream_errors_total",
                              "gateway_client_disconnects_total", "gateway_rejected_total",
                              "gateway_responses_total"))],
        f"gateway log: {log_text.count('Traceback')} tracebacks, "
        f"{log_text.count('ERROR')} ERROR lines, {log_text.count('WARNING')} WARNING lines",
        f"gateway exit code on SIGTERM: {code}",
    ]
    checks = {
        "every stream ended with [DONE], no torn event, no client transport error": not bad,
        "in-flight drift 0": drift == 0 and all(v == 0 for v in inflight.values()),
        "RSS growth after warm-up < 10 %": growth < 10,
        "no traceback in the gateway log": "Traceback" not in log_text,
        "exit code 0 on SIGTERM": code == 0,
    }
    lines += ["", "checks:"] + [f"  [{'x' if ok else ' '}] {name}" for name, ok in checks.items()]
    if bad:
        lines += ["", "last detail per bad outcome:"]
        lines += [f"  {k}: {tally.latest_error.get(k, '')}" for k in bad]
    print("\n".join(lines))
    return 0 if all(checks.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="load duration (max 10)")
    parser.add_argument("--concurrency", type=int, default=64)
    add_speed_argument(parser, default=4.0)
    parser.add_argument("--fault-every-s", type=float, default=15.0)
    parser.add_argument("--fault-hold-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not 0 < args.minutes <= MAX_MINUTES:
        parser.error(f"--minutes must be in (0, {MAX_MINUTES:g}]")
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
