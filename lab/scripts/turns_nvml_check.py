"""On a real GPU: does the gateway's NVML check (gateway/turns/nvml.py, used by the turns driver's
check_memory step) see the memory a server pauses come back, and how soon after the pause returns?

Two processes stand in for the two servers, as in docs/turns.md ("What a turn costs"): each maps
W GB of "weights" (host copy kept, as --enable-weights-cpu-backup with TMS_RETAIN_CPU_BACKUP=1) and
K GB of "KV cache" in torch_memory_saver regions. The parent reads free_fractions() (the gateway's
own function) while A holds the memory, right after A's pause returns (polled every 5 ms until the
driver's check, min_free_fraction = 0.5 by default, would pass), after B maps the freed memory,
and after the turn back. Run: python3 lab/scripts/turns_nvml_check.py WEIGHTS_GB KV_GB
"""
import json
import multiprocessing as mp
import sys
import time


def server(name, weights_gb, kv_gb, cmds, out):
    import torch
    import torch_memory_saver as tmsmod

    tms = tmsmod.torch_memory_saver
    tms.hook_mode = "torch"
    tms.retain_cpu_backup = True
    torch.cuda.set_device(0)
    with tms.region(tag="weights", enable_cpu_backup=True):
        ws = [torch.randn(8192, 65536, device="cuda", dtype=torch.bfloat16)
              for _ in range(int(weights_gb))]
    with tms.region(tag="kv_cache"):
        kv = torch.empty(int(kv_gb * (1 << 30)), dtype=torch.uint8, device="cuda")
        kv.fill_(7)
    torch.cuda.synchronize()
    out.put((name, "ready"))
    while (cmd := cmds.get()) != "quit":
        if cmd == "pause":
            tms.pause("kv_cache")
            tms.pause("weights")
            torch.cuda.synchronize()
        else:
            tms.resume("weights")
            tms.resume("kv_cache")
            torch.cuda.synchronize()
        out.put((name, cmd + "d"))
    del ws, kv


def main():
    sys.path.insert(0, ".")
    from gateway.turns.nvml import free_fractions

    weights_gb, kv_gb = float(sys.argv[1]), float(sys.argv[2])
    minimum = 0.5  # config.py TurnsSettings.min_free_fraction's default
    ctx = mp.get_context("spawn")
    events = [{"what": "start", "free": free_fractions()}]

    def step(q, cmd, name):
        sent = time.perf_counter()
        q.put(cmd)
        got = out.get(timeout=120)
        answered = time.perf_counter()
        seen = free_fractions()
        while cmd == "pause" and not all(f >= minimum for f in seen):
            if time.perf_counter() - answered > 30:
                break
            time.sleep(0.005)
            seen = free_fractions()
        event = {"what": f"{name} {got[1]}", "call_s": round(answered - sent, 3),
                 "check_passes_after_s": round(time.perf_counter() - answered, 3),
                 "free": [round(f, 3) for f in seen],
                 "check_passes": all(f >= minimum for f in seen)}
        events.append(event)
        print(json.dumps(event), flush=True)

    qa, qb, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    a = ctx.Process(target=server, args=("A", weights_gb, kv_gb, qa, out))
    a.start()
    out.get(timeout=120)
    events.append({"what": "A holds", "free": free_fractions()})
    step(qa, "pause", "A")
    b = ctx.Process(target=server, args=("B", weights_gb, kv_gb, qb, out))
    b.start()
    out.get(timeout=120)
    events.append({"what": "B holds", "free": free_fractions()})
    for _ in range(2):
        step(qb, "pause", "B")
        step(qa, "resume", "A")
        step(qa, "pause", "A")
        step(qb, "resume", "B")
    for q in (qa, qb):
        q.put("quit")
    for p in (a, b):
        p.join(timeout=60)
    print("RESULT " + json.dumps(events))


if __name__ == "__main__":
    main()
