"""System calls and event-loop wake-ups per request of the gateway (or the bare relay), at a
fixed workload: strace attached to the process around the overhead benchmark's `fixed` work.

Callgrind counts user-space instructions only; the gateway's CPU time has a system part as large
as its user part. This counts what that part is made of:

    python lab/scripts/syscalls_per_request.py --points 32x16 --requests 256
    python lab/scripts/syscalls_per_request.py --points 32x16 --gateway-root /tmp/wt-22a9b61
    python lab/scripts/syscalls_per_request.py --points 32x16 --target bare

For each point: the load generator opens C connections and warms them (one 1-token stream
each), strace (`strace -f -qq -o FILE -p PID`, every thread) is attached, C x R streams of L
chunks run (chunks C x --gap-ms apart, so each is its own read), strace is detached; then the
same for --idle-s of nothing, whose rate is subtracted pro rata (the monitor's probes, uvicorn's
tick). Reported per request: each system call, and epoll_wait's returns (wake-ups) with events
and without (a timer's timeout). strace slows each call, so wall-clock figures mean nothing
here; the counts are those of the same work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]

from gateway_lab import overhead, overhead_callgrind  # noqa: E402

_CALL = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?([a-z_0-9]+)\(.*\)\s+=\s+(-?\d+|\?)")
_RESUMED = re.compile(r"<\.\.\. ([a-z_0-9]+) resumed>.*\)\s+=\s+(-?\d+|\?)")


def parse_trace(path: Path) -> tuple[collections.Counter[str], int, int]:
    """Calls by name, and epoll_wait's returns with events and with none (a timeout)."""
    calls: collections.Counter[str] = collections.Counter()
    woken = timeouts = 0
    for line in path.read_text(errors="replace").splitlines():
        if "unfinished ..." in line:
            continue
        match = _RESUMED.search(line) or _CALL.match(line)
        if match is None:
            continue
        name, result = match.group(1), match.group(2)
        calls[name] += 1
        if name in ("epoll_wait", "epoll_pwait"):
            if result == "0":
                timeouts += 1
            else:
                woken += 1
    return calls, woken, timeouts


class Tracer:
    """strace attached to every thread of one process, detached by SIGINT."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["strace", "-f", "-o", str(self.out), "-p", str(self.pid)],
                                     stderr=subprocess.PIPE)
        assert self.proc.stderr is not None
        # strace says "Process N attached" for each thread; the first line means it is on.
        self.proc.stderr.readline()
        time.sleep(0.2)

    def stop(self) -> Path:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)
        return self.out


def proc_counters(pid: int) -> dict[str, float]:
    """CPU ms (user, system), page faults and context switches of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"user_ms": int(fields[11]) * tick_ms, "sys_ms": int(fields[12]) * tick_ms,
            "minor_faults": int(fields[7]), "major_faults": int(fields[9]),
            "voluntary_switches": int(status["voluntary_ctxt_switches"]),
            "involuntary_switches": int(status["nonvoluntary_ctxt_switches"])}


class CpuMeter:
    """The process's /proc counters around the work, untraced (start/stop like a Tracer)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before: dict[str, float] = {}
        self.delta: dict[str, float] = {}

    def start(self) -> None:
        self.before = proc_counters(self.pid)

    def stop(self) -> None:
        after = proc_counters(self.pid)
        self.delta = {k: after[k] - self.before[k] for k in after}


def measure_cpu(h: Any, pid: int, port: int, c: int, length: int, args: argparse.Namespace) -> dict[str, Any]:
    meter = CpuMeter(pid)
    result, _ = overhead_callgrind.fixed_work(Target(h, port), c, length, args,
                                              meter)  # type: ignore[arg-type]
    requests = result["requests"] or 1
    chunks = result["chunks"] or 1
    per = {k: round(v / requests, 3) for k, v in meter.delta.items()}
    cpu_ms = meter.delta["user_ms"] + meter.delta["sys_ms"]
    return {**result, "per_request": per,
            "cpu_ms_per_1k_chunks": round(cpu_ms * 1000 / chunks, 1),
            "user_ms_per_1k_chunks": round(meter.delta["user_ms"] * 1000 / chunks, 1),
            "sys_ms_per_1k_chunks": round(meter.delta["sys_ms"] * 1000 / chunks, 1)}


class Target:
    """What fixed_work needs of the harness, pointed at the gateway or the bare relay."""

    def __init__(self, h: Any, port: int) -> None:
        self.loadgen, self.gateway_port = h.loadgen, port


def count(h: Any, pid: int, port: int, c: int, length: int, args: argparse.Namespace,
          workdir: Path) -> dict[str, Any]:
    target = Target(h, port)
    tracer = Tracer(pid, workdir / f"work-{c}x{length}.trace")
    result, _ = overhead_callgrind.fixed_work(target, c, length, args, tracer)  # type: ignore[arg-type]
    work, woken, timeouts = parse_trace(tracer.out)
    idle_tracer = Tracer(pid, workdir / f"idle-{c}x{length}.trace")
    idle_tracer.start()
    time.sleep(args.idle_s)
    idle_tracer.stop()
    idle, idle_woken, idle_timeouts = parse_trace(idle_tracer.out)
    requests = result["requests"] or 1
    scale = result["wall_s"] / args.idle_s

    def per_request(total: float, idle_total: float) -> float:
        return round(float(total - idle_total * scale) / requests, 2)

    names = sorted(set(work) | set(idle), key=lambda n: -work[n])
    return {**result,
            "per_request": {n: per_request(work[n], idle[n]) for n in names},
            "total_per_request": per_request(sum(work.values()), sum(idle.values())),
            "wakeups_per_request": per_request(woken, idle_woken),
            "timeouts_per_request": per_request(timeouts, idle_timeouts),
            "idle_calls_per_s": round(sum(idle.values()) / args.idle_s, 1),
            "raw": dict(work), "raw_idle": dict(idle)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    overhead.add_arguments(parser)
    parser.add_argument("--points", default="32x16", help="CxL points")
    parser.add_argument("--requests", type=int, default=256, help="streams per point at least")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="ms between chunks at the gateway")
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--target", choices=("gateway", "bare"), default="gateway")
    parser.add_argument("--cpu", action="store_true",
                        help="no strace: the process's CPU (user, system), faults and context switches")
    parser.add_argument("--out", default=None, help="JSON report file")
    args = parser.parse_args(argv)
    args.callgrind_requests, args.callgrind_gap_ms = args.requests, args.gap_ms
    args.bare_relay = args.target == "bare"
    args.no_router = True
    reports = []
    with tempfile.TemporaryDirectory(prefix="syscalls-") as tmp, overhead.harness(args) as h:
        proc, port = (h.bare, h.bare_port) if args.target == "bare" else (h.gateway, h.gateway_port)
        assert proc is not None
        pid = proc.pid
        for c, length in overhead_callgrind.parse_points(args.points):
            overhead_callgrind.fixed_work(Target(h, port), c, length, args)  # uncounted warm-up
            if args.cpu:
                point = measure_cpu(h, pid, port, c, length, args)
                reports.append(point)
                print(f"{args.target} C={c} L={length}: {point['requests']} streams, "
                      f"{point['chunks']} chunks, {point['wall_s']} s, errors {point['errors']}; "
                      f"CPU per 1k chunks "
                      f"{point['cpu_ms_per_1k_chunks']} ms (user {point['user_ms_per_1k_chunks']}, sys "
                      f"{point['sys_ms_per_1k_chunks']}); per request {point['per_request']}", flush=True)
                continue
            point = count(h, pid, port, c, length, args, Path(tmp))
            reports.append(point)
            top = ", ".join(f"{n} {v}" for n, v in list(point["per_request"].items())[:12])
            print(f"{args.target} C={c} L={length}: {point['requests']} streams, {point['chunks']} chunks, "
                  f"errors {point['errors']}; per request: {point['total_per_request']} calls, "
                  f"{point['wakeups_per_request']} epoll wake-ups with events, "
                  f"{point['timeouts_per_request']} without; idle {point['idle_calls_per_s']} calls/s; "
                  f"{top}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(reports, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
