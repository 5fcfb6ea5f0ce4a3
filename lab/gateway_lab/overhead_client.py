"""The overhead benchmark's load generator: a cheap raw-asyncio HTTP/1.1 client (keep-alive,
chunked decoding, SSE events by byte search) and the three measurements that use it.

It shares CPU 0 with the fake upstream, so it does as little per byte as possible: a content
event is any SSE event containing the SGLang content-delta marker; everything else (role
chunk, finish chunk, `[DONE]`) is only counted. Timestamps are taken once per socket read.

It runs as a subprocess (`python -m gateway_lab.overhead_client`) driven by JSON lines on
stdin, one JSON line of results per command on stdout:

    {"cmd": "closed_loop", "port": P, "concurrency": C, "max_tokens": L, "warmup_s": 1,
     "duration_s": 10, "watch_pid": PID}
    {"cmd": "sequential", "targets": {"direct": P1, "gateway": P2}, "body_bytes": 400000,
     "requests": 50, "warmup": 5, "watch_pid": PID}
    {"cmd": "open_streams", "port": P, "streams": 1000, "max_tokens": 8, "itl_ms": 1000,
     "watch_pid": PID}
    {"cmd": "fixed", "port": P, "concurrency": C, "max_tokens": L, "requests_per_worker": R,
     "itl_ms": 80, "start_spread_s": 0.08}

`fixed` (the instruction-count harness's): C connections opened and warmed with one 1-token
stream each, then a line `WARM` on stdout; on the next stdin line, exactly C x R streams of L
chunks (worker i starts i/C x start_spread_s late), then its result line.

`watch_pid`'s CPU (utime+stime) and memory (VmRSS, VmHWM) are read from /proc at the exact
start and end of the measurement window, by the same loop that counts the chunks.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from array import array
from typing import Any

from gateway.bench import stats
from gateway_lab.fast_upstream import MODEL, raise_nofile_limit

CONTENT_MARKER = b'"delta":{"reasoning_content":null,"content":"'
DONE_EVENT = b"data: [DONE]"
CLK_TCK = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"
_SIZE, _DATA, _CRLF, _TRAILER = range(4)  # chunked-decoding states


# ---------------------------------------------------------------------------- /proc readers


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def machine_busy_s() -> float:
    """CPU time spent by everything on the machine (all cores, not idle or iowait), in seconds."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def proc_memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM in MB (10^6 bytes would flatter; these are MiB)."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, value = line.split(":", 1)
                out[name] = int(value.split()[0]) / 1024
    return {"rss_mb": out.get("VmRSS", 0.0), "hwm_mb": out.get("VmHWM", 0.0)}


# ---------------------------------------------------------------------------- requests


def chat_request(port: int, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Authorization: Bearer bench\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


def stream_body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short poem about the sea, please."}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}


def agent_context_body(target_bytes: int) -> dict[str, Any]:
    """A long agent conversation: system prompt, tool calls and tool results with code and
    escaped JSON, some non-ASCII; about `target_bytes` once encoded; a tiny answer."""
    code = ('def handler(event, context):\n    """Process one event."""\n    items = event.get("items", [])\n'
            '    total = sum(i["price"] * i["qty"] for i in items)\n    return {"total": total, '
            '"currency": "EUR", "note": "prix très élevé — 検証済み"}\n\n')
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 40}]
    turn = 0
    size = 2000
    while size < target_bytes:
        call_id = f"call_{turn:06d}"
        args = json.dumps({"path": f"src/module_{turn}.py", "line": turn})
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": args}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": code * 8})
        messages.append({"role": "user", "content": f"Now fix the bug in module {turn}. "
                                                    "Keep the interface; add a test."})
        size = len(json.dumps(messages, separators=(",", ":")))
        turn += 1
    return {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, "stream": False}


class Result:
    """One response as the client saw it."""

    __slots__ = ("sent_at", "status", "last_at", "content", "done", "error", "end_at")

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.status = 0
        self.last_at = 0.0
        self.content = 0
        self.done = False
        self.error: str | None = None
        self.end_at = 0.0


class Window:
    """What a closed-loop run counts: chunks, TTFTs and gaps inside [t0, t1]."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, t1
        self.chunks = 0
        self.ttft = array("d")
        self.gaps = array("d")


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; parses the response as bytes arrive."""

    def __init__(self, window: Window | None = None) -> None:
        self.window = window
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.sse = bytearray()
        self.result: Result | None = None
        self.waiter: asyncio.Future[Result] | None = None
        self.first_content: asyncio.Future[None] | None = None
        self.head_done = False
        self.chunked = False
        self.remaining = 0  # content-length body left, or bytes left in the current chunk
        self.state = _SIZE
        self.lost = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.result is not None:
            self._finish(f"connection lost: {exc!r}" if exc else "connection closed by server")

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.result is None:
            return  # nothing outstanding (should not happen)
        self.buf += data
        try:
            self._parse(now)
        except ValueError as exc:
            self._finish(f"protocol error: {exc}")
            if self.transport is not None:
                self.transport.close()

    # -- requests
    def send(self, request: bytes) -> asyncio.Future[Result]:
        assert self.transport is not None and self.result is None
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.head_done = False
        self.buf.clear()
        self.sse.clear()
        self.result = Result(time.perf_counter())
        self.transport.write(request)
        return self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _finish(self, error: str | None = None) -> None:
        result, waiter = self.result, self.waiter
        self.result = self.waiter = None
        if result is None or waiter is None:
            return
        result.error = error
        result.end_at = time.perf_counter()
        if not waiter.done():
            waiter.set_result(result)

    # -- parsing
    def _parse(self, now: float) -> None:
        buf = self.buf
        result = self.result
        assert result is not None
        if not self.head_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(buf[:end]).split(b"\r\n")
            result.status = int(lines[0].split(b" ", 2)[1])
            self.chunked, self.remaining = False, 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    self.chunked = True
                elif name == b"content-length":
                    self.remaining = int(value)
            del buf[: end + 4]
            self.head_done = True
            self.state = _SIZE
        if not self.chunked:
            take = min(len(buf), self.remaining)
            if take:
                self._payload(bytes(buf[:take]), now)
            del buf[:take]
            self.remaining -= take
            if self.remaining == 0:
                self._finish(None if result.status == 200 else f"HTTP {result.status}")
            return
        pos, n = 0, len(buf)
        while pos < n:
            state = self.state
            if state == _SIZE:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
                pos = eol + 2
                self.remaining, self.state = size, (_DATA if size else _TRAILER)
            elif state == _DATA:
                take = min(self.remaining, n - pos)
                self._payload(bytes(buf[pos: pos + take]), now)
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self.state = _CRLF
            else:  # _CRLF after a chunk's data, or the blank line after the last chunk
                if n - pos < 2:
                    break
                pos += 2
                if state == _TRAILER:
                    del buf[:pos]
                    self._finish(None if result.status == 200 else f"HTTP {result.status}")
                    return
                self.state = _SIZE
        del buf[:pos]

    def _payload(self, data: bytes, now: float) -> None:
        result = self.result
        assert result is not None
        sse = self.sse
        sse += data
        start = 0
        while True:
            end = sse.find(b"\n\n", start)
            if end < 0:
                break
            event = sse[start:end]
            start = end + 2
            if CONTENT_MARKER in event:
                self._content(result, now)
            elif event == DONE_EVENT:
                result.done = True
        if start:
            del sse[:start]

    def _content(self, result: Result, now: float) -> None:
        window = self.window
        if result.content == 0:
            if window is not None and window.t0 <= result.sent_at <= window.t1:
                window.ttft.append(now - result.sent_at)
            if self.first_content is not None and not self.first_content.done():
                self.first_content.set_result(None)
        elif window is not None and window.t0 <= now <= window.t1:
            window.gaps.append(now - result.last_at)
        if window is not None and window.t0 <= now <= window.t1:
            window.chunks += 1
        result.content += 1
        result.last_at = now


async def connect(port: int, window: Window | None = None) -> Connection:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(lambda: Connection(window), HOST, port)
    return protocol


def percentile(values: Any, q: float) -> float | None:
    """stats.percentile (linear interpolation), None instead of NaN when empty (for JSON)."""
    value = stats.percentile(list(values), q)
    return None if math.isnan(value) else value


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def _check(result: Result, expect_content: int | None) -> str | None:
    if result.error:
        return result.error
    if expect_content is not None:
        if not result.done:
            return "no [DONE]"
        if result.content != expect_content:
            return f"{result.content} content chunks, expected {expect_content}"
    return None


# ---------------------------------------------------------------------------- measurements


async def closed_loop(port: int, concurrency: int, max_tokens: int, warmup_s: float, duration_s: float,
                      watch_pid: int | None, upstream_pid: int | None = None,
                      start_spread_s: float = 0.0, drain_s: float = 30.0) -> dict[str, Any]:
    """C workers, each sending streaming requests back to back; counts inside the window.

    Worker i starts at i/C x `start_spread_s` (one stream's duration spreads the arrivals evenly,
    as independent users would; 0 starts them all at once, in lock-step waves). The window opens
    `warmup_s` after the start, or when the last worker has started if that is later."""
    loop = asyncio.get_running_loop()
    request = chat_request(port, stream_body(max_tokens))
    begin = time.perf_counter()
    opens = begin + max(warmup_s, start_spread_s)
    window = Window(opens, opens + duration_s)
    errors: dict[str, int] = {}
    requests_in_window = 0
    requests_total = 0
    samples: dict[str, Any] = {}

    def sample(tag: str) -> None:
        samples[f"{tag}_at"] = time.perf_counter()
        if watch_pid:
            samples[f"{tag}_cpu_s"] = proc_cpu_s(watch_pid)
            samples[f"{tag}_mem"] = proc_memory_mb(watch_pid)
        # The harness's own side (load generator + fake upstream): is it the limit?
        harness = proc_cpu_s(os.getpid())
        if upstream_pid and upstream_pid != watch_pid:
            harness += proc_cpu_s(upstream_pid)
        samples[f"{tag}_harness_cpu_s"] = harness
        samples[f"{tag}_machine_s"] = machine_busy_s()

    loop.call_at(loop.time() + (window.t0 - time.perf_counter()), sample, "t0")
    loop.call_at(loop.time() + (window.t1 - time.perf_counter()), sample, "t1")

    async def worker(index: int) -> None:
        nonlocal requests_in_window, requests_total
        conn: Connection | None = None
        if start_spread_s > 0:
            await asyncio.sleep(start_spread_s * index / concurrency)
        while time.perf_counter() < window.t1:
            if conn is None or conn.lost:
                try:
                    conn = await connect(port, window)
                except OSError as exc:
                    errors[f"connect: {exc.strerror}"] = errors.get(f"connect: {exc.strerror}", 0) + 1
                    await asyncio.sleep(0.05)
                    continue
            result = await conn.send(request)
            requests_total += 1
            if window.t0 <= result.sent_at <= window.t1:
                requests_in_window += 1
            problem = _check(result, max_tokens)
            if problem:
                errors[problem] = errors.get(problem, 0) + 1
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    workers = [asyncio.ensure_future(worker(i)) for i in range(concurrency)]
    done, pending = await asyncio.wait(workers, timeout=opens - begin + duration_s + drain_s)
    for task in pending:
        task.cancel()
    if pending:
        errors["stuck at the end of the window"] = len(pending)
    await asyncio.gather(*workers, return_exceptions=True)
    elapsed = (samples.get("t1_at", window.t1) - samples.get("t0_at", window.t0))
    out: dict[str, Any] = {
        "concurrency": concurrency, "max_tokens": max_tokens, "window_s": round(elapsed, 3),
        "warmup_s": round(opens - begin, 3), "start_spread_s": start_spread_s,
        "chunks": window.chunks, "chunks_per_s": round(window.chunks / duration_s, 1),
        "requests": requests_in_window, "requests_per_s": round(requests_in_window / duration_s, 1),
        "requests_total": requests_total,
        "ttft_p50_ms": _ms(percentile(window.ttft, 50)), "ttft_p99_ms": _ms(percentile(window.ttft, 99)),
        "itl_p50_ms": _ms(percentile(window.gaps, 50)), "itl_p99_ms": _ms(percentile(window.gaps, 99)),
        "ttft_samples": len(window.ttft), "itl_samples": len(window.gaps),
        "errors": sum(errors.values()), "error_kinds": errors,
    }
    if "t0_harness_cpu_s" in samples and "t1_harness_cpu_s" in samples and elapsed > 0:
        harness_s = samples["t1_harness_cpu_s"] - samples["t0_harness_cpu_s"]
        if upstream_pid == watch_pid and watch_pid:  # direct: the watched process is the upstream
            harness_s += samples["t1_cpu_s"] - samples["t0_cpu_s"]
        out["harness_cpu_util"] = round(harness_s / elapsed, 3)
        # Whatever else ran on the machine meanwhile (other programs skew every figure).
        machine_s = samples["t1_machine_s"] - samples["t0_machine_s"]
        ours = harness_s
        if watch_pid and upstream_pid != watch_pid and "t1_cpu_s" in samples:
            ours += samples["t1_cpu_s"] - samples["t0_cpu_s"]
        out["foreign_cpu_util"] = round(max(0.0, machine_s - ours) / elapsed, 3)
    if watch_pid and "t0_cpu_s" in samples and "t1_cpu_s" in samples:
        cpu_s = samples["t1_cpu_s"] - samples["t0_cpu_s"]
        out["watched_cpu_s"] = round(cpu_s, 3)
        out["watched_cpu_util"] = round(cpu_s / elapsed, 3) if elapsed > 0 else None
        out["watched_cpu_ms_per_1k_chunks"] = (round(cpu_s * 1e6 / window.chunks, 1)
                                               if window.chunks else None)
        out["watched_rss_mb"] = round(samples["t1_mem"]["rss_mb"], 1)
        out["watched_hwm_mb"] = round(samples["t1_mem"]["hwm_mb"], 1)
    return out


def _ours_s(pids: list[int | None]) -> float:
    return sum(proc_cpu_s(pid) for pid in {os.getpid(), *pids} if pid)


async def sequential(targets: dict[str, int], body_bytes: int, requests: int, warmup: int,
                     watch_pid: int | None, upstream_pid: int | None = None) -> dict[str, Any]:
    """Non-streamed requests one at a time, alternating targets (rotating order), each on its
    own kept-alive connection: end-to-end time per target."""
    body = agent_context_body(body_bytes) if body_bytes else {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "temperature": 0, "stream": False}
    conns = {name: await connect(port) for name, port in targets.items()}
    wire = {name: chat_request(port, body) for name, port in targets.items()}
    times: dict[str, list[float]] = {name: [] for name in targets}
    errors: dict[str, int] = {}
    names = list(targets)
    cpu_before = proc_cpu_s(watch_pid) if watch_pid else None
    started, machine0, ours0 = time.perf_counter(), machine_busy_s(), _ours_s([watch_pid, upstream_pid])
    for i in range(warmup + requests):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            conn = conns[name]
            if conn.lost:
                conn = conns[name] = await connect(targets[name])
            result = await conn.send(wire[name])
            problem = _check(result, None)
            if problem:
                errors[f"{name}: {problem}"] = errors.get(f"{name}: {problem}", 0) + 1
            elif i >= warmup:
                times[name].append(result.end_at - result.sent_at)
    cpu_after = proc_cpu_s(watch_pid) if watch_pid else None
    elapsed = time.perf_counter() - started
    foreign = (machine_busy_s() - machine0) - (_ours_s([watch_pid, upstream_pid]) - ours0)
    for conn in conns.values():
        conn.close()
    body_size = len(json.dumps(body, separators=(",", ":")).encode())  # the JSON, not the head
    out: dict[str, Any] = {"body_bytes": body_size, "requests": requests,
                           "errors": sum(errors.values()), "error_kinds": errors,
                           "foreign_cpu_util": round(max(0.0, foreign) / elapsed, 3)}
    for name, values in times.items():
        out[name] = {"e2e_p50_ms": _ms(percentile(values, 50)), "e2e_p99_ms": _ms(percentile(values, 99)),
                     "e2e_mean_ms": _ms(sum(values) / len(values)) if values else None,
                     "samples": len(values)}
    if cpu_before is not None and cpu_after is not None:
        out["watched_cpu_ms_per_request"] = round((cpu_after - cpu_before) * 1000
                                                  / (warmup + requests), 3)
    return out


async def open_streams(port: int, streams: int, max_tokens: int, itl_ms: float,
                       watch_pid: int | None, open_timeout_s: float = 60.0) -> dict[str, Any]:
    """Open `streams` slow streams at once; read the watched process's memory while all are open."""
    loop = asyncio.get_running_loop()
    request = chat_request(port, stream_body(max_tokens, bench_itl_ms=itl_ms))
    before = proc_memory_mb(watch_pid) if watch_pid else None
    started = time.perf_counter()
    errors: dict[str, int] = {}

    async def one(conn: Connection) -> Result:
        return await conn.send(request)

    async def open_one() -> Connection | None:
        try:
            return await connect(port)
        except OSError as exc:
            errors[f"connect: {exc.strerror}"] = errors.get(f"connect: {exc.strerror}", 0) + 1
            return None

    conns = [c for c in await asyncio.gather(*(open_one() for _ in range(streams))) if c is not None]
    for conn in conns:
        conn.first_content = loop.create_future()
    results = [asyncio.ensure_future(one(conn)) for conn in conns]
    firsts = [conn.first_content for conn in conns if conn.first_content is not None]
    _, not_open = await asyncio.wait(firsts, timeout=open_timeout_s)
    all_open_s = time.perf_counter() - started
    during: dict[str, float] = {}
    open_at_sample = 0
    for _ in range(3):  # all stay open until the first one ends (max_tokens x itl_ms)
        open_now = sum(1 for c in conns if c.result is not None and c.result.content > 0)
        open_at_sample = max(open_at_sample, open_now)
        if watch_pid:
            mem = proc_memory_mb(watch_pid)
            during = {"rss_mb": max(during.get("rss_mb", 0.0), mem["rss_mb"]), "hwm_mb": mem["hwm_mb"]}
        await asyncio.sleep(0.2)
    finished = await asyncio.gather(*results)
    for result in finished:
        problem = _check(result, max_tokens)
        if problem:
            errors[problem] = errors.get(problem, 0) + 1
    for conn in conns:
        conn.close()
    after = proc_memory_mb(watch_pid) if watch_pid else None
    return {"streams": streams, "opened": len(conns) - len(not_open), "open_at_sample": open_at_sample,
            "all_open_after_s": round(all_open_s, 3),
            "max_tokens": max_tokens, "itl_ms": itl_ms,
            "rss_before_mb": round(before["rss_mb"], 1) if before else None,
            "rss_open_mb": round(during["rss_mb"], 1) if during else None,
            "hwm_mb": round(during["hwm_mb"], 1) if during else None,
            "rss_after_mb": round(after["rss_mb"], 1) if after else None,
            "errors": sum(errors.values()), "error_kinds": errors}


async def fixed(port: int, concurrency: int, max_tokens: int, requests_per_worker: int, itl_ms: float,
                start_spread_s: float) -> dict[str, Any]:
    """A fixed amount of work, the same every time: the instruction counter's workload."""
    loop = asyncio.get_running_loop()
    conns = [await connect(port) for _ in range(concurrency)]
    warm = chat_request(port, stream_body(1))
    errors: dict[str, int] = {}

    def check(result: Result, expect: int) -> None:
        problem = _check(result, expect)
        if problem:
            errors[problem] = errors.get(problem, 0) + 1

    for result in await asyncio.gather(*(conn.send(warm) for conn in conns)):
        check(result, 1)  # every connection, both sides of the gateway, open and used once
    print("WARM", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    request = chat_request(port, stream_body(max_tokens, bench_itl_ms=itl_ms))
    chunks = 0

    async def worker(index: int, conn: Connection) -> None:
        nonlocal chunks
        await asyncio.sleep(start_spread_s * index / concurrency)
        for _ in range(requests_per_worker):
            result = await conn.send(request)
            chunks += result.content
            check(result, max_tokens)

    started = time.perf_counter()
    await asyncio.gather(*(worker(i, conn) for i, conn in enumerate(conns)))
    wall = time.perf_counter() - started
    for conn in conns:
        conn.close()
    return {"concurrency": concurrency, "max_tokens": max_tokens,
            "requests": concurrency * requests_per_worker, "chunks": chunks,
            "wall_s": round(wall, 3), "itl_ms": itl_ms,
            "errors": sum(errors.values()), "error_kinds": errors}


async def dispatch(command: dict[str, Any]) -> dict[str, Any]:
    cmd = command.pop("cmd")
    if cmd == "fixed":
        return await fixed(**command)
    if cmd == "closed_loop":
        return await closed_loop(**command)
    if cmd == "sequential":
        return await sequential(**command)
    if cmd == "open_streams":
        return await open_streams(**command)
    raise ValueError(f"unknown command {cmd!r}")


async def _serve_stdin() -> None:
    loop = asyncio.get_running_loop()
    print("READY", flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        if not line.strip():
            continue
        try:
            out = await dispatch(json.loads(line))
        except Exception as exc:  # report, keep serving
            out = {"fatal": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def main() -> int:
    raise_nofile_limit()
    try:
        import uvloop

        uvloop.run(_serve_stdin())
    except ImportError:  # pragma: no cover
        asyncio.run(_serve_stdin())
    return 0


if __name__ == "__main__":
    sys.exit(main())
