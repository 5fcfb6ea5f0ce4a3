#!/usr/bin/env python
"""A bounded soak of mtp-gateway: C concurrent clients, backend faults, client disconnects.

    python lab/scripts/soak.py --minutes 3                    # the split pair
    python lab/scripts/soak.py --memory turns --minutes 10    # the pair taking turns

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

`--memory turns` runs the pair in SGLang's turns shape (the simulated servers with the memory
saver, as `mtp-gateway demo --memory turns` starts them; the gateway with `memory: turns`). The
load crosses the crossover twice a minute, so the memory is handed over each way about once a
minute; besides the faults above, every other turn meets a turn fault on its incoming server
(`TURN_FAULTS`). It checks too that every turn completed or failed safely: never both servers
holding their weights or KV cache at once (the simulated device's ledger, watched at every
change), no server killed or hung by the memory saver, every turn begun ending in an outcome on
/metrics, the pair holding at the end, and the journal saying so.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.sim import server as sim_server  # noqa: E402
from gateway.sim.faults import Faults  # noqa: E402
from gateway.sim.saver import KV_CACHE, WEIGHTS  # noqa: E402
from gateway.sim.server import SimOptions, SimPair, start_sim_pair  # noqa: E402
from gateway.sim.speed import add_speed_argument  # noqa: E402

MODEL = "Qwen/Qwen3.5-122B-A10B"
State = Callable[[], Awaitable[dict[str, Any]]]  # the gateway's /admin/state
MAX_MINUTES = 10.0

FAULTS: list[tuple[str, Faults]] = [
    ("crash_after_chunks=5", Faults(crash_after_chunks=5)),
    ("error_after_chunks=5", Faults(error_after_chunks=5)),
    ("fail_status=500 x30", Faults(fail_status=500, fail_count=30)),
    ("hang_before_first_byte", Faults(hang_before_first_byte=True)),
    ("slow_factor=8", Faults(slow_factor=8.0)),
    ("refuse_connections", Faults(refuse_connections=True)),
]
REFUSE = "refuse_connections"

# The turns pair: a fixed crossover (not learned), so that the load's swing crosses it: MTP at
# C <= crossover - hysteresis, plain at C >= crossover.
TURNS_ROUTING = {"crossover": 24, "hysteresis": 6, "adaptive_crossover": False,
                 "adapt_to_accept_length": False}
# Faults on the incoming server, set as a turn begins and held for --fault-hold-s. The first
# takes the incoming server down before its resume (its resume is refused: the outgoing one
# resumes back; restarted, paused, it may take the memory again); the others meet the streams
# moved and continued onto it at the turn.
TURN_FAULTS: list[tuple[str, Faults]] = [
    ("incoming down before its resume", Faults(refuse_connections=True)),
    ("incoming crash_after_chunks=3", Faults(crash_after_chunks=3)),
    ("incoming error_after_chunks=3", Faults(error_after_chunks=3)),
    ("incoming hang_before_first_byte", Faults(hang_before_first_byte=True)),
]
# Steps of a turn before the source's release: the incoming server holds nothing and no resume
# can have been sent to it yet.
BEFORE_RELEASE = ("stop_admitting", "move_unstarted", "running_streams", "keep_caches", "pause")


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
    # One fault at a time: the one in force, if any (the task that clears it), and whose.
    fault: asyncio.Task[None] | None = None
    turn_fault: bool = False
    turn_faults: list[str] = field(default_factory=list)
    # The turns pair as /admin/state showed it every 0.1 s: seconds without a server admitting
    # (a turn or a settling), the longest such stretch, and the phases seen.
    not_admitting_s: float = 0.0
    longest_not_admitting_s: float = 0.0
    phases: Counter[str] = field(default_factory=Counter)

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
                 tally: Tally, rng: random.Random, own_session: bool) -> None:
    """`own_session`: the worker is one agent session (x-session-id w<index>), so that the
    sessions at work follow the load's swing; else each request names one of 200 at random."""
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
            session_id = f"w{index}" if own_session else f"s{rng.randint(0, 200)}"
            async with session.post(url, json=body, headers={"x-session-id": session_id}) as response:
                if response.status != 200:
                    text = await response.text()
                    try:
                        code = json.loads(text)["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = "not OpenAI-shaped"
                    tally.add(f"http {response.status} {code}", text)
                    if response.status in (429, 503):  # as the SDKs do: wait, then again
                        await asyncio.sleep(float(response.headers.get("retry-after", 1)))
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


@dataclass(frozen=True)
class Swing:
    """The load's swing: C for `high_s`, C / `low_divisor` for `low_s`, again."""

    high_s: float
    low_s: float
    low_divisor: int

    def low(self, concurrency: int) -> int:
        return max(1, concurrency // self.low_divisor)


# split: the crossover router moves between plain and MTP, so faults on either backend meet
# traffic (at a steady C=64 the MTP server would sit idle). turns: 64 and 8 on either side of
# TURNS_ROUTING's crossover and band, 30 s each: a turn each way about every minute.
SWINGS = {"split": Swing(25.0, 15.0, 4), "turns": Swing(30.0, 30.0, 8)}


async def swing(tally: Tally, concurrency: int, stop_at: float, shape: Swing) -> None:
    while time.monotonic() < stop_at:
        tally.active = concurrency
        await asyncio.sleep(shape.high_s)
        tally.active = shape.low(concurrency)
        await asyncio.sleep(shape.low_s)


def holds_nothing(pair: SimPair, name: str) -> bool:
    """Turns: `name` is released and no resume of it can be on its way (the other server has
    begun no release). Taking it down then is what a crash of a paused server is; taking down
    a server that holds memory is not modelled (the simulator's refusal keeps its memory on
    the device's ledger, where a real crash gives it back)."""
    other = next(s for n, s in pair.servers.items() if n != name)
    return bool(pair.servers[name].saver.state.released) and not other.saver.state.released


class Overlap:
    """Watches the shared device's ledger at every change: the most servers holding their
    weights or KV cache at once (a turn must never let that be 2)."""

    def __init__(self, pair: SimPair) -> None:
        self.device = pair.servers["mtp"].saver.device
        self.most = 0
        hold = self.device.hold

        def watched(owner: str, part: str, gib: float) -> None:
            hold(owner, part, gib)
            holders = {o for o, parts in self.device.held_gib.items()
                       if parts.get(WEIGHTS, 0) > 0 or parts.get(KV_CACHE, 0) > 0}
            self.most = max(self.most, len(holders))

        self.device.hold = watched  # type: ignore[method-assign]


async def fault_toggler(pair: SimPair, stop_at: float, every_s: float, hold_s: float,
                        tally: Tally, rng: random.Random, started: float, state: State,
                        turns: bool) -> None:
    while True:
        await asyncio.sleep(max(0.0, every_s - hold_s))
        if time.monotonic() + hold_s > stop_at:
            return
        name, faults = rng.choice(FAULTS)
        # Mostly the backend carrying the traffic now (the router may have left the other idle).
        inflight = {n: b["inflight"] for n, b in (await state())["backends"].items()}
        busiest = max(inflight, key=inflight.__getitem__)
        backend = busiest if rng.random() < 0.75 else rng.choice(["mtp", "plain"])
        if turns and name == REFUSE:  # only a server that holds nothing goes down
            idle = [n for n in pair.servers if holds_nothing(pair, n)]
            if not idle:  # a turn is under way: another fault
                name, faults = rng.choice([f for f in FAULTS if f[0] != REFUSE])
            else:
                backend = idle[0]
        if tally.fault is not None:  # a turn's fault holds: skip this one
            continue
        held = await hold_fault(pair.servers[backend], faults, hold_s, tally, tally.faults,
                                f"t={time.monotonic() - started:6.1f}s  {backend:5s} {name}")
        await asyncio.wait({held})  # or less: a turn's fault ends it early


async def hold_fault(server: sim_server.SimServer, faults: Faults, hold_s: float, tally: Tally,
                     log: list[str], line: str) -> asyncio.Task[None]:
    """Set `faults` now (a refusal takes effect before the first suspension, so a check made
    just before still holds) and clear them after `hold_s` (the task returned, `tally.fault`;
    cancelling it clears them at once)."""
    log.append(line)
    await server.set_faults(faults)

    async def clear_later() -> None:
        try:
            await asyncio.sleep(hold_s)
        finally:
            await server.clear_faults()
            tally.fault = None

    tally.fault = asyncio.create_task(clear_later())
    return tally.fault


async def turn_watch(pair: SimPair, stop_at: float, hold_s: float, every: int, tally: Tally,
                     started: float, state: State) -> None:
    """Every 0.1 s: the pair's phase (how long it admits nowhere); at every `every`-th turn
    begun, the next of TURN_FAULTS on its incoming server."""
    turns_seen, faults_set, handing, last = 0, 0, False, time.monotonic()
    holding: list[asyncio.Task[None]] = []
    try:
        while time.monotonic() < stop_at:
            await asyncio.sleep(0.1)
            memory = (await state())["pairs"][0]["memory"]
            now = time.monotonic()
            tally.phases[memory["phase"]] += 1
            if memory["admitting"] is None:
                tally.not_admitting_s += now - last
                tally.longest_not_admitting_s = max(tally.longest_not_admitting_s,
                                                    memory["for_s"])
            last = now
            began = memory["phase"] == "handing" and not handing
            handing = memory["phase"] == "handing"
            if not began:
                continue
            turns_seen += 1
            if turns_seen % every or tally.turn_fault or now + hold_s > stop_at:
                continue
            if tally.fault is not None:  # a turn's fault comes first: a backend's ends early
                tally.fault.cancel()
                await asyncio.wait({tally.fault})
            name, faults = TURN_FAULTS[faults_set % len(TURN_FAULTS)]
            target = memory["target"]
            step = (memory["step"] or "").split("(")[0]
            line = f"t={now - started:6.1f}s  {target:5s} {name} (turn {turns_seen}, at {step})"
            if faults.refuse_connections and not (step in BEFORE_RELEASE
                                                  and holds_nothing(pair, target)):
                tally.turn_faults.append(line + ": skipped, the turn was past its release")
                continue
            faults_set += 1
            held = await hold_fault(pair.servers[target], faults, hold_s, tally,
                                    tally.turn_faults, line)
            tally.turn_fault = True
            held.add_done_callback(lambda _: setattr(tally, "turn_fault", False))
            holding.append(held)
    finally:
        await asyncio.gather(*holding, return_exceptions=True)


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
    turns = args.memory == "turns"
    options = SimOptions(speed=args.speed, seed=args.seed, log_level="critical", memory=args.memory)
    async with start_sim_pair(options) as pair:
        overlap = Overlap(pair) if turns else None
        workdir = Path(tempfile.mkdtemp(prefix="mtp-soak-"))
        journal_path = workdir / "turns.json"
        config: dict[str, object] = {
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": {name: {"url": url} for name, url in pair.urls.items()},
            "timeouts": {"first_byte_s": 8.0 if turns else 4.0, "idle_s": 8.0 if turns else 3.0,
                         "total_s": 120.0, "keepalive_s": 1.0, "shutdown_grace_s": 5.0},
            "monitor": {"interval_s": 0.25, "fall": 2, "rise": 2, "circuit_failures": 5,
                        "circuit_open_s": 3.0},
            "auth": {"admin_key": admin},
        }
        if turns:
            # NVML off: the simulated device is the one that counts, not this machine's GPUs.
            config |= {"memory": "turns", "routing": TURNS_ROUTING,
                       "turns": {"check_memory": False, "state_file": str(journal_path)}}
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
                                                      stop_at, tally, random.Random(rng.random()),
                                                      turns))
                           for i in range(args.concurrency)]
                swinger = asyncio.create_task(swing(tally, args.concurrency, stop_at,
                                                    SWINGS[args.memory]))
                toggler = asyncio.create_task(fault_toggler(pair, stop_at, args.fault_every_s,
                                                            args.fault_hold_s, tally, rng, started,
                                                            state, turns))
                watcher = asyncio.create_task(
                    turn_watch(pair, stop_at, args.fault_hold_s, args.turn_fault_every, tally,
                               started, state) if turns else asyncio.sleep(0))
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
                await watcher
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

                async def holding() -> bool:
                    return not turns or (await state())["pairs"][0]["memory"]["phase"] == "holding"

                await wait_for(holding, 30)
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
        sim = {name: server.saver.state.view() for name, server in pair.servers.items()}
    log_text = log_path.read_text(errors="replace")
    turns_checks: dict[str, bool] = {}
    turns_lines: list[str] = []
    if turns:
        assert overlap is not None
        journal = json.loads(journal_path.read_text())["pairs"]["default"]
        turns_lines, turns_checks = turns_report(tally, final["pairs"][0]["memory"], journal,
                                                 overlap.most, sim, log_text, metrics,
                                                 args.turn_fault_every)
    return report(args, tally, elapsed, final, engines, rss_start, rss_warm, rss_peak, rss_end,
                  warmup_s, code, log_text, metrics, turns_lines, turns_checks)


def metric(metrics: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def turns_report(tally: Tally, memory: dict, journal: dict, most: int, sim: dict,  # type: ignore[type-arg]
                 log_text: str, metrics: str, every: int) -> tuple[list[str], dict[str, bool]]:
    """What became of every turn: the gateway's log says each one begun ("handing the memory"),
    /metrics how each ended, the simulated device and servers whether any was unsafe."""
    begun = log_text.count("handing the memory")
    handed = {role: log_text.count(f"memory handed to {role}") for role in ("mtp", "plain")}
    outcomes = {o: metric(metrics, "gateway_memory_turns_total", outcome=o)
                for o in ("done", "done_speculation_lost", "failed", "settled", "stuck", "holder_lost")}
    ended = outcomes["done"] + outcomes["done_speculation_lost"] + outcomes["failed"]
    failures = [line for line in metrics.splitlines()
                if line.startswith("gateway_memory_turn_failures_total{")]
    held = [role for role, m in journal["memory"].items() if m == "held"]
    lines = [
        f"turns begun: {begun} (gateway log); handed to plain {handed['plain']}, to mtp "
        f"{handed['mtp']}",
        "turns and settlings by outcome (/metrics): "
        + ", ".join(f"{o} {v:g}" for o, v in outcomes.items()),
        "turn step failures (/metrics):", *[f"  {line}" for line in failures],
        f"no server admitting (a turn or a settling): {tally.not_admitting_s:.1f} s in all, the "
        f"longest {tally.longest_not_admitting_s:.1f} s; phases seen every 0.1 s: "
        + ", ".join(f"{p} {n}" for p, n in tally.phases.most_common()),
        f"at the end (/admin/state): phase {memory['phase']}, holder {memory['holder']}, memory "
        f"{memory['memory']}; journal: phase {journal['phase']}, memory {journal['memory']}",
        f"most servers holding weights or KV cache at once (the device's ledger): {most}",
        "simulated servers: " + ", ".join(f"{n} {v['status']}" for n, v in sim.items()),
        "",
        f"turn faults (on the incoming server as a turn began, every {every} turns):",
        *[f"  {line}" for line in tally.turn_faults],
    ]
    checks = {
        "never both servers holding weights or KV cache (device ledger, every change)": most == 1,
        "no server killed or hung by the memory saver": all(v["status"] == "serving"
                                                             for v in sim.values()),
        f"every turn begun ended in an outcome ({begun} begun, {ended:g} ended)":
            begun > 0 and ended == begun,
        "the pair holding at the end, the journal agreeing":
            memory["phase"] == "holding" and journal["phase"] == "holding"
            and held == [memory["holder"]],
        "the memory handed over each way": handed["mtp"] > 0 and handed["plain"] > 0,
    }
    return lines, checks


def report(args: argparse.Namespace, tally: Tally, elapsed: float, final: dict, engines: dict,  # type: ignore[type-arg]
           rss_start: float, rss_warm: float, rss_peak: float, rss_end: float, warmup_s: float,
           code: int, log_text: str, metrics: str, turns_lines: list[str],
           turns_checks: dict[str, bool]) -> int:
    served = sum(tally.outcomes.values())
    inflight = {name: b["inflight"] for name, b in final["backends"].items()}
    drift = final["concurrency"]
    growth = (rss_end / rss_warm - 1) * 100
    bad = {k: v for k, v in tally.outcomes.items()
           if k.startswith(("truncated", "torn", "several", "client transport", "bad body"))
           or "not OpenAI-shaped" in k}
    shape = SWINGS[args.memory]
    lines = [
        f"mtp-gateway soak: {elapsed / 60:.1f} min, {args.memory} pair, C={args.concurrency} "
        f"({shape.high_s:g} s) / {shape.low(args.concurrency)} ({shape.low_s:g} s) alternating, "
        f"loopback, simulated pair at speed {args.speed:g}x, seed {args.seed}",
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
                              "gateway_responses_total", "gateway_moved_requests_total",
                              "gateway_continued_requests_total", "gateway_memory_turn_waiting",
                              "python_gc_collections_total", "python_gc_objects_collected_total"))],
        f"gateway log: {log_text.count('Traceback')} tracebacks, "
        f"{log_text.count('ERROR')} ERROR lines, {log_text.count('WARNING')} WARNING lines",
        f"gateway exit code on SIGTERM: {code}",
    ]
    if turns_lines:
        lines += ["", "the turns pair:", *turns_lines]
    checks = {
        "every stream ended with [DONE], no torn event, no client transport error": not bad,
        "in-flight drift 0": drift == 0 and all(v == 0 for v in inflight.values()),
        "RSS growth after warm-up < 10 %": growth < 10,
        "no traceback in the gateway log": "Traceback" not in log_text,
        "exit code 0 on SIGTERM": code == 0,
        **turns_checks,
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
    parser.add_argument("--memory", choices=("split", "turns"), default="split",
                        help="the pair's shape: split (both resident) or turns (one holds the "
                        "memory at a time, handed over by the gateway)")
    parser.add_argument("--turn-fault-every", type=int, default=2,
                        help="turns: a turn fault on the incoming server every N turns begun")
    args = parser.parse_args()
    if not 0 < args.minutes <= MAX_MINUTES:
        parser.error(f"--minutes must be in (0, {MAX_MINUTES:g}]")
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
