"""The overhead benchmark's CI guard: `--quick` (C=32, 16 tokens, a 3 s window, small extras)
runs end to end against a real gateway process and reports every field, with zero errors, and
sglang-router's column beside it (skipped, saying why, when the router cannot start here).

No timing assertions: the figures depend on the machine; lab/results/perf/overhead.json keeps the
measured ones with the machine and command they came from."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_lab.overhead import add_arguments, measures_bodies

REPO = Path(__file__).resolve().parents[2]

STREAM_FIELDS = ("chunks_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                 "itl_p99_ms", "errors", "error_kinds", "ttft_samples", "itl_samples", "harness_cpu_util",
                 "foreign_cpu_util")
GATEWAY_FIELDS = ("watched_cpu_s", "watched_cpu_util", "watched_cpu_ms_per_1k_chunks", "watched_rss_mb",
                  "watched_hwm_mb")
POINT_FIELDS = ("chunks_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "watched_cpu_ms_per_1k_chunks",
                "watched_rss_mb", "watched_hwm_mb")
TARGET_KEYS = {"c128_l16_throughput", "c128_l128_throughput", "c128_l16_ttft_p50", "c128_l128_ttft_p50",
               "c1_l16_ttft_p50", "c1_l16_ttft_p99", "c1_l128_ttft_p50", "c1_l128_ttft_p99",
               "c128_l128_cpu", "c128_l16_cpu", "big_body", "open_streams_rss", "errors",
               "c32_l16_cpu_vs_router", "c32_l128_cpu_vs_router", "c128_l16_cpu_vs_router",
               "c128_l128_cpu_vs_router"}


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("overhead")
    json_path, md_path = out / "overhead.json", out / "overhead.md"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "overhead", "--quick", "--bare-relay", "--asgi-relay",
         "--lean-front",
         "--json", str(json_path), "--markdown", str(md_path)],
        cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(json_path.read_text()), md_path.read_text()


@pytest.mark.timeout(180)
def test_quick_run_completes_without_errors(quick_report: tuple[dict, str]) -> None:
    report, _ = quick_report
    assert report["errors_total"] == 0
    columns = {"direct", "gateway", "bare", "asgi", "lean", "gw_lean"} | (
        {"router"} if report["router"]["ran"] else set())
    assert {(r["target"], r["concurrency"], r["max_tokens"]) for r in report["runs"]} == {
        (column, 32, 16) for column in columns}
    for run in report["runs"]:
        assert run["errors"] == 0, run["error_kinds"]
        assert run["chunks"] > 0 and run["ttft_samples"] > 0 and run["itl_samples"] > 0


@pytest.mark.timeout(180)
def test_quick_report_has_every_field(quick_report: tuple[dict, str]) -> None:
    report, markdown = quick_report
    assert report["command"].startswith("python -m gateway overhead --quick")
    assert {"cpu_model", "cores", "python", "platform", "git"} <= set(report["machine"])
    assert {"pinning", "ttft_ms", "itl_ms", "duration_s", "repeats", "quick"} <= set(report["setup"])
    for run in report["runs"]:
        assert set(STREAM_FIELDS) <= set(run)
        if run["target"] == "gateway":
            assert all(run[k] is not None for k in GATEWAY_FIELDS), run
    (point,) = report["points"]
    for side in ("direct", "gateway"):
        assert set(POINT_FIELDS) <= set(point[side])
    assert all(point["gateway"][k] is not None for k in POINT_FIELDS)
    assert all(point["added"][k] is not None for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms"))

    for name in ("small_body", "big_body"):
        body = report[name]
        assert body["errors"] == 0
        assert body["direct"]["e2e_p50_ms"] is not None and body["gateway"]["e2e_p50_ms"] is not None
        assert body["added_p50_ms"] is not None and body["gateway_cpu_ms_per_request"] is not None
    assert report["big_body"]["body_bytes"] > 400_000

    streams = report["open_streams"]
    assert streams["errors"] == 0 and streams["opened"] == streams["streams"]
    assert streams["rss_open_mb"] and streams["rss_before_mb"] and streams["hwm_mb"]

    # Where the gateway sent them, from its own /metrics: all placed on mtp and left there.
    routing = report["gateway_routing"]
    assert routing and all(key.startswith("requests mtp/") for key, n in routing.items() if n), routing

    targets = {t["key"]: t for t in report["targets"]}
    assert set(targets) == TARGET_KEYS
    assert targets["errors"]["passed"] is True
    assert targets["big_body"]["passed"] is not None and targets["open_streams_rss"]["passed"] is not None
    for heading in ("## Targets", "## Streaming", "## Non-streamed requests", "## Open streams",
                    "| gateway | 32 |"):
        assert heading in markdown


@pytest.mark.timeout(180)
def test_quick_report_has_the_router_column(quick_report: tuple[dict, str]) -> None:
    report, markdown = quick_report
    router = report["router"]
    if not router["ran"]:
        pytest.skip(f"sglang-router did not start here: {router['error']}")
    assert router["version"] and router["error"] is None
    (point,) = report["points"]
    assert all(point["router"][k] is not None for k in POINT_FIELDS), point["router"]
    assert point["errors"]["router"] == 0
    assert all(point["router_added"][k] is not None for k in ("ttft_p50_ms", "ttft_p99_ms", "chunks_share"))
    ratios = point["vs_router"]
    assert ratios["cpu_per_chunk"] > 0 and ratios["chunks_per_s"] > 0
    target = {t["key"]: t for t in report["targets"]}["c32_l16_cpu_vs_router"]
    assert target["passed"] is not None and "x)" in target["figure"]
    assert "| router | 32 |" in markdown
    assert "## Gateway / sglang-router" in markdown and "| 32 x 16 |" in markdown


@pytest.mark.timeout(180)
def test_quick_report_has_the_floor_columns(quick_report: tuple[dict, str]) -> None:
    """The relays without the gateway's logic, and the gateway on the lean front, measured like
    the gateway: what its cost splits into."""
    report, markdown = quick_report
    (point,) = report["points"]
    for floor, row in (("bare", "bare relay"), ("asgi", "uvicorn relay"),
                       ("lean", "lean-front relay"), ("gw_lean", "gateway on the lean front")):
        assert point["errors"][floor] == 0
        assert all(point[floor][k] is not None for k in POINT_FIELDS), point[floor]
        assert point[f"{floor}_added"]["ttft_p50_ms"] is not None
        assert f"| {row} | 32 |" in markdown


@pytest.mark.parametrize(("argv", "timed"), [
    ([], True),
    (["--big-body-requests", "0"], False),  # it was timed with no request, and read FAIL
    (["--big-body-kb", "0"], False),
    (["--gateway-only"], False),
])
def test_the_bodies_are_timed_only_when_asked_for(argv: list[str], timed: bool) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert measures_bodies(parser.parse_args(argv)) is timed
