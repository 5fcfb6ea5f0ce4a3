#!/usr/bin/env python
"""A memory turn between two tensor-parallel groups whose NCCL communicators stay alive.

Beside turns_nvml_check.py (one process a server, one GPU), this stands in for the deployment:
two SGLang servers of TP N (N = the GPUs used), "mtp" (group A) and "plain" (group B), each an
independent torch.distributed world of N processes (its own TCP rendezvous, its own NCCL
communicator, its own gloo group for the CPU barriers SGLang's release and resume do), rank r
of both groups on GPU r. Each process, like an SGLang scheduler started with
`--enable-memory-saver --enable-weights-cpu-backup`, SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 and
TMS_RETAIN_CPU_BACKUP=1:

  - is started with torch_memory_saver's LD_PRELOAD hook (`configure_subprocess()`, hook mode
    "preload", as SGLang does on CUDA; `--hook-mode torch` for the pluggable allocator instead,
    which cannot make graph memory pausable);
  - maps --weights-gb GiB of "weights" (tag "weights", host copy kept) as L layers of
    [H, H] bf16 (H = --hidden) and --kv-gb GiB of "KV cache" (tag "kv_cache", no copy);
  - runs a decode-like step: for each layer, h = all_reduce(h @ W_l) (row-parallel, NCCL),
    RMS-normalised, written into a KV slot spread over the whole KV region and read back; the
    step is captured once into a CUDA graph (tms.cuda_graph, tag "cuda_graph", host copy kept,
    as SGLang's graph runner; `--hook-mode torch`: a plain torch.cuda.graph);
  - pauses as SGLang's release_memory_occupation does (kv_cache; gloo barrier; weights;
    cuda_graph; synchronize) and resumes as resume_memory_occupation does (cuda_graph; weights;
    gloo barrier; kv_cache).

NCCL_GRAPH_REGISTER=0 is set as SGLang 0.5.23 sets it for multi-rank graph capture
(arg_groups/parallel_hook.py:369-373, 402-428; `--nccl-graph-register 1|default` to see what
torch_memory_saver#88 warns of). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).

The parent stands in for the gateway. Start: A starts and holds; A pauses (its first pause);
B starts in the memory A gave back. Then --turns turns, alternating: the holder's N ranks pause
together (the wall time is the release call's: it answers when every rank is done); the
gateway's own NVML check (gateway/turns/nvml.py free_fractions(), every GPU >=
--min-free-fraction, polled every 5 ms up to 30 s); the other group's N ranks resume together;
its first step after the resume: the captured graph replayed once, its output compared BITWISE
(torch.equal) with the graph's output before the group's first pause; then 5 replays timed, an
eager step compared bitwise with the eager step before the first pause, and an eager
all_reduce of rank+1 checked against N(N+1)/2 (the communicator alive outside the graph).

Measured, per rank (GPU) and for the group: pause, resume (and their parts), first step after
the resume, the steady step, NVML free fraction per GPU after each pause. Prints a table, and
writes everything as JSON to --json. Exit status 0 when every check passed and nothing hung.

    python3 lab/scripts/turns_tp_probe.py --weights-gb 30 --kv-gb 90 --turns 6 --json out.json

Needs torch with CUDA and NCCL, torch_memory_saver and nvidia-ml-py (pynvml).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GROUPS = ("mtp", "plain")  # group A, group B


# ---------------------------------------------------------------------------------------------
# one rank of one group (a scheduler process of one SGLang server)
# ---------------------------------------------------------------------------------------------


def rank_main(group: str, rank: int, world: int, port: int, cfg: dict[str, Any], cmds: Any, out: Any):
    def send(kind: str, payload: Any = None) -> None:
        out.put((group, rank, kind, payload))

    try:
        _rank_loop(group, rank, world, port, cfg, cmds, send)
    except BaseException:  # report it to the parent: a crash is a finding
        send("error", traceback.format_exc())
        raise


def _rank_loop(group, rank, world, port, cfg, cmds, send):
    import datetime

    import torch
    import torch.distributed as dist
    import torch_memory_saver as tmsmod

    tms = tmsmod.torch_memory_saver
    if cfg["hook_mode"] == "torch":
        tms.hook_mode = "torch"
    tms.retain_cpu_backup = True  # also TMS_RETAIN_CPU_BACKUP=1 in the environment
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    t0 = time.perf_counter()
    dist.init_process_group(
        backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
        timeout=datetime.timedelta(seconds=cfg["nccl_timeout_s"]), device_id=dev,
    )
    cpu_group = dist.new_group(backend="gloo")  # SGLang's tp_cpu_group
    init_s = time.perf_counter() - t0

    hidden, batch = cfg["hidden"], cfg["batch"]
    layer_bytes = hidden * hidden * 2
    layers = max(1, int(cfg["weights_gb"] * (1 << 30)) // layer_bytes)
    kv_bytes = int(cfg["kv_gb"] * (1 << 30))
    slot_bytes = batch * hidden * 2
    stride = (kv_bytes // layers) // (2 << 20) * (2 << 20)  # 2 MiB aligned, spread over the KV
    if stride < slot_bytes:
        raise ValueError("KV region too small for one slot per layer")

    t0 = time.perf_counter()
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234 + 7919 * rank)
    scale = 1.0 / (hidden * world) ** 0.5
    with tms.region(tag="weights", enable_cpu_backup=True):
        ws = []
        for _ in range(layers):
            w = torch.empty(hidden, hidden, device=dev, dtype=torch.bfloat16)
            w.normal_(0.0, scale, generator=gen)
            ws.append(w)
    with tms.region(tag="kv_cache"):
        kv = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
        kv.fill_(7)
    slots = [kv[i * stride: i * stride + slot_bytes].view(torch.bfloat16).view(batch, hidden)
             for i in range(layers)]
    torch.cuda.synchronize()
    alloc_s = time.perf_counter() - t0

    # inputs outside every region, as a graph runner's static buffers: the same on every rank
    xgen = torch.Generator(device=dev)
    xgen.manual_seed(42)
    static_x = torch.randn(batch, hidden, device=dev, dtype=torch.bfloat16, generator=xgen)

    def step(x):
        h = x
        acc = torch.zeros(batch, hidden, device=dev, dtype=torch.float32)
        for w, slot in zip(ws, slots, strict=True):
            h = h @ w
            dist.all_reduce(h)
            hf = h.float()
            h = (hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
            slot.copy_(h)  # "KV write"
            acc += slot.float()  # "KV read"
        return acc

    # communicator up, eager reference
    probe = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(probe)
    ref_eager = step(static_x).clone()
    torch.cuda.synchronize()

    t0 = time.perf_counter()
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if cfg["hook_mode"] == "preload":
        ctx = tms.cuda_graph(cuda_graph=graph, tag="cuda_graph", enable_cpu_backup=True)
    else:
        ctx = torch.cuda.graph(graph)
    with ctx:
        static_out = step(static_x)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    graph.replay()
    torch.cuda.synchronize()
    ref_graph = static_out.clone()

    def replay_ms(reps: int) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    steady_ms = replay_ms(5)
    props = torch.cuda.get_device_properties(rank)
    pci = "{:04x}:{:02x}:{:02x}.0".format(
        getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", 0),
        getattr(props, "pci_device_id", 0))
    free, total = torch.cuda.mem_get_info(dev)
    send("ready", {
        "init_s": round(init_s, 3), "alloc_s": round(alloc_s, 3), "capture_s": round(capture_s, 3),
        "layers": layers, "steady_step_ms": round(steady_ms, 3), "pci": pci,
        "graph_equals_eager": bool(torch.equal(ref_graph, ref_eager)),
        "graph_allclose_eager": bool(torch.allclose(ref_graph, ref_eager, rtol=1e-2, atol=1e-2)),
        "allreduce_ok": bool(torch.all(probe == world * (world + 1) / 2).item()),
        "free_gib": round(free / (1 << 30), 2), "total_gib": round(total / (1 << 30), 2),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "torch": torch.__version__, "tms": _version("torch_memory_saver"),
    })

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    while True:
        cmd = cmds.get()
        if cmd == "quit":
            break
        if cmd == "pause":  # scheduler_components/weight_updater.py release_memory_occupation
            start = time.time()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the eager step's temporaries, outside every region
            parts = {
                "kv_s": timed(lambda: tms.pause("kv_cache")),
                "barrier_s": timed(lambda: dist.barrier(group=cpu_group)),
                "weights_s": timed(lambda: tms.pause("weights")),
                "graph_s": timed(lambda: tms.pause("cuda_graph") if cfg["hook_mode"] == "preload"
                                 else None),
                "sync_s": timed(torch.cuda.synchronize),
            }
            end = time.time()
            free, _ = torch.cuda.mem_get_info(dev)
            send("paused", {"start": start, "end": end, "total_s": round(end - start, 4),
                            **{k: round(v, 4) for k, v in parts.items()},
                            "free_gib": round(free / (1 << 30), 2)})
        elif cmd == "resume":  # resume_memory_occupation
            start = time.time()
            parts = {
                "graph_s": timed(lambda: tms.resume("cuda_graph") if cfg["hook_mode"] == "preload"
                                 else None),
                "weights_s": timed(lambda: tms.resume("weights")),
                "barrier_s": timed(lambda: dist.barrier(group=cpu_group)),
                "kv_s": timed(lambda: tms.resume("kv_cache")),
                "sync_s": timed(torch.cuda.synchronize),
            }
            end = time.time()
            send("resumed", {"start": start, "end": end, "total_s": round(end - start, 4),
                             **{k: round(v, 4) for k, v in parts.items()}})
        elif cmd == "step":  # the first step after a resume, then the checks
            start = time.time()
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t
            graph_bitwise = bool(torch.equal(static_out, ref_graph))
            max_diff = float((static_out - ref_graph).abs().max().item())
            steady = replay_ms(5)
            eager = step(static_x)
            eager_bitwise = bool(torch.equal(eager, ref_eager))
            probe = torch.full((4,), float(rank + 1), device=dev)
            dist.all_reduce(probe)
            torch.cuda.synchronize()
            send("stepped", {
                "start": start, "first_step_s": round(first_s, 4), "steady_step_ms": round(steady, 3),
                "graph_bitwise": graph_bitwise, "graph_max_abs_diff": max_diff,
                "eager_bitwise": eager_bitwise,
                "allreduce_ok": bool(torch.all(probe == world * (world + 1) / 2).item()),
            })
            del eager
        else:
            raise ValueError(cmd)
    dist.destroy_process_group()
    send("bye")


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# the parent: the gateway's side of a turn
# ---------------------------------------------------------------------------------------------


class Hung(Exception):
    pass


class Probe:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.n = args.gpus
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.cmds: dict[str, list[Any]] = {}
        self.procs: dict[str, list[Any]] = {}
        self.result: dict[str, Any] = {"setup": [], "turns": [], "ok": False, "failure": None}
        sys.path.insert(0, str(REPO))
        from gateway.turns.nvml import free_fractions

        self.free_fractions = free_fractions

    # -- talking to the ranks --

    def collect(self, group: str, kind: str, timeout: float | None = None) -> list[dict[str, Any]]:
        timeout = self.args.step_timeout_s if timeout is None else timeout
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.n:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.n)) - set(got))
                raise Hung(f"{group}: no '{kind}' from ranks {missing} within {timeout:.0f} s")
            try:
                g, rank, k, payload = self.out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p.exitcode for p in self.procs.get(group, []) if p.exitcode not in (None, 0)]
                if dead:
                    raise Hung(f"{group}: a rank exited ({dead}) while waiting for '{kind}'") from None
                continue
            if k == "error":
                raise RuntimeError(f"{g} rank {rank} failed:\n{payload}")
            if g != group or k != kind:
                raise RuntimeError(f"unexpected message {g} rank {rank} {k} while waiting for {group} {kind}")
            got[rank] = {"rank": rank, **(payload or {})}
        return [got[r] for r in range(self.n)]

    def command(self, group: str, cmd: str, answer: str) -> tuple[float, list[dict[str, Any]]]:
        sent = time.perf_counter()
        for q in self.cmds[group]:
            q.put(cmd)
        ranks = self.collect(group, answer)
        return time.perf_counter() - sent, ranks

    def start(self, group: str, port: int) -> dict[str, Any]:
        import torch_memory_saver

        cfg = {k: getattr(self.args, k) for k in
               ("weights_gb", "kv_gb", "hidden", "batch", "hook_mode", "nccl_timeout_s")}
        self.cmds[group] = [self.ctx.Queue() for _ in range(self.n)]
        self.procs[group] = []
        sent = time.perf_counter()
        # SGLang starts its schedulers inside memory_saver_adapter.configure_subprocess()
        preload = torch_memory_saver.configure_subprocess() if self.args.hook_mode == "preload" else _null()
        with preload:
            for rank in range(self.n):
                p = self.ctx.Process(target=rank_main, name=f"{group}-{rank}",
                                     args=(group, rank, self.n, port, cfg, self.cmds[group][rank], self.out))
                p.start()
                self.procs[group].append(p)
        ranks = self.collect(group, "ready", timeout=3 * self.args.step_timeout_s)
        event = {"what": f"{group} started and holds", "wall_s": round(time.perf_counter() - sent, 3),
                 "ranks": ranks, "free": self.read_free()}
        self.log(event)
        return event

    # -- the gateway's steps --

    def read_free(self) -> list[float] | None:
        seen = self.free_fractions()
        return [round(f, 4) for f in seen] if seen is not None else None

    def check_memory(self) -> dict[str, Any]:
        """turns/steps.py check_memory: every GPU at least min_free_fraction free, polled."""
        start = time.perf_counter()
        first = self.free_fractions()
        seen = first
        reads = 1
        while seen is not None and not all(f >= self.args.min_free_fraction for f in seen[: self.n]):
            if time.perf_counter() - start > 30:
                break
            time.sleep(0.005)
            seen = self.free_fractions()
            reads += 1
        return {
            "first_read": [round(f, 4) for f in first] if first else None,
            "free": [round(f, 4) for f in seen] if seen else None,
            "reads": reads,
            "passes": bool(seen) and all(f >= self.args.min_free_fraction for f in seen[: self.n]),
            "passes_after_s": round(time.perf_counter() - start, 4),
        }

    def pause(self, group: str) -> dict[str, Any]:
        wall, ranks = self.command(group, "pause", "paused")
        return {"wall_s": round(wall, 4), "ranks": ranks, **_spread(ranks)}

    def resume(self, group: str) -> dict[str, Any]:
        wall, ranks = self.command(group, "resume", "resumed")
        return {"wall_s": round(wall, 4), "ranks": ranks, **_spread(ranks)}

    def step(self, group: str) -> dict[str, Any]:
        wall, ranks = self.command(group, "step", "stepped")
        ok = all(r["graph_bitwise"] and r["eager_bitwise"] and r["allreduce_ok"] for r in ranks)
        return {"wall_s": round(wall, 4), "ranks": ranks, "checks_pass": ok,
                "first_step_max_s": max(r["first_step_s"] for r in ranks)}

    def log(self, event: dict[str, Any]) -> None:
        print(json.dumps(event), flush=True)

    # -- the run --

    def run(self) -> None:
        port_a, port_b = _free_port(), _free_port()
        self.result["setup"].append({"what": "nothing started", "free": self.read_free()})
        self.result["setup"].append(self.start("mtp", port_a))
        first = {"what": "mtp pauses (its first pause)", "pause": self.pause("mtp")}
        first["check_memory"] = self.check_memory()
        self.log(first)
        self.result["setup"].append(first)
        self.result["setup"].append(self.start("plain", port_b))
        holder = "plain"
        for turn in range(1, self.args.turns + 1):
            incoming = "mtp" if holder == "plain" else "plain"
            t0 = time.perf_counter()
            p = self.pause(holder)
            c = self.check_memory()
            if not c["passes"]:
                self.result["turns"].append({"turn": turn, "from": holder, "to": incoming,
                                             "pause": p, "check_memory": c})
                raise RuntimeError(f"turn {turn}: NVML check did not pass after {holder}'s pause: {c}")
            r = self.resume(incoming)
            s = self.step(incoming)
            turn_s = p["wall_s"] + c["passes_after_s"] + r["wall_s"] + s["first_step_max_s"]
            event = {"turn": turn, "from": holder, "to": incoming, "pause": p, "check_memory": c,
                     "resume": r, "step": s, "turn_s": round(turn_s, 4),
                     "turn_wall_with_checks_s": round(time.perf_counter() - t0, 4),
                     "holds": self.read_free()}
            self.log(event)
            self.result["turns"].append(event)
            if not s["checks_pass"]:
                raise RuntimeError(f"turn {turn}: {incoming}'s step after resume failed a check")
            holder = incoming
        self.result["ok"] = True

    def stop(self) -> None:
        for qs in self.cmds.values():
            for q in qs:
                q.put("quit")
        deadline = time.monotonic() + 60
        for procs in self.procs.values():
            for p in procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _spread(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Did the N ranks release (resume) together? Wall-clock start/end spread across ranks."""
    return {
        "rank_total_s": [r["total_s"] for r in ranks],
        "start_spread_s": round(max(r["start"] for r in ranks) - min(r["start"] for r in ranks), 4),
        "end_spread_s": round(max(r["end"] for r in ranks) - min(r["end"] for r in ranks), 4),
    }


def _cudart_on_loader_path() -> None:
    """The preload hook needs libcudart.so.<major> when the loader preloads it, before torch has
    loaded its own: put the directory of the libcudart that torch's wheels carry first on
    LD_LIBRARY_PATH of the ranks, so the hook and torch share one (the system's otherwise)."""
    try:
        import nvidia  # type: ignore[import-not-found]
        import torch
    except ImportError:
        return
    major = (torch.version.cuda or "").split(".")[0]
    if not major:
        return
    for root in getattr(nvidia, "__path__", []):
        for lib in sorted(Path(root).glob(f"**/libcudart.so.{major}")):
            old = os.environ.get("LD_LIBRARY_PATH", "")
            os.environ["LD_LIBRARY_PATH"] = f"{lib.parent}:{old}" if old else str(lib.parent)
            return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fmt(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


def table(result: dict[str, Any]) -> str:
    cols = ["turn", "from>to", "rank", "pause_s", "kv", "barrier", "weights", "graph", "free_after",
            "resume_s", "weights_r", "first_step_s", "steady_ms", "bitwise", "eager", "allreduce"]
    rows = [cols]
    setup = result["setup"]
    for ev in setup:
        if "pause" in ev:
            free = (ev["check_memory"]["first_read"] or [])
            for r in ev["pause"]["ranks"]:
                rows.append(["0", "mtp>(start)", r["rank"], r["total_s"], r["kv_s"], r["barrier_s"],
                             r["weights_s"], r["graph_s"], free[r["rank"]] if r["rank"] < len(free) else "-",
                             "-", "-", "-", "-", "-", "-", "-"])
    for t in result["turns"]:
        if "resume" not in t:
            continue
        free = t["check_memory"]["first_read"] or []
        for rp, rr, rs in zip(t["pause"]["ranks"], t["resume"]["ranks"], t["step"]["ranks"], strict=True):
            i = rp["rank"]
            rows.append([t["turn"], f"{t['from']}>{t['to']}", i, rp["total_s"], rp["kv_s"], rp["barrier_s"],
                         rp["weights_s"], rp["graph_s"], free[i] if i < len(free) else "-",
                         rr["total_s"], rr["weights_s"], rs["first_step_s"], rs["steady_step_ms"],
                         rs["graph_bitwise"], rs["eager_bitwise"], rs["allreduce_ok"]])
        rows.append([t["turn"], "total", "all", t["pause"]["wall_s"], "", "", "", "",
                     f"pass {t['check_memory']['passes_after_s']:.3f}s", t["resume"]["wall_s"], "",
                     t["step"]["wall_s"], "", "", "", f"turn {t['turn_s']:.3f}s"])
    text = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=None, help="N, ranks per group (default: all GPUs)")
    ap.add_argument("--weights-gb", type=float, default=30.0, help="weights per GPU, GiB (host copy kept)")
    ap.add_argument("--kv-gb", type=float, default=90.0, help="KV cache per GPU, GiB")
    ap.add_argument("--turns", type=int, default=6, help="hand-overs after the start (alternating)")
    ap.add_argument("--hidden", type=int, default=8192, help="H: a layer is [H, H] bf16 per rank")
    ap.add_argument("--batch", type=int, default=8, help="decode batch: the all-reduce is [batch, H] bf16")
    ap.add_argument("--hook-mode", choices=("preload", "torch"), default="preload")
    ap.add_argument("--nccl-graph-register", choices=("0", "1", "default"), default="0",
                    help="NCCL_GRAPH_REGISTER for the ranks (SGLang 0.5.23 sets 0)")
    ap.add_argument("--min-free-fraction", type=float, default=0.5, help="TurnsSettings.min_free_fraction")
    ap.add_argument("--nccl-timeout-s", type=float, default=300.0)
    ap.add_argument("--step-timeout-s", type=float, default=300.0,
                    help="wait for a group's N answers (start: 3x) before it counts as hung")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args()

    # before anything imports CUDA; the ranks inherit it
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    os.environ["TMS_RETAIN_CPU_BACKUP"] = "1"
    os.environ["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"  # informational: nothing here reads it
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA index = NVML index
    if args.nccl_graph_register == "default":
        os.environ.pop("NCCL_GRAPH_REGISTER", None)
    else:
        os.environ["NCCL_GRAPH_REGISTER"] = args.nccl_graph_register
    if args.hook_mode == "preload":
        _cudart_on_loader_path()
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        print("torch_memory_saver refuses expandable_segments", file=sys.stderr)
        return 2
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()  # without a CUDA context here: NVML-based count
    if args.gpus < 1:
        print("no GPU", file=sys.stderr)
        return 2

    probe = Probe(args)
    probe.result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    probe.result["env"] = {k: os.environ.get(k) for k in (
        "NCCL_GRAPH_REGISTER", "NCCL_NVLS_ENABLE", "TMS_RETAIN_CPU_BACKUP", "CUDA_DEVICE_ORDER",
        "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH")}
    probe.result["argv"] = sys.argv
    started = time.perf_counter()
    try:
        probe.run()
    except (Hung, RuntimeError) as e:
        probe.result["failure"] = f"{type(e).__name__}: {e}"
        print("FAILED " + probe.result["failure"], file=sys.stderr, flush=True)
    finally:
        probe.stop()
    probe.result["wall_s"] = round(time.perf_counter() - started, 2)
    print(table(probe.result))
    print(summary(probe.result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(probe.result, indent=1) + "\n")
    return 0 if probe.result["ok"] else 1


def summary(result: dict[str, Any]) -> str:
    turns = [t for t in result["turns"] if "step" in t]
    if not turns:
        return f"no completed turn; failure: {result['failure']}"

    def rng(xs: list[Any]) -> str:
        if all(isinstance(x, int) for x in xs):
            return f"{min(xs)}-{max(xs)}"
        return f"{min(xs):.3f}-{max(xs):.3f}"

    later = [t for t in turns if t["turn"] > 1]  # turn 1 is plain's first pause (host buffer allocated)
    lines = [
        f"{len(turns)} turns, N={result['config']['gpus']} ranks a group, ok={result['ok']}",
        f"pause wall (release answered by every rank): turn 1 {turns[0]['pause']['wall_s']:.3f} s, "
        f"later {rng([t['pause']['wall_s'] for t in later]) if later else '-'} s",
        f"NVML check passes after {rng([t['check_memory']['passes_after_s'] for t in turns])} s "
        f"({rng([t['check_memory']['reads'] for t in turns])} reads)",
        f"resume wall {rng([t['resume']['wall_s'] for t in turns])} s; "
        f"first step after resume (max over ranks) {rng([t['step']['first_step_max_s'] for t in turns])} s",
        f"whole turn (pause + check + resume + first step) {rng([t['turn_s'] for t in later or turns])} s",
        f"rank spread: pause ends {rng([t['pause']['end_spread_s'] for t in turns])} s, resume ends "
        f"{rng([t['resume']['end_spread_s'] for t in turns])} s",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
