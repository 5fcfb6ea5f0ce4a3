"""The overhead benchmark's report: aggregation over repeats, the issue's targets with
pass/fail, the Markdown tables, and a summary of a py-spy profile (collapsed stacks)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The checkout this harness runs from: profiled frames of its files are shown relative to it.
_CHECKOUT = str(Path(__file__).resolve().parents[2]) + "/"

# Throughput "as many chunks/s as the load generator offers direct": within this share of direct
# (issue 21). A closed loop converts added latency into lower throughput: a 16-token stream lasts
# ~170 ms, so +1.7 ms of TTFT alone costs 1 %.
THROUGHPUT_SHARE = 0.99
# Added TTFT p50 limits at C=128 by max_tokens (issue 21: < 2 ms for 128-token streams).
C128_TTFT_LIMIT_MS = {16: 5.0, 128: 2.0}
DIRECT_FLOOR = 10_000  # the issue: "at least 10,000 here"


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# The relays without the gateway's logic, and the gateway on another front: (column, row, title).
FLOORS = (("bare", "bare relay", "bare Python relay"),
          ("asgi", "uvicorn relay", "uvicorn + ASGI relay"),
          ("granian", "granian relay", "granian + ASGI relay"),
          ("gw_granian", "gateway on granian", "gateway on granian"),
          ("lean", "lean-front relay", "lean front + ASGI relay"),
          ("gw_lean", "gateway on the lean front", "gateway on the lean front"))
KEYS = ("chunks_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
        "watched_cpu_ms_per_1k_chunks", "watched_cpu_util", "watched_rss_mb", "watched_hwm_mb")


def _added(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float | None]:
    """Medians over the repeats of (proxy - direct), each repeat against its own direct run."""
    return {
        "ttft_p50_ms": median([_sub(g["ttft_p50_ms"], d["ttft_p50_ms"]) for d, g in pairs]),
        "ttft_p99_ms": median([_sub(g["ttft_p99_ms"], d["ttft_p99_ms"]) for d, g in pairs]),
        "itl_p99_ms": median([_sub(g["itl_p99_ms"], d["itl_p99_ms"]) for d, g in pairs]),
        "chunks_share": median([g["chunks_per_s"] / d["chunks_per_s"] if d["chunks_per_s"] else None
                                for d, g in pairs]),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def aggregate_point(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one (max_tokens, C) point; added = median of per-repeat deltas.

    With router runs: `router` (its medians), `router_added` (router - direct) and
    `vs_router` (gateway / router: CPU per chunk, chunks/s; added TTFT side by side)."""
    by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_repeat.setdefault(run["repeat"], {})[run["target"]] = run

    def side(target: str) -> list[dict[str, Any]]:
        return [r[target] for r in by_repeat.values() if target in r]

    def pairs(target: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [(r["direct"], r[target]) for r in by_repeat.values() if "direct" in r and target in r]

    direct, gateway = side("direct"), side("gateway")
    out: dict[str, Any] = {
        "max_tokens": runs[0]["max_tokens"], "concurrency": runs[0]["concurrency"],
        "repeats": len(by_repeat),
        "direct": {k: median([r.get(k) for r in direct]) for k in KEYS},
        "gateway": {k: median([r.get(k) for r in gateway]) for k in KEYS},
        "added": _added(pairs("gateway")),
        "errors": {"direct": sum(r["errors"] for r in direct), "gateway": sum(r["errors"] for r in gateway)},
        "spread": {  # max - min over repeats: the noise the medians hide
            "gateway_chunks_per_s": _spread([r["chunks_per_s"] for r in gateway]),
            "added_ttft_p50_ms": _spread([_sub(g["ttft_p50_ms"], d["ttft_p50_ms"])
                                          for d, g in pairs("gateway")]),
        },
    }
    for name, _, _ in FLOORS:  # the relays without the gateway's logic (--bare-relay, --asgi-relay)
        floor = side(name)
        if floor:
            out[name] = {k: median([r.get(k) for r in floor]) for k in KEYS}
            out[f"{name}_added"] = _added(pairs(name))
            out["errors"][name] = sum(r["errors"] for r in floor)
    router = side("router")
    if router:
        out["router"] = {k: median([r.get(k) for r in router]) for k in KEYS}
        out["router_added"] = _added(pairs("router"))
        out["errors"]["router"] = sum(r["errors"] for r in router)
        both = [(r["router"], r["gateway"]) for r in by_repeat.values() if "router" in r and "gateway" in r]
        out["vs_router"] = {  # gateway / router, median over the repeats that ran both
            "cpu_per_chunk": median([_ratio(g.get("watched_cpu_ms_per_1k_chunks"),
                                            rt.get("watched_cpu_ms_per_1k_chunks")) for rt, g in both]),
            "chunks_per_s": median([_ratio(g["chunks_per_s"], rt["chunks_per_s"]) for rt, g in both]),
        }
    return out


def _spread(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return (max(present) - min(present)) if len(present) > 1 else None


@dataclass
class Target:
    key: str
    what: str
    limit: str
    figure: str
    direct: str
    passed: bool | None  # None: not measured in this run

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "what": self.what, "limit": self.limit, "figure": self.figure,
                "direct": self.direct, "passed": self.passed}


def _f(value: float | None, digits: int = 1, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+,.{digits}f}" if sign else f"{value:,.{digits}f}"


def evaluate_targets(points: list[dict[str, Any]], big_body: dict[str, Any] | None,
                     open_streams: dict[str, Any] | None, errors_total: int,
                     router_error: str | None = None) -> list[Target]:
    at = {(p["max_tokens"], p["concurrency"]): p for p in points}
    targets: list[Target] = []
    for length in (16, 128):
        p = at.get((length, 128))
        if p is None:
            targets.append(Target(f"c128_l{length}_throughput", f"C=128 x {length} tok: chunks/s",
                                  f">= {THROUGHPUT_SHARE:.0%} of direct, 0 errors", "not measured", "-",
                                  None))
            targets.append(Target(f"c128_l{length}_ttft_p50", f"C=128 x {length} tok: added TTFT p50",
                                  f"< {C128_TTFT_LIMIT_MS[length]:g} ms", "not measured", "-", None))
            continue
        direct, gw = p["direct"]["chunks_per_s"], p["gateway"]["chunks_per_s"]
        share = p["added"]["chunks_share"]
        floor_note = "" if (direct or 0) >= DIRECT_FLOOR else f" (direct below {DIRECT_FLOOR:,}: harness)"
        targets.append(Target(
            f"c128_l{length}_throughput", f"C=128 x {length} tok: chunks/s",
            f">= {THROUGHPUT_SHARE:.0%} of direct, 0 errors",
            f"{_f(gw, 0)} ({_f(None if share is None else share * 100, 1)} % of direct), "
            f"{p['errors']['gateway']} errors", f"{_f(direct, 0)}{floor_note}",
            share is not None and share >= THROUGHPUT_SHARE and p["errors"]["gateway"] == 0))
        added = p["added"]["ttft_p50_ms"]
        limit = C128_TTFT_LIMIT_MS[length]
        targets.append(Target(f"c128_l{length}_ttft_p50", f"C=128 x {length} tok: added TTFT p50",
                              f"< {limit:g} ms", f"{_f(added, 2, True)} ms",
                              f"{_f(p['direct']['ttft_p50_ms'], 2)} ms", added is not None and added < limit))
    for length in (16, 128):
        p = at.get((length, 1))
        for q, limit in (("p50", 1.0), ("p99", 2.0)):
            key = f"c1_l{length}_ttft_{q}"
            what = f"C=1 x {length} tok: added TTFT {q}"
            if p is None:
                targets.append(Target(key, what, f"< {limit:g} ms", "not measured", "-", None))
                continue
            added = p["added"][f"ttft_{q}_ms"]
            targets.append(Target(key, what, f"< {limit:g} ms", f"{_f(added, 2, True)} ms",
                                  f"{_f(p['direct'][f'ttft_{q}_ms'], 2)} ms",
                                  added is not None and added < limit))
    for length, limit in ((128, 30.0), (16, 60.0)):
        p = at.get((length, 128))
        key, what = f"c128_l{length}_cpu", f"C=128 x {length} tok: gateway CPU per 1,000 chunks"
        if p is None:
            targets.append(Target(key, what, f"< {limit:g} ms", "not measured", "-", None))
            continue
        cpu = p["gateway"]["watched_cpu_ms_per_1k_chunks"]
        targets.append(Target(key, what, f"< {limit:g} ms",
                              f"{_f(cpu, 1)} ms (core {_f((p['gateway']['watched_cpu_util'] or 0) * 100, 0)} "
                              "% busy)", "-", cpu is not None and cpu < limit))
    targets += _router_targets(at, router_error)
    if big_body is None:
        targets.append(Target("big_body", "400 KB chat body: added gateway time p50", "< 2 ms",
                              "not measured", "-", None))
    else:
        added = big_body["added_p50_ms"]
        targets.append(Target("big_body", f"{big_body['body_bytes'] / 1000:,.0f} KB chat body: "
                              "added gateway time p50", "< 2 ms", f"{_f(added, 2, True)} ms",
                              f"{_f(big_body['direct']['e2e_p50_ms'], 2)} ms e2e",
                              added is not None and added < 2 and big_body["errors"] == 0))
    if open_streams is None:
        targets.append(Target("open_streams_rss", "RSS with 1,000 open streams", "< 150 MB",
                              "not measured", "-", None))
    else:
        rss = open_streams["rss_open_mb"]
        all_open = open_streams["open_at_sample"] >= open_streams["streams"]
        targets.append(Target(
            "open_streams_rss", f"RSS with {open_streams['streams']:,} open streams", "< 150 MB",
            f"{_f(rss, 1)} MB ({open_streams['open_at_sample']:,} open; "
            f"idle {_f(open_streams['rss_before_mb'])} MB)",
            "-", rss is not None and rss < 150 and all_open and open_streams["errors"] == 0))
    targets.append(Target("errors", "errors, all runs", "0", str(errors_total), "-", errors_total == 0))
    return targets


def _router_targets(at: dict[tuple[int, int], dict[str, Any]], router_error: str | None) -> list[Target]:
    """Issue 21: at C = 32 and 128, both lengths, the gateway's CPU per chunk <= the router's."""
    targets = []
    for c in (32, 128):
        for length in (16, 128):
            key = f"c{c}_l{length}_cpu_vs_router"
            what = f"C={c} x {length} tok: gateway CPU per 1,000 chunks vs sglang-router's"
            p = at.get((length, c))
            if p is None or "router" not in p:
                why = "not measured" if p is None else f"no router column ({router_error or 'not run'})"
                targets.append(Target(key, what, "<= router", why, "-", None))
                continue
            gw = p["gateway"]["watched_cpu_ms_per_1k_chunks"]
            rt = p["router"]["watched_cpu_ms_per_1k_chunks"]
            ratio = p["vs_router"]["cpu_per_chunk"]
            targets.append(Target(key, what, "<= router",
                                  f"{_f(gw)} / {_f(rt)} ms ({_f(ratio, 2)}x)", "-",
                                  None if ratio is None else ratio <= 1.0))
    return targets


def _router_setup(router: dict[str, Any] | None) -> str:
    if not router:
        return "- sglang-router: not run."
    if not router.get("ran"):
        return f"- sglang-router: no column in this run: {router.get('error')}."
    return (f"- sglang-router {router.get('version')} (`python -m sglang_router.launch_router "
            f"{router.get('args')}`, one worker: the fake upstream), pinned like the gateway, to the "
            "same core; the two take turns, each idle while the other is measured.")


def _router_table(report: dict[str, Any]) -> list[str]:
    """Gateway / router, point by point: what issue 21 compares."""
    pts = sorted((p for p in report["points"] if "router" in p),
                 key=lambda p: (p["max_tokens"], p["concurrency"]))
    if not pts:
        return []
    floors = [(name, title) for name, _, title in FLOORS if any(name in p for p in pts)]
    lines = ["## Gateway / sglang-router (same run, same load)", "",
             "| C x max_tokens | CPU-ms per 1k chunks: gateway / router "
             + "".join(f"| {title} CPU-ms per 1k chunks / router " for _, title in floors)
             + "| added TTFT p50 ms: gateway / router | added TTFT p99 ms: gateway / router "
             "| chunks/s: gateway / router |",
             "|---|---:|" + "---:|" * len(floors) + "---:|---:|---:|"]
    for p in pts:
        g, r, ga, ra, v = p["gateway"], p["router"], p["added"], p["router_added"], p["vs_router"]
        floor = ""
        for name, _ in floors:
            b = (p.get(name) or {}).get("watched_cpu_ms_per_1k_chunks")
            rc = r["watched_cpu_ms_per_1k_chunks"]
            floor += f"{_f(b)} ({_f(b / rc if b and rc else None, 2)}x) | "
        lines.append(
            f"| {p['concurrency']} x {p['max_tokens']} | {_f(g['watched_cpu_ms_per_1k_chunks'])} / "
            f"{_f(r['watched_cpu_ms_per_1k_chunks'])} ({_f(v['cpu_per_chunk'], 2)}x) | {floor}"
            f"{_f(ga['ttft_p50_ms'], 2, True)} / {_f(ra['ttft_p50_ms'], 2, True)} | "
            f"{_f(ga['ttft_p99_ms'], 2, True)} / {_f(ra['ttft_p99_ms'], 2, True)} | "
            f"{_f(g['chunks_per_s'], 0)} / {_f(r['chunks_per_s'], 0)} ({_f(v['chunks_per_s'], 3)}x) |")
    return lines + ["", "The router's added TTFT is mostly Nagle plus the client's delayed ACK on a "
                    "kept-alive connection: 0.3.2 sets no TCP_NODELAY on client sockets, so its first "
                    "chunk waits about 20 ms; a client that acks at once (TCP_QUICKACK) sees under 1 ms. "
                    "Compare CPU and chunks/s with the router, latency with direct.", ""]


def _mark(passed: bool | None) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "FAIL")


def _stack(setup: dict[str, Any]) -> str:
    stack = setup.get("gateway_stack") or {}
    if not stack:
        return "event loop unknown"
    loop = "uvloop" if stack.get("uvloop") else "asyncio's default loop (uvloop not loaded)"
    parser = "httptools" if stack.get("httptools") else "h11"
    forced = ""
    if setup.get("gateway_loop") == "uvloop":
        forced = " (forced by --gateway-loop uvloop: an experiment)"
    return f"event loop in the gateway process: {loop}{forced}, HTTP parser {parser}"


def markdown(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["setup"]
    lines = [
        "# Gateway overhead: the same load direct, through the gateway and through sglang-router",
        "",
        f"Generated {report['generated']} by:",
        "",
        "```sh",
        report["command"],
        "```",
        "",
        f"- Machine: {m['cpu_model']}, {m['cores']} cores ({m['affinity']} usable), "
        f"{m['mem_gib']} GiB, Python {m['python']}, {m['platform']}; code at {m['git']}.",
        f"- Pinning: {s['pinning']}.",
        f"- Fake upstream (`lab/gateway_lab/fast_upstream.py`): TTFT {s['ttft_ms']:g} ms, one chunk every "
        f"{s['itl_ms']:g} ms, exactly max_tokens content chunks, SGLang 0.5.23 chunk shape, chunked "
        "HTTP/1.1, each event its own write.",
        f"- Load (`lab/gateway_lab/overhead_client.py`): closed loop, C workers on kept-alive raw HTTP/1.1 "
        f"connections; {s['warmup_s']:g} s warm-up, {s['duration_s']:g} s window; direct and gateway "
        f"interleaved, order rotated; {s['repeats']} repeat(s), medians shown.",
        "- Gateway: `python -m gateway serve` with backends mtp and plain both on the fake upstream, "
        "routing crossover and the learned crossover's bounds at 100000 (every stream stays on "
        "mtp), monitor every 1 s, uvicorn's access log off, the gateway's "
        f"own line per request on (log.access, the default); {_stack(s)}.",
        _router_setup(report.get("router")),
        "- CPU = utime+stime of the gateway pid (/proc/<pid>/stat) over the window, per 1,000 content "
        "chunks received; RSS = VmRSS at the end of the window (VmHWM: the process's peak so far).",
        "",
        "## Targets",
        "",
        "| target | limit | gateway | direct | result |",
        "|---|---|---|---|---|",
    ]
    for t in report["targets"]:
        lines.append(f"| {t['what']} | {t['limit']} | {t['figure']} | {t['direct']} "
                     f"| **{_mark(t['passed'])}** |")
    lines.append("")
    verdict = "all measured targets pass" if report["passed"] else "some targets fail"
    lines += [f"Verdict: {verdict}.", ""]
    lines += ["## Streaming (deltas vs direct at the same C and length)", ""]
    lengths = sorted({p["max_tokens"] for p in report["points"]}, reverse=True)
    for length in lengths:
        pts = sorted((p for p in report["points"] if p["max_tokens"] == length),
                     key=lambda p: p["concurrency"])
        concs = " / ".join(str(p["concurrency"]) for p in pts)
        direct_ttft = ", ".join(f"{_f(p['direct']['ttft_p50_ms'])}/{_f(p['direct']['ttft_p99_ms'])}"
                                for p in pts)
        direct_itl = ", ".join(_f(p["direct"]["itl_p99_ms"]) for p in pts)
        lines += [
            f"max_tokens = {length} (direct: TTFT p50/p99 {direct_ttft} ms; ITL p99 {direct_itl} ms "
            f"at C = {concs})",
            "",
            "| system | C | +TTFT p50 ms | +TTFT p99 ms | +ITL p99 ms | chunks/s | % of direct "
            "| CPU-ms / 1k chunks | core busy | RSS MB (HWM) | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| direct | {concs} | - | - | - | "
            + " / ".join(_f(p["direct"]["chunks_per_s"], 0) for p in pts)
            + " | - | - | - | - | " + " / ".join(str(p["errors"]["direct"]) for p in pts) + " |",
        ]
        for name, side, added in (("gateway", "gateway", "added"), ("router", "router", "router_added"),
                                  *((row, floor, f"{floor}_added") for floor, row, _ in FLOORS)):
            for p in pts:
                if side not in p:
                    continue
                g, a = p[side], p[added]
                share = None if a["chunks_share"] is None else a["chunks_share"] * 100
                util = None if g["watched_cpu_util"] is None else g["watched_cpu_util"] * 100
                lines.append(
                    f"| {name} | {p['concurrency']} | {_f(a['ttft_p50_ms'], 2, True)} | "
                    f"{_f(a['ttft_p99_ms'], 2, True)} | {_f(a['itl_p99_ms'], 2, True)} | "
                    f"{_f(g['chunks_per_s'], 0)} | {_f(share, 1)} % | "
                    f"{_f(g['watched_cpu_ms_per_1k_chunks'])} | {_f(util, 0)} % | "
                    f"{_f(g['watched_rss_mb'])} ({_f(g['watched_hwm_mb'])}) | "
                    f"{p['errors'][side]} |")
        lines.append("")
    lines += _router_table(report)
    conns = report.get("upstream_connections")
    if conns:
        lines += [f"Upstream connections the gateway opened during its streaming runs: "
                  f"{conns['new_connections']:,} for {conns['requests']:,} requests "
                  f"(fake upstream's own count).", ""]
    body, small = report.get("big_body"), report.get("small_body")
    if body or small:
        lines += ["## Non-streamed requests, one at a time (gateway e2e minus direct e2e)", "",
                  "| request body | requests | direct e2e p50 ms | gateway e2e p50 ms | added p50 ms "
                  "| added p99 ms | gw CPU-ms / request | errors |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, b in (("small", small), ("large agent context", body)):
            if b:
                lines.append(
                    f"| {name}, {b['body_bytes']:,} B | {b['requests']} | "
                    f"{_f(b['direct']['e2e_p50_ms'], 2)} | "
                    f"{_f(b['gateway']['e2e_p50_ms'], 2)} | {_f(b['added_p50_ms'], 2, True)} | "
                    f"{_f(b['added_p99_ms'], 2, True)} | {_f(b.get('gateway_cpu_ms_per_request'), 2)} | "
                    f"{b['errors']} |")
        lines.append("")
    o = report.get("open_streams")
    if o:
        lines += ["## Open streams", "",
                  f"{o['streams']:,} concurrent streams through the gateway (one chunk every "
                  f"{o['itl_ms']:g} ms, {o['max_tokens']} chunks each); all open {o['all_open_after_s']} s "
                  f"after the first connect; {o['open_at_sample']:,} open while sampling.", "",
                  "| gateway RSS idle MB | RSS with the streams open MB | VmHWM MB | RSS after MB | errors |",
                  "|---:|---:|---:|---:|---:|",
                  f"| {_f(o['rss_before_mb'])} | {_f(o['rss_open_mb'])} | {_f(o['hwm_mb'])} | "
                  f"{_f(o['rss_after_mb'])} | {o['errors']} |", ""]
    profiles = [(r, r["profile"]) for r in report["runs"] if r.get("profile")]
    if profiles:
        lines += ["## Profiles (py-spy, 200 Hz, over the gateway's window)", ""]
        for run, summary in profiles:
            lines += profile_markdown(f"gateway, C={run['concurrency']} x {run['max_tokens']} tokens, "
                                      f"repeat {run['repeat']}", summary)
    if report.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- profiles


def summarize_collapsed(path: str | Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares from py-spy's raw (collapsed) output.

    A line is `frame;frame;...;leaf count`; a frame is `function (file:line)`. Inclusive counts
    are per function+file (line dropped), counted once per stack."""
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_frame_key(f) for f in stack.split(";") if f]
        if not frames:
            continue
        self_counts[frames[-1]] += count
        packages[_package(frames[-1])] += count
        for key in set(frames):
            incl_counts[key] += count

    def rows(counter: Counter[str]) -> list[dict[str, Any]]:
        return [{"frame": k, "samples": v, "share": round(v / total, 4)} for k, v in counter.most_common(top)]

    return {"samples": total, "self": rows(self_counts), "inclusive": rows(incl_counts),
            "self_by_package": rows(packages)}


def _package(key: str) -> str:
    """The top-level package of a frame key: `write (asyncio/selector_events.py)` -> `asyncio`."""
    _, _, where = key.partition(" (")
    where = where.rstrip(")")
    if where.startswith("<"):
        return where
    return where.split("/", 1)[0].removesuffix(".py") if where else "?"


def profile_markdown(tag: str, summary: dict[str, Any], top: int = 15) -> list[str]:
    lines = [f"### {tag}: {summary['samples']:,} samples (gateway busy time only)", "",
             "Self time by package: " + ", ".join(
                 f"{r['frame']} {r['share'] * 100:.1f} %" for r in summary["self_by_package"][:10]), "",
             "| self % | frame | | inclusive % | frame |", "|---:|---|---|---:|---|"]
    inclusive = [r for r in summary["inclusive"] if not r["frame"].startswith(
        ("_run_module_as_main", "_run_code", "<module>", "main (", "run (", "Runner.run",
         "BaseEventLoop.run_until_complete", "BaseEventLoop.run_forever"))]
    for i in range(top):
        a = summary["self"][i] if i < len(summary["self"]) else None
        b = inclusive[i] if i < len(inclusive) else None
        lines.append(f"| {a['share'] * 100:.1f} | `{a['frame']}` | " if a else "| | | ")
        lines[-1] += f"| {b['share'] * 100:.1f} | `{b['frame']}` |" if b else "| | |"
    return lines + [""]


def _frame_key(frame: str) -> str:
    """`send (uvicorn/protocols/http/httptools_impl.py:123)` -> `send (…/httptools_impl.py)`."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    file = where.rsplit(":", 1)[0] if ":" in where else where
    for marker in ("site-packages/", "lib/python3.11/", _CHECKOUT):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{name} ({file})" if file else name
