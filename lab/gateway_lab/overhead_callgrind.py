"""`mtp-gateway overhead --callgrind DIR`: instructions the gateway executes per request and per
chunk, counted by valgrind's callgrind: the same on a busy machine as on a quiet one.

Wall-clock and CPU-time figures on a shared 2-core machine move by 15 % or more from run to
run; an instruction count of a fixed amount of work does not. The gateway runs under
`valgrind --tool=callgrind --instr-atstart=no` (about 50x slower); for each point:

    the load generator opens C connections and sends one 1-token stream on each
        (both sides of the gateway connected and used once: no connection set-up counted)
    callgrind_control --zero; --instr=on
    C workers x R streams of L chunks each, worker i starting i/C x the chunk interval late
    callgrind_control --instr=off; --dump  ->  DIR/callgrind.out.<pid>.<n>
    (the first point's work is run once uncounted first: the code's first runs specialise it)
    the same instrumented, idle, for --callgrind-idle-s: the instructions the gateway executes
        per second doing nothing (uvicorn's 0.1 s tick); the lowest such rate of the run (one
        is taken before the first point too) is subtracted pro rata from the point's

The garbage collector's instructions (gc_collect_main, inclusive) are reported apart and the
comparisons made without them: which window a collection of the older generations falls into
depends on timing (at C=1 there is none; at C=128 it moves a window's total by up to 8 %,
without it the figures agree within 2-3 %; at C=1 within 0.2 %).

The upstream's chunk interval is C x --callgrind-gap-ms (8 ms: chunks reach the gateway evenly,
8 ms apart, slower than it handles one under valgrind), so each chunk is its own read and its
own wake-up: the case of spread arrivals, the costlier one. Per request and per chunk come from
two lengths at C=1 (instructions = requests x (per request + L x per chunk)); at every point
the total per chunk (request cost included) is reported too.

    mtp-gateway overhead --callgrind /tmp/cg                     # C=1 x 16, 128; C=128 x 16
    mtp-gateway overhead --callgrind /tmp/cg --gateway-root /tmp/b3   # other code, same harness
    callgrind_annotate /tmp/cg/callgrind.out.<pid>.<n> | head -60     # where, by C function

The monitor probes once at start (interval 3600 s), the router is not run, nothing else
changes: the gateway is `python -m gateway serve` with the overhead benchmark's config.

`--cprofile DIR` runs the same points with the gateway under cProfile instead (switched on and
off by SIGUSR1 / SIGUSR2 around each point's work): exact Python calls per request, and which
Python functions the time goes to (cProfile's own clock: shares, not costs). One pstats file
per point in DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

POINTS = ((1, 16), (1, 128), (128, 16))  # (C, max_tokens): the rows
_TOTALS = re.compile(rb"^totals:\s*(\d+)", re.M)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--callgrind", metavar="DIR", default=None,
                        help="count the gateway's instructions per request and per chunk under "
                             "valgrind's callgrind (fixed work, not a window); dumps in DIR")
    parser.add_argument("--callgrind-points", default=",".join(f"{c}x{n}" for c, n in POINTS),
                        help="CxL points to count (default: %(default)s)")
    parser.add_argument("--callgrind-requests", type=int, default=16,
                        help="streams per point at least (C x ceil(this / C))")
    parser.add_argument("--callgrind-gap-ms", type=float, default=8.0,
                        help="ms between chunks reaching the gateway (upstream interval C x this)")
    parser.add_argument("--callgrind-idle-s", type=float, default=3.0,
                        help="idle window counted after each point, subtracted pro rata")
    parser.add_argument("--cprofile", metavar="DIR", default=None,
                        help="the same fixed work with the gateway under cProfile (Python calls per "
                             "request and their shares); pstats files in DIR")
    parser.add_argument("--gateway-root", metavar="DIR", default=None,
                        help="run the gateway from this checkout (e.g. a git worktree of an older "
                             "commit); the harness stays this one")


def parse_points(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        c, _, n = part.strip().partition("x")
        out.append((int(c), int(n)))
    return out


def dump_total(path: Path) -> int:
    """Instructions (Ir) in one callgrind dump."""
    match = _TOTALS.search(path.read_bytes())
    if match is None:
        raise RuntimeError(f"no totals in {path}")
    return int(match.group(1))


class Counter:
    """callgrind_control on the gateway's pid: zero, on, off, dump (and the dump's file)."""

    def __init__(self, pid: int, out_dir: Path) -> None:
        self.pid = pid
        self.out_dir = out_dir
        self.control = shutil.which("callgrind_control") or "callgrind_control"

    def _run(self, *flags: str) -> None:
        subprocess.run([self.control, *flags, str(self.pid)], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run("--zero")
        self._run("--instr=on")

    def stop(self) -> Path:
        """Counting off; dump; the new dump file."""
        before = set(self.out_dir.glob(f"callgrind.out.{self.pid}.*"))
        self._run("--instr=off")
        self._run("--dump")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(self.out_dir.glob(f"callgrind.out.{self.pid}.*")) - before
            if new:
                path = max(new, key=lambda p: int(p.name.rsplit(".", 1)[1]))
                time.sleep(0.2)  # written at once, but let it close
                return path
            time.sleep(0.1)
        raise RuntimeError("callgrind wrote no dump")


def cprofile_prelude(out_dir: Path) -> str:
    """`python -c` code: the gateway, with cProfile on at SIGUSR1 and off + dumped at SIGUSR2."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return (
        "import cProfile, itertools, runpy, signal, sys\n"
        "state = {'profile': None, 'n': itertools.count(1)}\n"
        "def on(*_):\n"
        "    state['profile'] = cProfile.Profile(); state['profile'].enable()\n"
        "def off(*_):\n"
        "    profile = state['profile']; profile.disable()\n"
        f"    profile.dump_stats(f'{out_dir.resolve()}/cprofile.{{next(state[\"n\"])}}.pstats')\n"
        "signal.signal(signal.SIGUSR1, on); signal.signal(signal.SIGUSR2, off)\n"
        "sys.argv = ['gateway', *sys.argv[1:]]\n"
        "runpy.run_module('gateway', run_name='__main__')\n")


class ProfileCounter:
    """The cProfile switch of cprofile_prelude's gateway."""

    def __init__(self, pid: int, out_dir: Path) -> None:
        self.pid = pid
        self.out_dir = out_dir

    def start(self) -> None:
        os.kill(self.pid, signal.SIGUSR1)
        time.sleep(0.3)  # the handler runs on the loop's next wake-up

    def stop(self) -> Path:
        before = set(self.out_dir.glob("cprofile.*.pstats"))
        os.kill(self.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(self.out_dir.glob("cprofile.*.pstats")) - before
            if new:
                time.sleep(0.3)
                return new.pop()
            time.sleep(0.1)
        raise RuntimeError("cProfile wrote no stats")


def python_calls(path: Path, requests: int, top: int = 40) -> list[dict[str, Any]]:
    """Per request: calls and own time of the Python functions cProfile saw, most time first."""
    import pstats

    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) or 1.0
    rows = []
    for (file, line, name), (_cc, ncalls, tottime, _cumtime, _callers) in stats.items():
        short = file.split("site-packages/")[-1].split("/gateway/", 1)[-1] if "/" in file else file
        rows.append({"function": f"{name} ({short}:{line})", "calls_per_request": ncalls / requests,
                     "own_share": tottime / total})
    rows.sort(key=lambda r: -r["own_share"])
    return rows[:top]


def fixed_work(h: Any, c: int, length: int, args: argparse.Namespace,
               counter: Counter | ProfileCounter | None = None) -> tuple[dict[str, Any], Path | None]:
    """One fixed workload through the gateway; counted between WARM and its result when a
    counter is given."""
    rounds = max(1, math.ceil(args.callgrind_requests / c))
    itl_ms = max(args.callgrind_gap_ms * c, args.callgrind_gap_ms)
    loadgen = h.loadgen
    loadgen.stdin.write(json.dumps({"cmd": "fixed", "port": h.gateway_port, "concurrency": c,
                                    "max_tokens": length, "requests_per_worker": rounds,
                                    "itl_ms": itl_ms, "start_spread_s": itl_ms / 1000}) + "\n")
    loadgen.stdin.flush()
    line = loadgen.stdout.readline()
    if line.strip() != "WARM":
        raise RuntimeError(f"load generator: {line!r}")
    if counter is not None:
        counter.start()
    loadgen.stdin.write("go\n")
    loadgen.stdin.flush()
    result = json.loads(loadgen.stdout.readline())
    dump = counter.stop() if counter is not None else None
    if "fatal" in result:
        raise RuntimeError(result["fatal"])
    return result, dump


def idle_rate(counter: Counter, idle_s: float) -> tuple[float, Path]:
    """Instructions per second the gateway executes doing nothing, and the dump."""
    counter.start()
    time.sleep(idle_s)
    dump = counter.stop()
    return dump_total(dump) / idle_s, dump


def count_point(h: Any, counter: Counter, args: argparse.Namespace, c: int, length: int,
                idle_rates: list[float]) -> dict[str, Any]:
    """One point, net of idle: the lowest idle rate seen so far (a window that caught
    something, a collection or a late timer, would take too much off)."""
    result, work_dump = fixed_work(h, c, length, args, counter)
    assert work_dump is not None
    rate, idle_dump = idle_rate(counter, args.callgrind_idle_s)
    idle_rates.append(rate)
    work, rate = dump_total(work_dump), min(idle_rates)
    net = work - rate * result["wall_s"]
    gc = gc_instructions(work_dump)
    requests, chunks = result["requests"] or 1, result["chunks"] or 1
    result.update(instructions=work, idle_instructions_per_s=round(rate),
                  instructions_net=round(net), dump=str(work_dump), idle_dump=str(idle_dump),
                  per_request=round(net / requests), per_chunk_all_in=round(net / chunks),
                  gc_instructions=gc, per_request_without_gc=round((net - gc) / requests),
                  top_self=top_functions(work_dump))
    return result


def gc_instructions(dump: Path) -> int:
    """Instructions inside the garbage collector (gc_collect_main, inclusive). Which window a
    collection of the older generations falls into depends on timing: at C=128 it moves a
    window's total by up to 8 %, so comparisons read the figures without it, and it apart."""
    tool = shutil.which("callgrind_annotate")
    if tool is None:
        return 0
    text = subprocess.run([tool, "--inclusive=yes", "--threshold=100", str(dump)], capture_output=True,
                          text=True, timeout=300).stdout
    for line in text.splitlines():
        if "gcmodule.c:gc_collect_main " in line:
            return int(line.split()[0].replace(",", ""))
    return 0


def top_functions(dump: Path, top: int = 20) -> list[dict[str, Any]]:
    """The C functions with the most instructions of their own (callgrind_annotate)."""
    tool = shutil.which("callgrind_annotate")
    if tool is None:
        return []
    text = subprocess.run([tool, "--inclusive=no", "--threshold=100", str(dump)], capture_output=True,
                          text=True, timeout=300).stdout
    rows = []
    for line in text.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+\(\s*([\d.]+)%\)\s+(\S.*?)(?:\s+\[.*\])?$", line)
        if m and "PROGRAM TOTALS" not in line:
            where = m.group(3)
            file, _, function = where.rpartition(":")
            rows.append({"instructions": int(m.group(1).replace(",", "")), "share": float(m.group(2)) / 100,
                         "function": function, "file": file.rsplit("/", 1)[-1]})
        if len(rows) >= top:
            break
    return rows


def fit(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per request and per chunk at C=1 from two lengths: I/req = r + L x c."""
    ones = sorted((p for p in points if p["concurrency"] == 1 and p["requests"]),
                  key=lambda p: p["max_tokens"])
    if len(ones) < 2 or ones[0]["max_tokens"] == ones[-1]["max_tokens"]:
        return None
    a, b = ones[0], ones[-1]
    key = "per_request_without_gc"
    per_chunk = (b[key] - a[key]) / (b["max_tokens"] - a["max_tokens"])
    per_request = a[key] - a["max_tokens"] * per_chunk
    return {"from": f"C=1 x {a['max_tokens']} and {b['max_tokens']}, without the GC",
            "per_chunk": round(per_chunk), "per_request_fixed": round(per_request)}


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Gateway instructions per request and per chunk (callgrind)", "",
             f"Generated {report['generated']} by:", "", "```sh", report["command"], "```", "",
             f"Gateway code at {report['gateway_git']} ({report['gateway_root']}); valgrind "
             f"{report['valgrind']}, Python {report['python']}. Fixed work per point (not a time window): "
             "instructions do not depend on the machine's load.", "",
             "| C x max_tokens | streams | chunks | upstream interval ms | instructions (net of idle) "
             "| of which GC | per request, all in | per request without GC | per chunk, all in "
             "| idle instr/s | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in report["points"]:
        lines.append(f"| {p['concurrency']} x {p['max_tokens']} | {p['requests']} | {p['chunks']:,} | "
                     f"{p['itl_ms']:g} | {p['instructions_net']:,} | {p['gc_instructions']:,} | "
                     f"{p['per_request']:,} | {p['per_request_without_gc']:,} | "
                     f"{p['per_chunk_all_in']:,} | {p['idle_instructions_per_s']:,} | {p['errors']} |")
    f = report.get("fit")
    if f:
        lines += ["", f"Fit from {f['from']}: **{f['per_request_fixed']:,} instructions per request** "
                      f"(set-up and teardown) + **{f['per_chunk']:,} per chunk**."]
    for p in report["points"]:
        if not p.get("top_self"):
            continue
        lines += ["", f"Top C functions by own instructions, C={p['concurrency']} x {p['max_tokens']} "
                      f"(`{Path(p['dump']).name}`), per request:", "",
                  "| instructions per request | share | function | file |", "|---:|---:|---|---|"]
        for row in p["top_self"][:12]:
            lines.append(f"| {row['instructions'] / p['requests']:,.0f} | {row['share'] * 100:.1f} % | "
                         f"`{row['function']}` | {row['file']} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, harness: Any, machine_info: Any, command_line: Any) -> int:
    """Start the harness with the gateway under callgrind, count each point, write the report."""
    import datetime as dt
    import platform

    if args.cprofile:
        return run_cprofile(args, harness)
    out_dir = Path(args.callgrind)
    out_dir.mkdir(parents=True, exist_ok=True)
    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    root = Path(args.gateway_root or Path(__file__).resolve().parents[2]).resolve()
    git = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=root,
                         capture_output=True, text=True).stdout.strip() or "unknown"
    points = []
    with harness(args) as h:
        counter = Counter(h.gateway.pid, out_dir)
        wanted = parse_points(args.callgrind_points)
        fixed_work(h, *wanted[0], args)  # uncounted: first runs of the code (specialising, caches)
        idle_rates = [idle_rate(counter, args.callgrind_idle_s)[0]]
        for c, length in wanted:
            point = count_point(h, counter, args, c, length, idle_rates)
            points.append(point)
            print(f"C={c:<3d} L={length:<3d} {point['requests']} streams, {point['chunks']} chunks, "
                  f"{point['wall_s']:.1f} s: {point['instructions_net']:,} instructions net "
                  f"({point['per_request']:,} per request, {point['per_request_without_gc']:,} without "
                  f"GC, {point['per_chunk_all_in']:,} per chunk all in; "
                  f"idle {point['idle_instructions_per_s']:,}/s), errors {point['errors']}", flush=True)
    report = {"generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "command": command_line(), "gateway_root": str(root), "gateway_git": git,
              "valgrind": valgrind, "python": platform.python_version(), "points": points,
              "fit": fit(points), "machine": machine_info()}
    text = markdown(report)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 1 if any(p["errors"] for p in points) else 0


def run_cprofile(args: argparse.Namespace, harness: Any) -> int:
    out_dir = Path(args.cprofile)
    points = []
    with harness(args) as h:
        counter = ProfileCounter(h.gateway.pid, out_dir)
        wanted = parse_points(args.callgrind_points)
        fixed_work(h, *wanted[0], args)
        for c, length in wanted:
            result, dump = fixed_work(h, c, length, args, counter)
            assert dump is not None
            result.update(pstats=str(dump), python=python_calls(dump, result["requests"]))
            points.append(result)
    lines = []
    for p in points:
        calls = sum(r["calls_per_request"] for r in p["python"])
        lines += [f"C={p['concurrency']} x {p['max_tokens']}: {p['requests']} streams, {p['pstats']} "
                  f"(top {len(p['python'])}: {calls:,.0f} calls per request)", "",
                  "| own share | calls per request | function |", "|---:|---:|---|"]
        lines += [f"| {r['own_share'] * 100:.1f} % | {r['calls_per_request']:.2f} | `{r['function']}` |"
                  for r in p["python"]]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(points, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 1 if any(p["errors"] for p in points) else 0
