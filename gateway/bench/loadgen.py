"""The closed-loop load generator over HTTP (aiohttp: it keeps up with 128 streams on one core).

Every request is sent with ``stream: true`` and ``stream_options.include_usage`` and read
incrementally with :class:`gateway.bench.sse.SSEParser`. Output tokens come from the final
usage chunk (``completion_tokens``); without one, each content chunk counts as one token. The
backend that served a request comes from the ``x-gateway-backend`` response header, or is the
target's own name when the target is a backend.

``speed`` is for simulated servers run faster than real time (``SimOptions.speed``,
``mtp-gateway sim --speed``): every time is measured in simulated seconds (real seconds x
speed) and think times shrink alike, so figures compare with the modelled hardware's.

Open loop (:func:`run_http_open`): one dispatcher sleeps until each scheduled arrival and starts
a task for it (its script: one request, or a session closed-loop inside). At most
``max_in_flight`` scripts are alive: when that many are, the dispatcher waits for one to end
before starting the next, so a server that stops answering holds at most that many requests
(until their timeout) and later arrivals wait at the client, in order, their wait counted in
their latency (measured from the scheduled time); the report's client lag shows it. A server
that refuses connections fails each request at once: errors, not a pile-up.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.bench.arrivals import OpenLoop
from gateway.bench.levels import LevelPlan
from gateway.bench.progress import Progress
from gateway.bench.sse import SSEParser
from gateway.bench.stats import (
    ArrivalRecord,
    LevelResult,
    OpenLoopResult,
    RequestRecord,
    summarise,
    summarise_open,
)
from gateway.bench.workloads import Job, Outcome, Send, Think, Workload


@dataclass(frozen=True)
class Target:
    name: str
    url: str  # base URL, with or without a trailing /v1


def _join(base: str, path: str) -> str:
    base = base.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[:-3]
    return base + path


def parse_target(spec: str) -> Target:
    name, sep, url = spec.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--compare takes NAME=URL (e.g. mtp=http://127.0.0.1:30001), got {spec!r}")
    return Target(name, url)


async def discover_model(session: aiohttp.ClientSession, target: Target) -> str | None:
    try:
        async with session.get(_join(target.url, "/v1/models")) as resp:
            if resp.status == 200:
                data = (await resp.json()).get("data") or []
                return str(data[0]["id"]) if data else None
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
        return None
    return None


def _content(choice: dict[str, Any]) -> str:
    if "text" in choice and isinstance(choice["text"], str):
        return choice["text"]
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_one(session: aiohttp.ClientSession, target: Target, job: Job, record: RequestRecord,
                   clock: Callable[[], float], model: str | None, api_key: str | None = None) -> None:
    """Send one streaming request and fill ``record`` in; never raises for HTTP failures."""
    body = dict(job.body)
    if model and "model" not in body:
        body["model"] = model
    headers = dict(job.headers)
    if api_key:
        headers.setdefault("Authorization", f"Bearer {api_key}")
    usage: int | None = None
    text: list[str] = []
    done = False
    try:
        async with session.post(_join(target.url, job.path), json=body, headers=headers) as resp:
            record.backend = resp.headers.get("x-gateway-backend") or target.name
            if resp.status >= 400:
                detail = (await resp.text())[:200]
                record.error, record.end = f"HTTP {resp.status}: {detail}", clock()
                return
            parser = SSEParser()
            async for chunk in resp.content.iter_any():
                now = clock()
                for event in parser.feed(chunk):
                    done, usage = _handle(event.data, now, record, text, done, usage)
            for event in parser.close():
                done, usage = _handle(event.data, clock(), record, text, done, usage)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    record.end = clock()
    record.text = "".join(text)
    chunks = len(record.chunk_times)
    record.tokens = usage if usage is not None else chunks
    if usage is not None and chunks:  # spread the exact count over the chunks (for windows)
        record.chunk_tokens = [usage / chunks] * chunks
    if record.error is None and not done:
        record.error = "stream ended without data: [DONE]"


def _handle(data: str, now: float, record: RequestRecord, text: list[str], done: bool,
            usage: int | None) -> tuple[bool, int | None]:
    if data.strip() == "[DONE]":
        return True, usage
    try:
        obj = json.loads(data)
    except ValueError:
        return done, usage
    if not isinstance(obj, dict):
        return done, usage
    if obj.get("error") and record.error is None:
        error = obj["error"]
        record.error = str(error.get("message") if isinstance(error, dict) else error)[:200]
    for choice in obj.get("choices") or []:
        piece = _content(choice) if isinstance(choice, dict) else ""
        if piece:
            if record.first is None:
                record.first = now
            record.chunk_times.append(now)
            record.chunk_tokens.append(1.0)
            text.append(piece)
    counted = (obj.get("usage") or {}).get("completion_tokens")
    if isinstance(counted, int):
        usage = counted
    prompt = (obj.get("usage") or {}).get("prompt_tokens")
    if isinstance(prompt, int):
        record.prompt_tokens = prompt
    return done, usage


async def run_http_level(session: aiohttp.ClientSession, target: Target, workload: Workload,
                         plan: LevelPlan, *, model: str | None = None, api_key: str | None = None,
                         progress: Progress | None = None,
                         speed: float = 1.0) -> tuple[list[RequestRecord], float]:
    """One level against one target: ``plan.concurrency`` closed-loop slots started together."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def clock() -> float:
        return (loop.time() - t0) * speed

    records: list[RequestRecord] = []
    counters = {"started": 0, "scripts": 0}

    async def request(job: Job) -> Outcome:
        record = RequestRecord(start=clock())
        records.append(record)
        await send_one(session, target, job, record, clock, model, api_key)
        if progress:
            progress.advance(error=record.error is not None)
        return Outcome(record.tokens, record.text, record.error)

    async def slot() -> None:
        while plan.budget_left(counters["started"], clock()):
            script = workload.script(counters["scripts"])
            counters["scripts"] += 1
            value: list[Outcome] | None = None
            while True:
                try:
                    action = script.send(value)
                except StopIteration:
                    break
                value = None
                if isinstance(action, Think):
                    await asyncio.sleep(action.seconds / speed)
                elif isinstance(action, Send):
                    counters["started"] += len(action.jobs)
                    value = list(await asyncio.gather(*(request(job) for job in action.jobs)))

    await asyncio.gather(*(slot() for _ in range(plan.concurrency)))
    return records, clock()


def _client_session(limit: int, request_timeout_s: float) -> aiohttp.ClientSession:
    """The sweep's one client session: `limit` connections to each target, each request bounded
    by `request_timeout_s` (a connection by 10 s)."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def run_http_sweep(targets: Sequence[Target], workload_factory: Callable[[], Workload],
                         plans: Sequence[LevelPlan], *, model: str | None = None,
                         api_key: str | None = None, progress: Progress | None = None,
                         request_timeout_s: float = 3600.0,
                         speed: float = 1.0) -> dict[str, list[LevelResult]]:
    """The sweep against every target, interleaved level by level in a rotating order, so
    drift on the machine (thermal, other tenants) hits every target alike."""
    results: dict[str, list[LevelResult]] = {t.name: [] for t in targets}
    limit = max(p.concurrency for p in plans) * 8 + 16  # agentic bursts exceed C
    async with _client_session(limit, request_timeout_s) as session:
        models = {t.name: model or await discover_model(session, t) for t in targets}
        for i, plan in enumerate(plans):
            shift = i % len(targets)
            for target in list(targets[shift:]) + list(targets[:shift]):
                if progress:
                    progress.start(f"{target.name} C={plan.concurrency}", plan.requests)
                records, wall = await run_http_level(session, target, workload_factory(), plan,
                                                     model=models[target.name], api_key=api_key,
                                                     progress=progress, speed=speed)
                if progress:
                    progress.finish()
                results[target.name].append(
                    summarise(target.name, plan.concurrency, records, wall, plan.window))
    return results


async def run_http_open(session: aiohttp.ClientSession, target: Target, workload: Workload,
                        arrivals: OpenLoop, *, model: str | None = None, api_key: str | None = None,
                        progress: Progress | None = None, speed: float = 1.0,
                        ) -> tuple[list[RequestRecord], list[ArrivalRecord]]:
    """One open-loop run against one target (see the module docstring)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def clock() -> float:
        return (loop.time() - t0) * speed

    records: list[RequestRecord] = []
    arrival_records = [ArrivalRecord(t) for t in arrivals.times]
    slots = asyncio.Semaphore(arrivals.max_in_flight)

    async def request(job: Job, arrival: ArrivalRecord, start: float | None) -> Outcome:
        now = clock()
        record = RequestRecord(start=now if start is None else start, sent=now)
        records.append(record)
        arrival.records.append(record)
        arrival.requests += 1
        arrival.output_asked += job.max_tokens
        await send_one(session, target, job, record, clock, model, api_key)
        arrival.errors += record.error is not None
        if progress:
            progress.advance(error=record.error is not None)
        return Outcome(record.tokens, record.text, record.error)

    async def run_script(i: int) -> None:
        arrival = arrival_records[i]
        arrival.started = clock()
        value: list[Outcome] | None = None
        first, thought = True, 0.0
        try:
            script = workload.script(i)
            while True:
                try:
                    action = script.send(value)
                except StopIteration:
                    break
                value = None
                if isinstance(action, Think):
                    thought += action.seconds
                    await asyncio.sleep(action.seconds / speed)
                elif isinstance(action, Send):
                    # the first Send was due at the scheduled arrival (after the think times
                    # before it, if any); a later one when it is sent
                    start = arrival.scheduled + thought if first else None
                    first = False
                    value = list(await asyncio.gather(*(request(job, arrival, start)
                                                        for job in action.jobs)))
        finally:
            arrival.end = clock()
            slots.release()

    tasks: list[asyncio.Task[None]] = []
    for i, due in enumerate(arrivals.times):
        delay = due / speed - (loop.time() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        await slots.acquire()
        tasks.append(asyncio.create_task(run_script(i)))
    await asyncio.gather(*tasks)
    return records, arrival_records


async def run_http_open_sweep(targets: Sequence[Target], workload_factory: Callable[[], Workload],
                              runs: Sequence[OpenLoop], *, model: str | None = None,
                              api_key: str | None = None, progress: Progress | None = None,
                              request_timeout_s: float = 3600.0,
                              speed: float = 1.0) -> dict[str, list[OpenLoopResult]]:
    """Every open-loop run against every target, one after another (a rotating order, as the
    closed-loop sweep's)."""
    results: dict[str, list[OpenLoopResult]] = {t.name: [] for t in targets}
    # max_in_flight bounds the scripts; a session's parallel sub-requests may exceed it a little
    limit = max(r.max_in_flight for r in runs) * 4 + 16
    async with _client_session(limit, request_timeout_s) as session:
        models = {t.name: model or await discover_model(session, t) for t in targets}
        for i, arrivals in enumerate(runs):
            shift = i % len(targets)
            for target in list(targets[shift:]) + list(targets[:shift]):
                if progress:
                    progress.start(f"{target.name} open loop",
                                   len(arrivals.times) if arrivals.unit == "request" else None)
                records, arrival_records = await run_http_open(
                    session, target, workload_factory(), arrivals, model=models[target.name],
                    api_key=api_key, progress=progress, speed=speed)
                if progress:
                    progress.finish()
                results[target.name].append(summarise_open(target.name, arrivals.label, arrivals.unit,
                                                           records, arrival_records))
    return results
