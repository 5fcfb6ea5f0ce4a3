"""`mtp-gateway overhead`: what the gateway itself costs per request and per chunk.

The same closed-loop streaming load goes to a fast fake upstream directly, through the
gateway and through SGLang's own Rust router (`sglang-router`, when installed: the third column,
so the gateway's cost reads as a ratio to the router's), interleaved (order rotated), at
C = 1, 32, 128 x max_tokens 16, 128. The processes:

    fake upstream  (lab/gateway_lab/fast_upstream.py)    CPU 0
    load generator (lab/gateway_lab/overhead_client.py)  CPU 0
    gateway        (python -m gateway serve)           CPU 1
    sglang-router  (python -m sglang_router.launch_router --policy round_robin)  CPU 1

(the gateway and the router take turns: only the one under load works during a window)

(pinning only when the machine has two usable cores or more). Per point: chunks/s, added TTFT
p50/p99 and added inter-chunk p99 (gateway minus direct), the gateway's CPU per 1,000 chunks
(utime+stime from /proc over the window) and its RSS. Then a 400 KB non-streamed chat request
(long agent context) one at a time, and the gateway's RSS with 1,000 slow streams open.
Writes Markdown (stdout or --markdown) and JSON (--json), with the machine and the command.

    mtp-gateway overhead --json lab/results/perf/overhead.json --markdown lab/results/perf/overhead.md
    mtp-gateway overhead --quick        # CI: C=32 x 16 tokens, a 3 s window, small extras
    mtp-gateway overhead --concurrency 128 --lengths 16 --gateway-only --profile DIR   # py-spy

(`python -m gateway_lab.overhead` is the same command.) On a shared machine add
`--wait-quiet 600`: every window records the CPU other programs used meanwhile, and a window
where they used more than 0.1 core is measured again (--busy-retries, --busy-wait).

Exit status: 0 when every run completed without errors (targets are reported, not enforced,
unless --check-targets), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gateway_lab import overhead_callgrind
from gateway_lab import overhead_report as report_mod
from gateway_lab.fast_upstream import EFFECTIVE_CAP, raise_nofile_limit
from gateway_lab.overhead_client import machine_busy_s

REPO_ROOT = Path(__file__).resolve().parents[2]
NEVER_FLIP = 100_000  # the crossover (requests in flight) in the measured gateway's config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--concurrency", default="1,32,128", help="comma-separated C values")
    parser.add_argument("--lengths", default="16,128", help="comma-separated max_tokens values")
    parser.add_argument("--duration", type=float, default=10.0, help="measurement window, s")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window, s")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats (medians reported)")
    parser.add_argument("--start-spread-ms", type=float, default=None,
                        help="spread the C workers' first requests over this long (default: one "
                             "stream's duration, so arrivals are even; 0: all at once, lock-step waves)")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="fake upstream time to first token")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="fake upstream ms between chunks")
    parser.add_argument("--big-body-kb", type=int, default=400, help="large request body, KB (0: skip)")
    parser.add_argument("--big-body-requests", type=int, default=50)
    parser.add_argument("--open-streams", type=int, default=1000, help="streams held open (0: skip)")
    parser.add_argument("--open-streams-itl-ms", type=float, default=1000.0)
    parser.add_argument("--open-streams-tokens", type=int, default=8)
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke: C=32, max_tokens 16, 3 s window, small extras")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.add_argument("--gateway-loop", choices=("as-shipped", "uvloop"), default="as-shipped",
                        help="experiment: force uvloop under the gateway (event loop policy set "
                             "before `gateway serve` starts) to see what the loop alone is worth")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                        help="first wait up to S seconds for other programs to leave the CPUs idle")
    parser.add_argument("--busy-retries", type=int, default=2,
                        help="measure a window again when other programs used the CPUs during it")
    parser.add_argument("--busy-wait", type=float, default=30.0, metavar="S",
                        help="before such a retry, wait up to S seconds for the machine to be quiet")
    parser.add_argument("--gateway-only", action="store_true",
                        help="skip the direct and router runs (profiling)")
    parser.add_argument("--gateway-config", metavar="JSON", default=None,
                        help="experiment: top-level sections replacing the gateway config's, e.g. "
                             "'{\"log\": {\"access\": false}}' (the report's command says so)")
    parser.add_argument("--bare-relay", action="store_true",
                        help="a fourth column: the floor of a Python relay on uvloop (no gateway "
                             "logic; lab/gateway_lab/overhead_bare_relay.py), pinned like the gateway")
    parser.add_argument("--asgi-relay", action="store_true",
                        help="another column: the gateway's HTTP stack without its logic (uvicorn, "
                             "the gateway's protocol and upstream client, an ASGI app of a few "
                             "lines; lab/gateway_lab/overhead_asgi_relay.py), pinned like the gateway")
    parser.add_argument("--granian", action="store_true",
                        help="two more columns on granian, a compiled (Rust) ASGI server (pip "
                             "install granian): the ASGI relay, and the gateway itself "
                             "(lab/gateway_lab/granian_front.py)")
    parser.add_argument("--lean-front", action="store_true",
                        help="two more columns on a lean HTTP/1.1 front of ~200 lines instead of "
                             "uvicorn (lab/gateway_lab/lean_front.py, a prototype): the ASGI relay, "
                             "and the gateway itself")
    parser.add_argument("--gateway-process", choices=tuple(SEATS), default="serve",
                        help="what runs in the gateway's place (all measurements, callgrind "
                             "included): serve (the gateway on uvicorn), lean-gateway (on the lean "
                             "front), asgi-relay, lean-relay, bare-relay (the relays without its "
                             "logic)")
    parser.add_argument("--no-router", action="store_true",
                        help="skip the sglang-router column (it runs when sglang_router is installed)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="py-spy record the gateway during each gateway window into DIR")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the JSON report here")
    parser.add_argument("--markdown", metavar="FILE", default=None,
                        help="write the Markdown report here (default: stdout)")
    parser.add_argument("--check-targets", action="store_true",
                        help="exit 1 when a measured target fails")
    overhead_callgrind.add_arguments(parser)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


QUIET_CORES = 0.1  # other programs' CPU use above which the figures are suspect


def machine_load(over_s: float = 1.0) -> float:
    """Cores' worth of CPU the whole machine used over the last `over_s` (us included)."""
    before = machine_busy_s()
    time.sleep(over_s)
    return (machine_busy_s() - before) / over_s


def wait_quiet(limit_s: float) -> float:
    deadline = time.monotonic() + limit_s
    load = machine_load()
    while load > QUIET_CORES and time.monotonic() < deadline:
        _log(f"machine busy ({load:.2f} cores used by other programs); waiting for quiet")
        time.sleep(4.0)
        load = machine_load()
    return load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_plan(no_pin: bool) -> tuple[set[int] | None, set[int] | None, str]:
    """(CPUs for upstream + load generator, CPUs for the gateway, description)."""
    allowed = sorted(os.sched_getaffinity(0))
    if no_pin or len(allowed) < 2:
        why = "--no-pin" if no_pin else f"only {len(allowed)} usable core"
        return None, None, f"none ({why}): all processes share the machine"
    load, gw = allowed[0], allowed[1]
    return ({load}, {gw},
            f"fake upstream + load generator on CPU {load}, gateway alone on CPU {gw} "
            "(sched_setaffinity, as taskset -c)")


def callgrind_prefix(out_dir: Path) -> list[str]:
    """valgrind's callgrind with counting off until the harness turns it on (callgrind_control)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out_dir.resolve()}/callgrind.out.%p"]


def _preexec(cpus: set[int] | None) -> Any:
    def setup() -> None:
        os.setsid()  # its own process group: we stop exactly what we started
        raise_nofile_limit()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return setup


def _clean_env() -> dict[str, str]:
    """No GATEWAY_* overrides leak from the caller's environment into the measured gateway."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    # The gateway from this checkout (or --gateway-root's, put first by the caller) and the lab.
    paths = [str(REPO_ROOT), str(REPO_ROOT / "lab")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


# --gateway-process: what runs in the gateway's seat, as `python -m` arguments (CONFIG: the
# gateway's config file, UPSTREAM: the fake upstream's port; --port is the gateway's).
SEATS: dict[str, tuple[str, ...] | None] = {
    "serve": None,
    "lean-gateway": ("gateway_lab.lean_front", "--config", "CONFIG", "--port", "PORT"),
    "asgi-relay": ("gateway_lab.overhead_asgi_relay", "--upstream-port", "UPSTREAM", "--port", "PORT"),
    "lean-relay": ("gateway_lab.overhead_asgi_relay", "--upstream-port", "UPSTREAM", "--server",
                   "lean", "--port", "PORT"),
    "bare-relay": ("gateway_lab.overhead_bare_relay", "--upstream-port", "UPSTREAM", "--port", "PORT"),
}


class Harness:
    """The three processes, started in order and stopped by pid whatever happens."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.load_cpus, self.gw_cpus, self.pinning = _cpu_plan(args.no_pin)
        self.procs: list[subprocess.Popen[Any]] = []
        self.upstream_port = 0
        self.gateway_port = 0
        self.gateway: subprocess.Popen[Any] | None = None
        self.upstream: subprocess.Popen[Any] | None = None
        self.loadgen: subprocess.Popen[str] | None = None
        self.gateway_log = workdir / "gateway.log"
        self.router: subprocess.Popen[Any] | None = None
        self.router_port = 0
        self.router_error: str | None = None  # why there is no router column, when there is none
        self.floors: dict[str, tuple[subprocess.Popen[str], int]] = {}  # "bare", "asgi": (proc, port)

    def start(self) -> None:
        env = _clean_env()
        self.upstream = subprocess.Popen(
            [sys.executable, "-m", "gateway_lab.fast_upstream", "--port", "0",
             "--ttft-ms", str(self.args.ttft_ms), "--itl-ms", str(self.args.itl_ms)],
            stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env,
            preexec_fn=_preexec(self.load_cpus))
        self.procs.append(self.upstream)
        self.upstream_port = int(self._ready_line(self.upstream, "fake upstream").split()[1])

        self.gateway_port = _free_port()
        upstream_url = f"http://127.0.0.1:{self.upstream_port}"
        config = self.workdir / "gateway.yaml"
        counting = bool(getattr(self.args, "callgrind", None) or getattr(self.args, "cprofile", None))
        root = Path(getattr(self.args, "gateway_root", None) or REPO_ROOT).resolve()
        # An older checkout (--gateway-root) may predate the learned crossover.
        learns = "crossover_bounds" in (root / "gateway" / "config.py").read_text()
        config.write_text(json.dumps({  # JSON is YAML
            "listen": {"host": "127.0.0.1", "port": self.gateway_port},
            "backends": {"mtp": {"url": upstream_url}, "plain": {"url": upstream_url}},
            # Every stream stays on MTP: the relay's cost, not flips' and moves'. The learned
            # crossover stays on as shipped, bounded out of reach (its prior from the fake
            # upstream's caps put it near 44, and C=128 flipped the pair and moved streams).
            "routing": {"policy": "crossover", "crossover": NEVER_FLIP,
                        **({"crossover_bounds": [NEVER_FLIP - 1, NEVER_FLIP]} if learns else {})},
            # Counting instructions: one probe round at start, none that the wall time scales.
            "monitor": {"interval_s": 3600.0 if counting else 1.0},
            **json.loads(getattr(self.args, "gateway_config", None) or "{}"),
        }, indent=2))
        log = open(self.gateway_log, "w")  # noqa: SIM115 - closed with the process
        serve = ["serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(self.gateway_port),
                 "--log-level", "warning"]
        seat = SEATS[getattr(self.args, "gateway_process", "serve")]
        if seat is not None:  # something else in the gateway's place
            command = [sys.executable, "-m", seat[0],
                       *({"CONFIG": str(config), "UPSTREAM": str(self.upstream_port),
                          "PORT": str(self.gateway_port)}.get(a, a) for a in seat[1:])]
        elif self.args.gateway_loop == "uvloop":
            prelude = ("import asyncio, runpy, sys, uvloop; "
                       "asyncio.set_event_loop_policy(uvloop.EventLoopPolicy()); "
                       "sys.argv = ['gateway', *sys.argv[1:]]; "
                       "runpy.run_module('gateway', run_name='__main__')")
            command = [sys.executable, "-c", prelude, *serve]
        else:
            command = [sys.executable, "-m", "gateway", *serve]
        if getattr(self.args, "callgrind", None):
            command = [*callgrind_prefix(Path(self.args.callgrind)), *command]
        elif getattr(self.args, "cprofile", None):
            command = [sys.executable, "-c", overhead_callgrind.cprofile_prelude(Path(self.args.cprofile)),
                       *serve]
        self.gateway = subprocess.Popen(
            command,
            stdout=log, stderr=subprocess.STDOUT, cwd=root,
            env={**env, "PYTHONPATH": os.pathsep.join([str(root), str(REPO_ROOT / "lab")])},
            preexec_fn=_preexec(self.gw_cpus))
        self.procs.append(self.gateway)
        if seat is not None and "CONFIG" not in seat:  # a relay: no /health of its own
            self._wait_port(self.gateway_port, timeout_s=600.0 if counting else 30.0)
        else:
            self._wait_gateway(timeout_s=600.0 if counting else 30.0)
        if self.args.no_router or self.args.gateway_only or counting:
            self.router_error = "not asked for (--no-router or --gateway-only)"
        else:
            self.router_error = self._start_router(upstream_url, env)

        if not counting:
            self._start_extra_columns(config, env)

        self.loadgen = subprocess.Popen(
            [sys.executable, "-m", "gateway_lab.overhead_client"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env,
            preexec_fn=_preexec(self.load_cpus))
        self.procs.append(self.loadgen)
        self._ready_line(self.loadgen, "load generator")

    def _start_router(self, upstream_url: str, env: dict[str, str]) -> str | None:
        """sglang-router in front of the fake upstream, pinned like the gateway; None when it
        is ready, else why it is not (the run goes on without the column)."""
        try:
            import sglang_router  # noqa: F401
        except ImportError as exc:
            return f"sglang_router is not installed ({exc}): pip install -e '.[test]'"
        reason: str | None = "no attempt"
        for attempt in range(3):  # it refuses --port 0: a port free a moment ago, retried if taken
            port, metrics_port = _free_port(), _free_port()
            log_path = self.workdir / f"router-{attempt}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sglang_router.launch_router", *ROUTER_ARGS,
                     "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream_url,
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
                    stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env={**env, **ROUTER_OFFLINE},
                    preexec_fn=_preexec(self.gw_cpus))
            self.procs.append(proc)
            reason = _wait_router(port, proc, log_path)
            if reason is None:
                self.router, self.router_port = proc, port
                return None
            _stop(proc)
            if "in use" not in reason:
                break
        return reason

    def _ready_line(self, proc: subprocess.Popen[str], what: str) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"{what} did not start (exit {proc.poll()}): {line!r}")
        return line

    def _start_extra_columns(self, config: Path, env: dict[str, str]) -> None:
        """The relays without the gateway's logic, and the gateway on another HTTP front,
        each pinned like the gateway (the report's FLOORS)."""
        upstream = ["--upstream-port", str(self.upstream_port)]
        granian = getattr(self.args, "granian", False)
        lean = getattr(self.args, "lean_front", False)
        columns = [
            ("bare", ["gateway_lab.overhead_bare_relay", *upstream], self.args.bare_relay),
            ("asgi", ["gateway_lab.overhead_asgi_relay", *upstream], self.args.asgi_relay),
            ("granian", ["gateway_lab.overhead_asgi_relay", *upstream, "--server", "granian"],
             granian),
            ("gw_granian", ["gateway_lab.granian_front", "--config", str(config)], granian),
            ("lean", ["gateway_lab.overhead_asgi_relay", *upstream, "--server", "lean"], lean),
            ("gw_lean", ["gateway_lab.lean_front", "--config", str(config)], lean)]
        for name, module, wanted in columns:
            if not wanted:
                continue
            process = subprocess.Popen(
                [sys.executable, "-m", *module], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                env=env, preexec_fn=_preexec(self.gw_cpus))
            self.procs.append(process)
            port = int(self._ready_line(process, name).split()[1])
            if name.startswith("gw_"):
                self._wait_gateway(port=port, process=process)
            self.floors[name] = (process, port)

    def _wait_port(self, port: int, timeout_s: float) -> None:
        # Before the loop, not in it: the message after it reads the exit status too.
        assert self.gateway is not None  # started just before
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.gateway.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        tail = self.gateway_log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"relay not listening (exit {self.gateway.poll()})\n{tail}")

    def _wait_gateway(self, timeout_s: float = 30.0, port: int = 0,
                      process: subprocess.Popen[Any] | None = None) -> None:
        """Until /health says both backends are up with the upstream's cap known (of the
        gateway, or of the gateway at `port` run by `process`)."""
        process = process or self.gateway
        assert process is not None
        port = port or self.gateway_port
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    body = json.loads(r.read())
                backends = body.get("backends", {})
                caps = [b.get("effective_cap") for b in backends.values()]
                if body.get("status") == "ok" and caps and all(c == EFFECTIVE_CAP for c in caps):
                    return
                last = json.dumps(body)[:300]
            except (OSError, ValueError) as exc:
                last = repr(exc)
            time.sleep(0.1)
        tail = self.gateway_log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"gateway not ready (exit {process.poll()}), last: {last}\n{tail}")

    def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.loadgen is not None and self.loadgen.stdin and self.loadgen.stdout
        self.loadgen.stdin.write(json.dumps(cmd) + "\n")
        self.loadgen.stdin.flush()
        line = self.loadgen.stdout.readline()
        if not line:
            raise RuntimeError(f"load generator died (exit {self.loadgen.poll()})")
        out = json.loads(line)
        if "fatal" in out:
            raise RuntimeError(f"load generator failed: {out['fatal']}")
        return dict(out)

    def target(self, name: str) -> tuple[int, int]:
        """(port the load goes to, pid whose CPU and memory are read) of a column."""
        assert self.gateway is not None and self.upstream is not None
        if name == "gateway":
            return self.gateway_port, self.gateway.pid
        if name == "router":
            assert self.router is not None
            return self.router_port, self.router.pid
        if name in self.floors:
            floor, port = self.floors[name]
            return port, floor.pid
        return self.upstream_port, self.upstream.pid

    def gateway_stack(self) -> dict[str, bool]:
        """Which native pieces the gateway process has loaded (its event loop, its HTTP parser)."""
        assert self.gateway is not None
        try:
            maps = Path(f"/proc/{self.gateway.pid}/maps").read_text()
        except OSError:
            return {}
        return {"uvloop": "uvloop/loop." in maps, "httptools": "httptools/parser" in maps}

    def gateway_routing(self) -> dict[str, float]:
        """The gateway's own counts of where requests went (/metrics): `requests backend/reason`,
        `moved from->to`, `retries from->to`. The relay's overhead is the one of streams that
        stay where they were placed: a flip, a move or a retry in the run says otherwise."""
        out: dict[str, float] = {}
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.gateway_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError as exc:
            return {"error": 1.0, f"unreadable: {exc}": 1.0}
        names = {"gateway_requests_total": ("requests", "backend", "reason"),
                 "gateway_moved_requests_total": ("moved", "from_backend", "to_backend"),
                 "gateway_retries_total": ("retries", "from_backend", "to_backend")}
        for line in text.splitlines():
            name, _, rest = line.partition("{")
            if name not in names or "}" not in rest:
                continue
            what, first, second = names[name]
            labels = dict(part.split("=", 1) for part in rest.split("}", 1)[0].split(",") if "=" in part)
            key = f"{what} {labels.get(first, '').strip(chr(34))}/{labels.get(second, '').strip(chr(34))}"
            out[key] = out.get(key, 0.0) + float(rest.rsplit(" ", 1)[1])
        return out

    def upstream_stats(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.upstream_port}/_stats"
        with urllib.request.urlopen(url, timeout=5) as r:
            return dict(json.loads(r.read()))

    def stop(self) -> None:
        if self.loadgen is not None and self.loadgen.stdin is not None:
            with contextlib.suppress(OSError):
                self.loadgen.stdin.close()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT if proc is self.gateway else signal.SIGTERM)
        for proc in reversed(self.procs):
            _stop(proc, signalled=True)


# SGLang's router as the issue measured it; per-request logging off, as for the gateway.
ROUTER_ARGS = ("--policy", "round_robin", "--log-level", "warn")
# The router asks the worker for its model, then tries the Hugging Face hub for that model's
# tokenizer: offline, and any outside request goes to a closed loopback port and fails at once.
ROUTER_OFFLINE = {"HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost",
                  "no_proxy": "127.0.0.1,localhost",
                  **{k: "http://127.0.0.1:9" for k in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy",
                                                       "http_proxy")}}


def _wait_router(port: int, proc: subprocess.Popen[Any], log_path: Path,
                 timeout_s: float = 30.0) -> str | None:
    """None once the router has registered its worker (/readiness 200), else why not."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=2) as r:
                if r.status == 200:
                    return None
        time.sleep(0.1)
    tail = log_path.read_text(errors="replace")[-600:].strip()
    if proc.poll() is None:
        return f"sglang-router not ready in {timeout_s:g} s: {tail}"
    return f"sglang-router exited ({proc.returncode}): {tail}"


def _stop(proc: subprocess.Popen[Any], signalled: bool = False) -> None:
    """Stop one process we started (terminate unless `signalled` already), then reap it."""
    if not signalled and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=5)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


@contextlib.contextmanager
def harness(args: argparse.Namespace) -> Iterator[Harness]:
    with tempfile.TemporaryDirectory(prefix="mtp-overhead-") as tmp:
        h = Harness(args, Path(tmp))
        try:
            h.start()
            yield h
        finally:
            h.stop()


def machine_info() -> dict[str, Any]:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    git = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=5).stdout.strip() or "unknown"
    return {"cpu_model": model, "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "mem_gib": mem_gib, "python": platform.python_version(),
            "platform": platform.platform(terse=True), "git": git}


def router_info(h: Harness) -> dict[str, Any]:
    version = None
    with contextlib.suppress(Exception):
        from importlib.metadata import version as dist_version
        version = dist_version("sglang-router")
    return {"ran": h.router is not None, "version": version, "error": h.router_error,
            "args": " ".join(ROUTER_ARGS)}


def command_line() -> str:
    prog = Path(sys.argv[0]).name
    if prog == "overhead.py":
        head, rest = "python -m gateway_lab.overhead", sys.argv[1:]
    elif prog == "__main__.py":
        head, rest = "python -m gateway", sys.argv[1:]
    else:
        head, rest = "mtp-gateway" if prog == "mtp-gateway" else prog, sys.argv[1:]
    return " ".join([head, *(shlex.quote(a) for a in rest)])


def _profile(args: argparse.Namespace, h: Harness, tag: str,
             delay_s: float) -> subprocess.Popen[bytes] | None:
    if not args.profile or h.gateway is None:
        return None
    spy = shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("--profile needs py-spy on PATH (pip install py-spy)")
    out = Path(args.profile) / f"gateway-{tag}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Starts now; the window starts after the warm-up: sample the window only.
    return subprocess.Popen(
        ["sh", "-c", f"sleep {delay_s:.3f} && exec {shlex.quote(spy)} record -r 200 "
         f"-d {int(args.duration)} --format raw -o {shlex.quote(str(out))} "
         f"-p {h.gateway.pid}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _spread_s(args: argparse.Namespace, length: int) -> float:
    if args.start_spread_ms is not None:
        return float(args.start_spread_ms) / 1000
    spread_s: float = (args.ttft_ms + (length - 1) * args.itl_ms) / 1000  # argparse gave floats
    return spread_s


def measures_bodies(args: argparse.Namespace) -> bool:
    """Whether this run times the small and big bodies: not with none asked for (a target
    not measured reads n/a, not FAIL)."""
    return args.big_body_kb > 0 and args.big_body_requests > 0 and not args.gateway_only


def run_one(args: argparse.Namespace, h: Harness, target: str, c: int, length: int,
            repeat: int) -> tuple[dict[str, Any], dict[str, int]]:
    """One closed-loop window; re-run (up to --busy-retries) when other programs ran meanwhile."""
    assert h.gateway is not None and h.upstream is not None
    port, pid = h.target(target)
    tag = f"c{c}-l{length}-r{repeat}"
    for attempt in range(args.busy_retries + 1):
        before = h.upstream_stats() if target == "gateway" else None
        delay = max(args.warmup, _spread_s(args, length))
        spy = _profile(args, h, tag, delay) if target == "gateway" else None
        result = h.command({"cmd": "closed_loop", "port": port, "concurrency": c, "max_tokens": length,
                            "warmup_s": args.warmup, "duration_s": args.duration, "watch_pid": pid,
                            "upstream_pid": h.upstream.pid, "start_spread_s": _spread_s(args, length)})
        conns = {"new_connections": 0, "requests": 0}
        if before is not None:
            after = h.upstream_stats()  # minus the /_stats request itself
            conns = {"new_connections": after["connections"] - before["connections"] - 1,
                     "requests": after["requests"] - before["requests"] - 1}
        if spy is not None:
            spy.wait(timeout=30)
            raw = Path(args.profile) / f"gateway-{tag}.txt"
            if raw.exists():
                result["profile"] = report_mod.summarize_collapsed(raw, top=40)
        result.update(target=target, repeat=repeat, attempts=attempt + 1)
        foreign = result.get("foreign_cpu_util") or 0.0
        if foreign <= QUIET_CORES or attempt == args.busy_retries:
            return result, conns
        _log(f"  other programs used {foreign:.2f} cores during that window: measuring it again")
        wait_quiet(args.busy_wait)
    raise AssertionError("unreachable")


def run_matrix(args: argparse.Namespace, h: Harness) -> tuple[list[dict[str, Any]], dict[str, int]]:
    points = [(length, c) for length in _ints(args.lengths) for c in _ints(args.concurrency)]
    targets = ["gateway"] if args.gateway_only else ["direct", "gateway"]
    if h.router is not None:
        targets.append("router")
    targets += list(h.floors)
    runs: list[dict[str, Any]] = []
    conns = {"new_connections": 0, "requests": 0}
    total = args.repeats * len(points) * len(targets)
    n = 0
    for repeat in range(args.repeats):
        for index, (length, c) in enumerate(points):
            turn = (repeat + index) % len(targets)  # each column first in turn
            order = targets[turn:] + targets[:turn]
            for target in order:
                n += 1
                result, used = run_one(args, h, target, c, length, repeat)
                for key in conns:
                    conns[key] += used[key]
                runs.append(result)
                _log(f"[{n}/{total}] {target:7s} C={c:<3d} L={length:<3d} "
                     f"{result['chunks_per_s']:>9,.0f} chunks/s  TTFT p50 {result['ttft_p50_ms'] or 0:7.2f} "
                     f"p99 {result['ttft_p99_ms'] or 0:7.2f} ms  "
                     f"ITL p99 {result['itl_p99_ms'] or 0:6.2f} ms  "
                     f"CPU {result.get('watched_cpu_ms_per_1k_chunks') or 0:6.1f} ms/1k  "
                     f"core {result.get('watched_cpu_util') or 0:4.2f}  "
                     f"harness core {result.get('harness_cpu_util') or 0:4.2f}  "
                     f"others {result.get('foreign_cpu_util') or 0:4.2f}  "
                     f"errors {result['errors']}")
                time.sleep(0.3)  # let sockets in TIME_WAIT and the loops settle
    return runs, conns


def run_sequential(args: argparse.Namespace, h: Harness, body_bytes: int, requests: int) -> dict[str, Any]:
    assert h.gateway is not None
    raw = h.command({"cmd": "sequential", "targets": {"direct": h.upstream_port, "gateway": h.gateway_port},
                     "body_bytes": body_bytes, "requests": requests, "warmup": 5,
                     "watch_pid": h.gateway.pid, "upstream_pid": h.upstream.pid if h.upstream else None})
    d, g = raw["direct"], raw["gateway"]

    def sub(key: str) -> float | None:
        return None if d[key] is None or g[key] is None else round(g[key] - d[key], 3)

    raw.update(added_p50_ms=sub("e2e_p50_ms"), added_p99_ms=sub("e2e_p99_ms"),
               gateway_cpu_ms_per_request=raw.pop("watched_cpu_ms_per_request", None))
    _log(f"body {raw['body_bytes']:,} B: direct e2e p50 {d['e2e_p50_ms']} ms, gateway {g['e2e_p50_ms']} ms, "
         f"added {raw['added_p50_ms']} ms, others {raw['foreign_cpu_util']:.2f} cores, "
         f"errors {raw['errors']}")
    return raw


def run(args: argparse.Namespace) -> int:
    # A SIGTERM (timeout, CI) unwinds like an error: the harness stops what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.granian and importlib.util.find_spec("granian") is None:
        print("overhead --granian: granian is not installed (pip install granian; it is not a "
              "dependency of the gateway)", file=sys.stderr)
        return 2
    if args.callgrind or args.cprofile:
        return overhead_callgrind.run(args, harness, machine_info, command_line)
    if args.quick:
        args.concurrency, args.lengths, args.duration = "32", "16", 3.0
        args.repeats = 1
        args.busy_retries = 0  # a smoke test: figures are not the point
        args.big_body_requests = min(args.big_body_requests, 10)
        args.open_streams = min(args.open_streams, 100)
        args.open_streams_itl_ms = min(args.open_streams_itl_ms, 300.0)
        args.open_streams_tokens = min(args.open_streams_tokens, 5)
    before_load = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else machine_load(0.5)
    machine = machine_info()  # now: the code measured is the code at the gateway's start
    if before_load > QUIET_CORES:
        _log(f"warning: other programs use {before_load:.2f} cores; the figures will be skewed")
    started = time.monotonic()
    with harness(args) as h:
        _log(f"fake upstream :{h.upstream_port} (pid {h.upstream.pid if h.upstream else '?'}), "
             f"gateway :{h.gateway_port} (pid {h.gateway.pid if h.gateway else '?'}), "
             + (f"sglang-router :{h.router_port} (pid {h.router.pid})" if h.router else
                f"no sglang-router: {h.router_error}") + f"; pinning: {h.pinning}")
        runs, conns = run_matrix(args, h)
        small = big = None
        if measures_bodies(args):
            small = run_sequential(args, h, 0, args.big_body_requests)
            big = run_sequential(args, h, args.big_body_kb * 1000, args.big_body_requests)
        streams = None
        if args.open_streams > 0:
            assert h.gateway is not None
            streams = h.command({"cmd": "open_streams", "port": h.gateway_port, "streams": args.open_streams,
                                 "max_tokens": args.open_streams_tokens, "itl_ms": args.open_streams_itl_ms,
                                 "watch_pid": h.gateway.pid})
            _log(f"{streams['open_at_sample']:,}/{args.open_streams:,} streams open: gateway RSS "
                 f"{streams['rss_open_mb']} MB (idle {streams['rss_before_mb']} MB), "
                 f"errors {streams['errors']}")
        harness_info = {"pinning": h.pinning, "gateway_stack": h.gateway_stack(), "machine": machine,
                        "gateway_routing": h.gateway_routing(),
                        "load_before_cores": round(before_load, 3),
                        "router": router_info(h)}
    report = build_report(args, runs, conns, small, big, streams, harness_info, time.monotonic() - started)
    text = report_mod.markdown(report)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
        _log(f"wrote {args.markdown}")
    else:
        print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _log(f"wrote {args.json}")
    if report["errors_total"]:
        return 1
    if args.check_targets and not report["passed"]:
        return 1
    return 0


def build_report(args: argparse.Namespace, runs: list[dict[str, Any]], conns: dict[str, int],
                 small: dict[str, Any] | None, big: dict[str, Any] | None, streams: dict[str, Any] | None,
                 harness_info: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
    keys = sorted({(r["max_tokens"], r["concurrency"]) for r in runs})
    points = [report_mod.aggregate_point([r for r in runs if (r["max_tokens"], r["concurrency"]) == k])
              for k in keys]
    errors_total = sum(r["errors"] for r in runs)
    errors_total += sum(x["errors"] for x in (small, big, streams) if x is not None)
    targets = report_mod.evaluate_targets(points, big, streams, errors_total,
                                          harness_info["router"]["error"])
    measured = [t for t in targets if t.passed is not None]
    notes = [
        "Added figures are gateway minus direct at the same point and repeat (median over repeats); "
        "direct already includes the load generator sharing CPU 0 with the fake upstream.",
        f"Throughput passes at >= {report_mod.THROUGHPUT_SHARE:.0%} of direct: the loop is closed, so "
        "added latency alone lowers the request rate (most for 16-token streams).",
        "CPU-ms per 1k chunks at C=1 is dominated by fixed per-wakeup costs and 10 ms tick "
        "resolution; compare it at C >= 32.",
        "VmHWM is the gateway's peak since it started (all earlier runs included).",
    ]
    if args.profile:
        notes.append(f"py-spy sampled the gateway at 200 Hz (pausing it for each sample) during its "
                     f"windows ({args.profile}): its CPU figures include the sampling overhead.")
    foreign = max((r.get("foreign_cpu_util") or 0.0 for r in [*runs, *(x for x in (small, big) if x)]),
                  default=0.0)
    if foreign > QUIET_CORES or harness_info["load_before_cores"] > QUIET_CORES:
        notes.insert(0, f"WARNING: other programs used up to {foreign:.2f} cores during the windows "
                        f"({harness_info['load_before_cores']:.2f} before the start): the figures are "
                        "skewed; re-run on a quiet machine.")
    else:
        notes.append(f"Other programs used at most {foreign:.2f} cores during any window.")
    routing = harness_info["gateway_routing"]
    strays = {k: v for k, v in routing.items() if not k.startswith("requests mtp/") and v}
    notes.append("Where the gateway sent the requests (its /metrics, whole run): "
                 + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(routing.items()) if v) + ".")
    if strays:
        notes.insert(0, "WARNING: not every request stayed on the server it was first placed on "
                        f"({', '.join(sorted(strays))}): flips, moves or retries are in the figures.")
    if args.gateway_loop != "as-shipped":
        notes.append(f"EXPERIMENT --gateway-loop {args.gateway_loop}: the gateway did not run as shipped.")
    if args.quick:
        notes.append("--quick: C=32 x 16 tokens only, 3 s window; not a measurement of the targets.")
    return {
        "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(),
        "elapsed_s": round(elapsed_s, 1),
        "machine": harness_info["machine"],
        "router": harness_info["router"],
        "setup": {"pinning": harness_info["pinning"], "gateway_loop": args.gateway_loop,
                  "gateway_stack": harness_info["gateway_stack"],
                  "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms,
                  "warmup_s": args.warmup, "duration_s": args.duration, "repeats": args.repeats,
                  "start_spread_ms": args.start_spread_ms,
                  "load_before_cores": harness_info["load_before_cores"],
                  "concurrency": _ints(args.concurrency), "lengths": _ints(args.lengths),
                  "quick": bool(args.quick)},
        "targets": [t.as_dict() for t in targets],
        "passed": bool(measured) and all(t.passed for t in measured),
        "errors_total": errors_total,
        "points": points,
        "upstream_connections": conns,
        "gateway_routing": harness_info["gateway_routing"],
        "small_body": small,
        "big_body": big,
        "open_streams": streams,
        "runs": runs,
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway_lab.overhead")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
