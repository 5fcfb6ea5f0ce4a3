#!/usr/bin/env python
"""Two facts issue 28 could not settle by reading SGLang 0.5.23, measured on one GPU host.

1. **The file store's speed** (`store`). SGLang's L3 file backend (`HiCacheFile`,
   mem_cache/hicache_storage.py:846-927) writes one file a page and rank (numpy `tofile` to a
   temporary name, then `os.replace`) and reads one a call (`open(..., buffering=0)` +
   `readinto` into the host pool's pinned page). This does the same on a tmpfs (`/dev/shm`),
   one process a TP rank, pages of one rank of Qwen3.5-122B-A10B at TP 4 with 64 tokens a page
   (786,432 B plain, 851,968 B MTP with its packed draft layer: docs/compat.md), then copies
   the pinned pages to the GPU. Prints GB/s a rank and for the ranks together, and the seconds
   a 40,000-token prefix takes to load (625 pages a rank).

2. **A pause while a device-to-host copy of the KV is in flight** (`pause`). SGLang's
   `release_memory_occupation` pauses the "kv_cache" region (weight_updater.py:365) without
   waiting for HiCache's D->H copies (scheduler.py `is_fully_idle` does not look at them). This
   maps a KV region under torch_memory_saver, starts a 16 GiB copy of it to pinned memory on a
   side stream, pauses the region at once, then synchronizes: does the copy finish with the
   right bytes, fail, or read garbage? The control (`synced`) waits for the copy first. Each
   trial runs in its own process (a fault poisons the CUDA context), in torch_memory_saver's
   preload hook mode as SGLang runs it.

    python3 lab/scripts/hicache_turn_probe.py --json out.json

Needs torch with CUDA and torch_memory_saver (part 2 only).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
import uuid

PAGE_BYTES = {"plain": 786_432, "mtp": 851_968}  # one rank's 64-token page (docs/compat.md)
PREFIX_PAGES = 625  # a 40,000-token prefix in 64-token pages


def _rank_store(rank: int, page_bytes: int, pages: int, root: str, out: mp.Queue) -> None:
    import torch

    torch.cuda.set_device(0)
    folder = os.path.join(root, f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    src = torch.randint(0, 255, (page_bytes,), dtype=torch.uint8)
    t0 = time.perf_counter()
    for i in range(pages):  # hicache_storage.py:907-910: tofile to a tmp name, then os.replace
        tmp = os.path.join(folder, f".{uuid.uuid4().hex}.tmp")
        src.numpy().tofile(tmp)
        os.replace(tmp, os.path.join(folder, f"{i:08d}.bin"))
    write_s = time.perf_counter() - t0
    host = torch.empty((pages, page_bytes), dtype=torch.uint8, pin_memory=True)
    t0 = time.perf_counter()
    for i in range(pages):  # hicache_storage.py:855-858: one unbuffered readinto a page
        with open(os.path.join(folder, f"{i:08d}.bin"), "rb", buffering=0) as f:
            if f.readinto(memoryview(host[i].numpy())) != page_bytes:
                raise OSError("short read")
    read_s = time.perf_counter() - t0
    dev = torch.empty_like(host, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d_s = time.perf_counter() - t0
    ok = bool(torch.equal(dev[pages - 1].cpu(), src))
    out.put({"rank": rank, "write_s": write_s, "read_s": read_s, "h2d_s": h2d_s, "ok": ok})


def store(ranks: int, pages: int, root: str) -> list[dict[str, object]]:
    ctx = mp.get_context("spawn")
    rows: list[dict[str, object]] = []
    for kind, page_bytes in PAGE_BYTES.items():
        for n in sorted({1, ranks}):
            shutil.rmtree(root, ignore_errors=True)
            out: mp.Queue = ctx.Queue()
            procs = [ctx.Process(target=_rank_store, args=(r, page_bytes, pages, root, out))
                     for r in range(n)]
            t0 = time.perf_counter()
            for p in procs:
                p.start()
            per_rank = [out.get(timeout=600) for _ in procs]
            for p in procs:
                p.join()
            wall = time.perf_counter() - t0
            gb = page_bytes * pages / 1e9
            read_s = max(float(r["read_s"]) for r in per_rank)
            row = {"page": kind, "page_bytes": page_bytes, "ranks": n, "pages_a_rank": pages,
                   "write_gbps_a_rank": gb / max(float(r["write_s"]) for r in per_rank),
                   "read_gbps_a_rank": gb / read_s,
                   "h2d_gbps_a_rank": gb / max(float(r["h2d_s"]) for r in per_rank),
                   "prefix_40k_read_s": read_s * PREFIX_PAGES / pages,
                   "all_ok": all(bool(r["ok"]) for r in per_rank), "wall_s": wall}
            rows.append(row)
            print(json.dumps(row), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return rows


_PAUSE_CHILD = r"""
import json, sys, time, torch
import torch_memory_saver as m
tms = m.torch_memory_saver
gib, synced = int(sys.argv[1]), sys.argv[2] == "synced"
with tms.region(tag="kv_cache"):
    kv = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
kv.fill_(7)
kv[-1] = 9
host = torch.empty(kv.numel(), dtype=torch.uint8, pin_memory=True)
torch.cuda.synchronize()
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    host.copy_(kv, non_blocking=True)
launched = time.perf_counter()
if synced:  # the control: the copy is waited for before the pause
    side.synchronize()
tms.pause("kv_cache")
paused = time.perf_counter()
result = {"pause_s": paused - launched}
try:
    side.synchronize()
    result["copy_done_s"] = time.perf_counter() - launched
    result["error"] = None
except Exception as e:  # a fault surfaces here
    result["error"] = repr(e)[:300]
if result["error"] is None:
    result["tail_ok"] = int(host[-1]) == 9
    result["bytes_ok"] = bool((host[:-1] == 7).all())
print("RESULT " + json.dumps(result), flush=True)
"""


def pause(trials: int, gib: int) -> list[dict[str, object]]:
    import torch_memory_saver

    rows: list[dict[str, object]] = []
    for trial in range(trials):
        for mode in ("in_flight", "synced"):
            with torch_memory_saver.configure_subprocess():  # preload hook, as SGLang on CUDA
                env = dict(os.environ)
            proc = subprocess.run([sys.executable, "-c", _PAUSE_CHILD, str(gib), mode], env=env,
                                  capture_output=True, text=True, timeout=300)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            row: dict[str, object] = {"trial": trial, "mode": mode, "gib": gib,
                                      "returncode": proc.returncode}
            row.update(json.loads(line[7:]) if line else {"stderr": proc.stderr[-600:]})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--pages", type=int, default=2500, help="pages a rank (2,500: 160,000 tokens)")
    ap.add_argument("--root", default="/dev/shm/hicache-probe")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--only", choices=("store", "pause"))
    ap.add_argument("--json")
    args = ap.parse_args()
    result: dict[str, object] = {}
    if args.only in (None, "store"):
        result["store"] = store(args.ranks, args.pages, args.root)
    if args.only in (None, "pause"):
        result["pause"] = pause(args.trials, args.gib)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
