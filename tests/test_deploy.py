"""Static checks of the deployment files in docker/ (no Docker, no network).

- every SGLang flag in docker/compose.yaml exists in the pinned release (tests/data list);
- the MTP server's speculative / Mamba / memory / metrics flags;
- ports and service names agree between the SGLang commands, the healthchecks, the gateway's
  GATEWAY_* overrides (loaded through the real settings loader) and the Prometheus targets;
- start order (plain after MTP is healthy; gateway after both); for compose.turns.yaml, plain
  first, parked by gateway/deploy/park.py, then MTP, with the memory saver's flags and environment;
- the sizing comments of both compose files and docker/README.md's table are the ones
  gateway/sim/memory.py generates;
- the Dockerfile and .dockerignore;
- vLLM 0.33.0's pair (compose.vllm.yaml, compose.vllm-turns.yaml): every flag in the pinned
  `vllm serve` list (tests/data, lab/scripts/extract_vllm_flags.py), the start order, sleep mode's
  flags and environment, the level-1 sleep step against the simulated vLLM server, and the host
  memory comment gateway/sim/memory.py generates;
- the Grafana provisioning and dashboard, and that every metric a panel queries is one the
  gateway (documented contract below) or SGLang (its observability/metrics_collector.py) exports.

`dashboard_metric_names(path)` is also meant for a live-scrape test.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.config import load_settings
from gateway.routing.policy import REASONS

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
FLAGS_FILE = Path(__file__).resolve().parent / "data" / "sglang_0.5.23_flags.txt"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "mtp-gateway.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards" / "mtp-gateway.yml"

SGLANG_RELEASE = "0.5.23"
SGLANG_SERVICES = {"mtp": "sglang-mtp", "plain": "sglang-plain"}
SGLANG_ENTRYPOINT = ["python3", "-m", "sglang.launch_server"]
GATEWAY_CONFIG_TARGET = "/etc/mtp-gateway/config.yaml"

# ---------------------------------------------------------------------------------------------
# The gateway's metrics contract (gateway/metrics.py; docs/architecture.md, "Metrics"). Counter
# names carry the `_total` prometheus_client adds; histograms are listed by base name.
GATEWAY_COUNTERS = {
    "gateway_requests_total",  # {backend, reason}: routing decisions
    "gateway_responses_total",  # {backend, code}
    "gateway_upstream_errors_total",  # {backend, kind}
    "gateway_retries_total",  # {from_backend, to_backend}
    "gateway_client_disconnects_total",  # {backend, phase}
    "gateway_rejected_total",  # {reason}
    "gateway_prompt_tokens_total",  # {backend}
    "gateway_completion_tokens_total",  # {backend}
}
GATEWAY_GAUGES = {
    "gateway_inflight",  # {backend}
    "gateway_concurrency",
    "gateway_mode",  # {mode}: 1 for the current mode (mtp | plain)
    "gateway_crossover",
    "gateway_hysteresis",
    "gateway_backend_up",  # {backend}
    "gateway_backend_effective_cap",  # {backend}
    "gateway_backend_accept_length",  # {backend}
    "gateway_backend_running",  # {backend}
    "gateway_backend_waiting",  # {backend}
    "gateway_circuit_open",  # {backend}
}
GATEWAY_HISTOGRAMS = {"gateway_ttft_seconds", "gateway_e2e_seconds", "gateway_overhead_seconds"}
# Every reason a served request can carry: not those of a request with nowhere to go.
ROUTING_REASONS = set(REASONS) - {"no_backend", "holder_circuit"}

# SGLang's exported metrics (`sglang:` + the name), read from
# sglang/srt/observability/metrics_collector.py in the 0.5.10 and 0.5.23 wheels.
SGLANG_GAUGES = {
    "num_running_reqs", "num_queue_reqs", "num_grammar_queue_reqs", "num_used_tokens",
    "token_usage", "full_token_usage", "swa_token_usage", "mamba_usage", "gen_throughput",
    "cache_hit_rate", "max_total_num_tokens", "decode_sum_seq_lens", "utilization",
    "spec_accept_length", "spec_accept_rate", "num_retracted_reqs", "num_paused_reqs",
    "is_cuda_graph", "engine_startup_time", "engine_load_weights_time",
    "max_running_requests_under_SLO", "kv_available_tokens", "kv_used_tokens",
    "mamba_available_tokens", "mamba_used_tokens", "spec_cap_length",
    "spec_block_accept_length", "http_requests_active",
}
SGLANG_COUNTERS = {
    "num_retracted_requests_total", "cuda_graph_passes_total", "prompt_tokens_total",
    "generation_tokens_total", "num_requests_total", "num_aborted_requests_total",
    "num_so_requests_total", "cached_tokens_total", "http_requests_total",
    "http_responses_total",
}
SGLANG_HISTOGRAMS = {
    "queue_time_seconds", "per_stage_req_latency_seconds", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "num_retractions",
    "prompt_tokens_histogram", "generation_tokens_histogram", "func_latency_seconds",
}
# Series Prometheus itself writes for every target.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def _with_histogram_series(counters: set[str], gauges: set[str], hists: set[str]) -> set[str]:
    return counters | gauges | {h + s for h in hists for s in ("_bucket", "_sum", "_count")}


GATEWAY_EXPORTED = _with_histogram_series(GATEWAY_COUNTERS, GATEWAY_GAUGES, GATEWAY_HISTOGRAMS)
SGLANG_EXPORTED = {
    "sglang:" + n
    for n in _with_histogram_series(SGLANG_COUNTERS, SGLANG_GAUGES, SGLANG_HISTOGRAMS)
}


# ---------------------------------------------------------------------------------------------
# Helpers


def _interpolate(text: str) -> str:
    """Resolve compose-style `${VAR:-default}` / `${VAR-default}` / `${VAR}` to the file's
    defaults (independent of the caller's environment); nesting allowed. A variable without a
    default becomes `<VAR>`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if not text.startswith("${", i):
            out.append(text[i])
            i += 1
            continue
        depth, j = 1, i + 2
        while depth:
            if j >= len(text):
                raise ValueError(f"unclosed ${{ in {text!r}")
            if text.startswith("${", j):
                depth, j = depth + 1, j + 2
                continue
            if text[j] == "}":
                depth -= 1
            j += 1
        body = text[i + 2 : j - 1]
        m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(?::?-(.*)|:\?.*)?$", body, re.S)
        if not m:
            raise ValueError(f"unsupported interpolation ${{{body}}}")
        name, default = m.group(1), m.group(2)
        out.append(_interpolate(default) if default is not None else f"<{name}>")
        i = j
    return "".join(out)


def _resolve(node: Any) -> Any:
    if isinstance(node, str):
        return _interpolate(node)
    if isinstance(node, list):
        return [_resolve(x) for x in node]
    if isinstance(node, dict):
        return {k: _resolve(v) for k, v in node.items()}
    return node


def load_compose(name: str, *overrides: str) -> dict[str, Any]:
    """A compose file with its defaults, and the override files after it merged in, as
    `docker compose -f NAME -f OVERRIDE ...` merges them."""
    merged: dict[str, Any] = {}
    for file in (name, *overrides):
        with open(DOCKER / file, encoding="utf-8") as f:
            merged = merge_compose(merged, _resolve(yaml.safe_load(f)))
    return merged


# The compose specification's merge (reference/compose-file/merge): mappings merge key by key,
# sequences append, but these replace, and a service's volumes are unique by their target (a
# later one with the same target replaces the earlier).
_REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}
_UNIQUE_BY = {"volumes": lambda v: v["target"] if isinstance(v, dict) else v.split(":")[1]}


def merge_compose(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: merge_compose(base[k], v, (*path, k)) if k in base else v
                           for k, v in override.items()}}
    if isinstance(base, list) and isinstance(override, list) and not _REPLACED & {path[-1:], path[-2:]}:
        if path and path[-1] in _UNIQUE_BY:
            key = _UNIQUE_BY[path[-1]]
            replaced = {key(v) for v in override}
            return [v for v in base if key(v) not in replaced] + override
        return base + override
    return override


def _flag_list() -> set[str]:
    lines = FLAGS_FILE.read_text(encoding="utf-8").splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def _flags(command: list[str]) -> dict[str, str | None]:
    """`--flag value` / `--flag=value` / `--switch` -> {flag: value or None}."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(command):
        arg = str(command[i])
        assert arg.startswith("--"), f"unexpected positional argument {arg!r} in {command}"
        flag, value = arg.split("=", 1) if "=" in arg else (arg, None)
        assert flag not in flags, f"{flag} given twice in {command}"
        if value is None and i + 1 < len(command) and not str(command[i + 1]).startswith("--"):
            value = str(command[i + 1])
            i += 1
        flags[flag] = value
        i += 1
    return flags


def _sglang_flags(compose: dict[str, Any], role: str) -> dict[str, str | None]:
    svc = compose["services"][SGLANG_SERVICES[role]]
    assert svc["entrypoint"] == SGLANG_ENTRYPOINT
    assert isinstance(svc["command"], list), "use the list form: no shell re-splitting"
    return _flags(svc["command"])


def _bind_mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path (resolved against docker/, compose's project directory)."""
    mounts = {}
    for vol in svc.get("volumes", []):
        parts = vol.split(":")
        source, target = parts[0], parts[1]
        if source.startswith((".", "/")):
            mounts[target] = (DOCKER / source).resolve()
    return mounts


def _prometheus_targets(path: Path) -> dict[str, list[str]]:
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    jobs = {}
    for job in cfg["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        jobs[job["job_name"]] = [t for sc in job["static_configs"] for t in sc["targets"]]
    return jobs


def _hostport(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def _published(svc: dict[str, Any]) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1]) for p in svc.get("ports", [])}


_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels, strings,
    ranges and Grafana variables removed)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?[A-Za-z0-9_]+\}?", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        token = m.group(0)
        if s[m.end() :].lstrip().startswith("("):
            continue  # function or aggregation
        if token.lower() in _PROMQL_WORDS:
            continue
        names.add(token)
    return names


def _walk_panels(panels: list[dict[str, Any]]):
    for panel in panels:
        yield panel
        yield from _walk_panels(panel.get("panels", []))


def dashboard_metric_names(path: str | Path) -> set[str]:
    """Every metric name queried by an `expr` of any panel (rows included) of a Grafana
    dashboard JSON, as it appears in a scrape (e.g. `gateway_ttft_seconds_bucket`)."""
    dash = json.loads(Path(path).read_text(encoding="utf-8"))
    names: set[str] = set()
    for panel in _walk_panels(dash.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                names |= promql_metric_names(target["expr"])
    return names


# ---------------------------------------------------------------------------------------------
# SGLang servers


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose("compose.yaml")


@pytest.fixture(scope="module")
def compose_sim() -> dict[str, Any]:
    return load_compose("compose.sim.yaml")


def test_flag_list_is_the_pinned_release():
    header = [ln for ln in FLAGS_FILE.read_text().splitlines() if ln.startswith("#")]
    assert any(SGLANG_RELEASE in ln for ln in header) and any("http" in ln for ln in header)
    flags = _flag_list()
    assert len(flags) > 400 and all(f.startswith("--") for f in flags)
    assert "--mamba-radix-cache-strategy" in flags
    assert "--mamba-scheduler-strategy" not in flags  # the pre-rename name is gone in 0.5.23


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_every_sglang_flag_exists_in_pinned_release(compose, role):
    unknown = set(_sglang_flags(compose, role)) - _flag_list()
    assert not unknown, f"{SGLANG_SERVICES[role]}: not flags of SGLang {SGLANG_RELEASE}: {unknown}"


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_sglang_image_is_pinned(compose, role):
    image = compose["services"][SGLANG_SERVICES[role]]["image"]
    assert image == f"lmsysorg/sglang:v{SGLANG_RELEASE}"


def test_mtp_server_speculation_and_mamba_flags(compose):
    f = _sglang_flags(compose, "mtp")
    assert f["--speculative-algorithm"] == "NEXTN"
    steps = int(f["--speculative-num-steps"])
    topk = int(f["--speculative-eagle-topk"])
    draft = int(f["--speculative-num-draft-tokens"])
    assert steps >= 1 and topk >= 1
    if topk == 1:  # SGLang silently rewrites anything else to steps + 1
        assert draft == steps + 1
    assert f["--mamba-radix-cache-strategy"] == "extra_buffer"
    assert "--mamba-scheduler-strategy" not in f


def test_plain_server_does_not_speculate(compose):
    f = _sglang_flags(compose, "plain")
    assert not [k for k in f if k.startswith("--speculative-")]
    assert "--mamba-scheduler-strategy" not in f


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_metrics_on_and_explicit_memory_fraction(compose, role):
    f = _sglang_flags(compose, role)
    assert "--enable-metrics" in f and f["--enable-metrics"] is None
    assert 0.05 < float(f["--mem-fraction-static"]) < 0.95


def test_both_servers_serve_the_same_model(compose):
    mtp, plain = _sglang_flags(compose, "mtp"), _sglang_flags(compose, "plain")
    for flag in ("--model-path", "--served-model-name", "--tp-size", "--reasoning-parser",
                 "--tool-call-parser", "--trust-remote-code"):
        assert flag in mtp and mtp[flag] == plain[flag], flag
    assert mtp["--host"] == plain["--host"] == "0.0.0.0"
    assert mtp["--port"] != plain["--port"]


def test_sglang_gpus_are_shared_and_match_tp(compose):
    mtp, plain = (compose["services"][SGLANG_SERVICES[r]] for r in ("mtp", "plain"))
    tp = int(_sglang_flags(compose, "mtp")["--tp-size"])
    for svc in (mtp, plain):
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"]
                               for d in devices)
        assert svc["ipc"] == "host"
        assert any(v.endswith(":/root/.cache/huggingface") for v in svc["volumes"])
    gpus = mtp["environment"]["CUDA_VISIBLE_DEVICES"]
    assert gpus == plain["environment"]["CUDA_VISIBLE_DEVICES"]
    assert len(gpus.split(",")) == tp


def test_start_order(compose):
    services = compose["services"]
    assert services["sglang-plain"]["depends_on"]["sglang-mtp"]["condition"] == "service_healthy"
    assert "depends_on" not in services["sglang-mtp"]
    gw = services["gateway"]["depends_on"]
    assert {k: v["condition"] for k, v in gw.items()} == {
        "sglang-mtp": "service_healthy", "sglang-plain": "service_healthy"}


def _duration_s(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(a + b for a, b in parts) == text, text
    return sum(float(a) * units[b] for a, b in parts)


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_sglang_healthchecks(compose, role):
    svc = compose["services"][SGLANG_SERVICES[role]]
    port = _sglang_flags(compose, role)["--port"]
    probe = " ".join(svc["healthcheck"]["test"])
    urls = re.findall(r"http://[^'\" ]+", probe)
    assert urls and all(_hostport(u) == f"127.0.0.1:{port}" for u in urls)
    # /health runs a generation (>= 1 s) on every probe; /ready and /v1/models do not.
    assert all(urlsplit(u).path in ("/ready", "/v1/models") for u in urls)
    assert _duration_s(svc["healthcheck"]["start_period"]) >= 600  # a 122B model loads slowly
    assert int(port) in _published(svc)


# ---------------------------------------------------------------------------------------------
# Gateway, ports, Prometheus


def _gateway_settings(monkeypatch, env: dict[str, str]):
    for key in list(os.environ):
        if key.startswith("GATEWAY_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    return load_settings(ROOT / "config.yaml")


def _check_gateway_service(svc: dict[str, Any]) -> None:
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    assert (DOCKER / svc["build"]["context"]).resolve() == ROOT
    assert _bind_mounts(svc)[GATEWAY_CONFIG_TARGET] == ROOT / "config.yaml"
    cmd = svc["command"]
    assert cmd[:2] == ["mtp-gateway", "serve"]
    assert cmd[cmd.index("--config") + 1] == GATEWAY_CONFIG_TARGET
    assert 8000 in _published(svc)


def test_gateway_service_and_env_overrides(compose, monkeypatch):
    svc = compose["services"]["gateway"]
    _check_gateway_service(svc)
    settings = _gateway_settings(monkeypatch, svc["environment"])
    assert settings.listen.host == "0.0.0.0" and settings.listen.port == 8000
    for role, service in SGLANG_SERVICES.items():
        port = _sglang_flags(compose, role)["--port"]
        assert _hostport(settings.backends.get(role).url) == f"{service}:{port}"


def test_prometheus_targets_line_up(compose, monkeypatch):
    mounts = _bind_mounts(compose["services"]["prometheus"])
    jobs = _prometheus_targets(mounts["/etc/prometheus/prometheus.yml"])
    settings = _gateway_settings(monkeypatch, compose["services"]["gateway"]["environment"])
    assert jobs["gateway"] == [f"gateway:{settings.listen.port}"]
    for role, service in SGLANG_SERVICES.items():
        assert jobs[service] == [_hostport(settings.backends.get(role).url)]
        assert jobs[service] == [f"{service}:{_sglang_flags(compose, role)['--port']}"]


def test_sim_stack_lines_up(compose_sim, monkeypatch):
    services = compose_sim["services"]
    assert set(services) >= {"sim", "gateway", "prometheus", "grafana"}
    sim = services["sim"]
    assert sim["build"] == services["gateway"]["build"]
    cmd = sim["command"]
    assert cmd[:2] == ["mtp-gateway", "sim"]
    opts = _flags(cmd[2:])
    assert opts["--host"] == "0.0.0.0"
    ports = {"mtp": opts["--mtp-port"], "plain": opts["--plain-port"]}
    probe = " ".join(sim["healthcheck"]["test"])
    assert "8000" not in probe and all(p in probe for p in ports.values())

    gateway = services["gateway"]
    _check_gateway_service(gateway)
    assert gateway["depends_on"]["sim"]["condition"] == "service_healthy"
    settings = _gateway_settings(monkeypatch, gateway["environment"])
    assert settings.listen.host == "0.0.0.0"
    jobs = _prometheus_targets(
        _bind_mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"])
    assert jobs["gateway"] == [f"gateway:{settings.listen.port}"]
    for role, job in SGLANG_SERVICES.items():
        assert _hostport(settings.backends.get(role).url) == f"sim:{ports[role]}"
        assert jobs[job] == [f"sim:{ports[role]}"]


def test_prometheus_job_names_are_what_the_dashboard_uses():
    expected = {"gateway", *SGLANG_SERVICES.values()}
    for name in ("prometheus.yml", "prometheus.sim.yml"):
        assert set(_prometheus_targets(DOCKER / name)) == expected


# ---------------------------------------------------------------------------------------------
# Dockerfile


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text(encoding="utf-8")
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile():
    ins = _dockerfile_instructions()
    get = lambda word: [rest for w, rest in ins if w == word]  # noqa: E731
    assert get("FROM") == ["python:3.11-slim"]
    user = get("USER")[-1].split(":")[0]
    assert user not in ("root", "0")
    assert "8000" in get("EXPOSE")[-1].split()
    health = get("HEALTHCHECK")[-1]
    assert "/health" in health and "urllib" in health and "curl" not in health
    assert json.loads(get("CMD")[-1]) == [
        "mtp-gateway", "serve", "--config", GATEWAY_CONFIG_TARGET]
    assert any("pip install ." in r for r in get("RUN"))
    # Every COPY source exists and is not excluded by .dockerignore.
    ignored = {
        ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }
    sources = [s for rest in get("COPY") if not rest.startswith("--from")
               for s in rest.split()[:-1]]
    assert {"pyproject.toml", "gateway", "config.yaml"} <= set(sources)
    assert not set(sources) & ignored
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing


# ---------------------------------------------------------------------------------------------
# Grafana


def _datasource_uid() -> str:
    cfg = yaml.safe_load(DATASOURCES.read_text(encoding="utf-8"))
    (ds,) = cfg["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    return ds["uid"]


@pytest.mark.parametrize("name", ["compose.yaml", "compose.sim.yaml"])
def test_grafana_provisioning(name):
    svc = load_compose(name)["services"]["grafana"]
    env = svc["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    mounts = _bind_mounts(svc)
    assert mounts["/etc/grafana/provisioning"] == DOCKER / "grafana" / "provisioning"
    providers = yaml.safe_load(DASHBOARD_PROVIDERS.read_text(encoding="utf-8"))["providers"]
    dash_dir = providers[0]["options"]["path"]
    assert mounts[dash_dir] == DASHBOARD.parent
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dash_dir + "/")
    assert (DASHBOARD.parent / home[len(dash_dir) + 1 :]).is_file()


def test_dashboard_json_and_datasource_uid():
    uid = _datasource_uid()
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = list(_walk_panels(dash["panels"]))
    assert len({p["id"] for p in panels}) == len(panels)
    queried = [p for p in panels if p["type"] != "row"]
    assert queried
    for panel in queried:
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid and target["expr"].strip()


def test_promql_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, backend) '
            '(rate(gateway_ttft_seconds_bucket{backend="mtp"}[$__rate_interval])))')
    assert promql_metric_names(expr) == {"gateway_ttft_seconds_bucket"}
    expr = ('sum by (backend) (rate(gateway_requests_total[5m])) / on() group_left() '
            'sum(rate(gateway_requests_total[5m])) + gateway_crossover - 1')
    assert promql_metric_names(expr) == {"gateway_requests_total", "gateway_crossover"}
    expr = 'max by (job) (sglang:spec_accept_length{job="sglang-mtp"}) or up{job=~"a|b"}'
    assert promql_metric_names(expr) == {"sglang:spec_accept_length", "up"}


def test_dashboard_queries_only_exported_metrics():
    names = dashboard_metric_names(DASHBOARD)
    gateway = {n for n in names if n.startswith("gateway_")}
    sglang = {n for n in names if n.startswith("sglang:")}
    assert gateway - GATEWAY_EXPORTED == set()
    assert sglang - SGLANG_EXPORTED == set()
    assert names - gateway - sglang <= PROMETHEUS_SYNTHETIC


def test_dashboard_covers_the_issue_panels():
    names = dashboard_metric_names(DASHBOARD)
    required = {
        "gateway_requests_total",  # requests/s by backend and reason
        "gateway_concurrency", "gateway_crossover", "gateway_mode",  # concurrency vs crossover
        "gateway_inflight", "gateway_backend_effective_cap",  # in flight vs MTP cap
        "gateway_ttft_seconds_bucket", "gateway_e2e_seconds_bucket",  # latency p50/p99
        "gateway_completion_tokens_total",  # tokens/s
        "gateway_backend_accept_length",  # MTP accept length
        "gateway_upstream_errors_total", "gateway_retries_total",
        "gateway_client_disconnects_total", "gateway_backend_up",
    }
    assert required <= names
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = " ".join(t["expr"] for p in _walk_panels(dash["panels"])
                     for t in p.get("targets", []))
    assert "by (backend, reason)" in exprs
    for q in ("0.5", "0.99"):
        for h in ("gateway_ttft_seconds_bucket", "gateway_e2e_seconds_bucket"):
            assert re.search(rf"histogram_quantile\({q}, sum by \(le, backend\) "
                             rf"\(rate\({h}\[", exprs), (q, h)
    # SGLang-side panels tell the two servers apart by the Prometheus job.
    for panel in _walk_panels(dash["panels"]):
        for t in panel.get("targets", []):
            if "sglang:" in t["expr"]:
                assert "job" in t["expr"], t["expr"]


def test_routing_reasons_documented_in_dashboard():
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    (panel,) = [p for p in _walk_panels(dash["panels"])
                if p.get("title") == "Requests/s by backend and reason"]
    assert all(reason in panel["description"] for reason in ROUTING_REASONS)


# ---------------------------------------------------------------------------------------------
# The turns shape: docker/compose.turns.yaml and gateway/deploy/park.py

TURNS_ORDER = ("plain", "mtp")  # started first, started second (gateway.sim.memory.TURNS_FIRST)


@pytest.fixture(scope="module")
def compose_turns() -> dict[str, Any]:
    return load_compose("compose.turns.yaml")


# The opt-in override: each server's own prefix store (docs/compat.md, "Keeping the prefix caches
# across a turn").
STORE_OVERRIDE = "compose.turns-store.yaml"
PREFIX_STORE = {"--enable-hierarchical-cache", "--hicache-write-policy", "--hicache-storage-backend",
                "--hicache-storage-prefetch-policy", "--page-size", "--hicache-size",
                "--hicache-storage-backend-extra-config"}


@pytest.fixture(scope="module")
def compose_turns_store() -> dict[str, Any]:
    return load_compose("compose.turns.yaml", STORE_OVERRIDE)


@pytest.fixture(scope="module", params=["compose.turns.yaml", f"compose.turns.yaml + {STORE_OVERRIDE}"])
def turns_stack(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The turns stack as it can be started: without the stores, or with the override."""
    return load_compose(*request.param.split(" + "))


def _hicache_flags(flags: dict[str, str | None]) -> set[str]:
    return {f for f in flags if f in PREFIX_STORE or "hicache" in f or "hierarchical" in f}


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_turns_servers_use_the_pinned_releases_flags(turns_stack, compose, role):
    flags = _sglang_flags(turns_stack, role)
    unknown = set(flags) - _flag_list()
    assert not unknown, f"not flags of SGLang {SGLANG_RELEASE}: {unknown}"
    assert turns_stack["services"][SGLANG_SERVICES[role]]["image"] == f"lmsysorg/sglang:v{SGLANG_RELEASE}"
    # the same server as in the split shape, plus the memory saver's flags and another fraction
    split = _sglang_flags(compose, role)
    saver = {"--enable-memory-saver", "--enable-weights-cpu-backup", "--cuda-graph-backend-prefill",
             "--admin-api-key"}
    assert {k: v for k, v in flags.items() if k not in saver | PREFIX_STORE | {"--mem-fraction-static"}} == {
        k: v for k, v in split.items() if k != "--mem-fraction-static"}


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_turns_servers_run_without_hicache_by_default(compose_turns, role):
    """The default turns stack is the one the README's verdict was measured with: no store."""
    svc = compose_turns["services"][SGLANG_SERVICES[role]]
    assert not _hicache_flags(_sglang_flags(compose_turns, role))
    assert not [v for v in svc["volumes"] if isinstance(v, dict) and v["type"] == "tmpfs"]
    assert not [k for k in svc["environment"] if "HICACHE" in k]


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_turns_store_override_adds_only_the_store_to_each_server(compose_turns, compose_turns_store, role):
    base = compose_turns["services"][SGLANG_SERVICES[role]]
    svc = compose_turns_store["services"][SGLANG_SERVICES[role]]
    # compose replaces a command: the override's is the base's, flag for flag, then the store's
    command = svc["command"]
    assert command[:len(base["command"])] == base["command"]
    assert set(_flags(command[len(base["command"]):])) == PREFIX_STORE
    assert set(_flags(command)) <= _flag_list()
    # everything else is the base's, but one volume more: its store's
    assert {k: v for k, v in svc.items() if k not in ("command", "volumes")} == {
        k: v for k, v in base.items() if k not in ("command", "volumes")}
    assert svc["volumes"][:len(base["volumes"])] == base["volumes"]
    assert len(svc["volumes"]) == len(base["volumes"]) + 1


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_turns_store_servers_keep_their_own_prefix_store_sized_by_the_generator(compose_turns_store, role):
    from gateway.sim import memory

    host = memory.hicache_host_memory()[role]
    svc = compose_turns_store["services"][SGLANG_SERVICES[role]]
    flags = _sglang_flags(compose_turns_store, role)
    assert PREFIX_STORE <= set(flags) <= _flag_list()
    assert flags["--enable-hierarchical-cache"] is None
    # pages in the store before a release; a partial load is worth nothing on a Mamba hybrid
    assert (flags["--hicache-write-policy"], flags["--hicache-storage-backend"],
            flags["--hicache-storage-prefetch-policy"]) == ("write_through", "file", "wait_complete")
    assert flags["--page-size"] == str(memory.HICACHE_PAGE_TOKENS)
    assert flags["--hicache-size"] == str(host.hicache_size_gb)
    extra = json.loads(flags["--hicache-storage-backend-extra-config"] or "")
    assert extra == {"file_storage_path": memory.hicache_directory(role), "max_size": f"{host.l3_cap_gib}Gi"}
    # its directory is a tmpfs of its own, sized by the table; nothing overrides the path
    (tmpfs,) = [v for v in svc["volumes"] if isinstance(v, dict) and v["type"] == "tmpfs"]
    assert tmpfs["target"] == extra["file_storage_path"]
    assert tmpfs["tmpfs"]["size"] == f"{host.tmpfs_gib}g"
    assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR" not in svc["environment"]


def test_turns_store_servers_never_share_a_prefix_store(compose_turns_store):
    flags = {role: _sglang_flags(compose_turns_store, role) for role in SGLANG_SERVICES}
    paths = {json.loads(f["--hicache-storage-backend-extra-config"] or "")["file_storage_path"]
             for f in flags.values()}
    assert len(paths) == 2  # plain would read MTP's pages (13 layers) as its own KV (12)
    tmpfs = {v["target"] for service in SGLANG_SERVICES.values()
             for v in compose_turns_store["services"][service]["volumes"] if isinstance(v, dict)}
    assert tmpfs == paths  # each directory on a tmpfs of its own
    assert len({f["--page-size"] for f in flags.values()}) == 1


def test_turns_gateway_counts_the_stores_only_where_both_servers_keep_one(turns_stack, monkeypatch):
    """turns.kv_store charges a turn what the incoming server's store lacks: set exactly when both
    servers run HiCache with a store each (config.yaml)."""
    settings = _gateway_settings(monkeypatch, turns_stack["services"]["gateway"]["environment"])
    stores = [_hicache_flags(_sglang_flags(turns_stack, role)) for role in SGLANG_SERVICES]
    assert stores[0] == stores[1]
    assert settings.turns.kv_store is (stores[0] == PREFIX_STORE)


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_turns_servers_have_the_memory_savers_flags_and_environment(turns_stack, role):
    svc = turns_stack["services"][SGLANG_SERVICES[role]]
    flags = _sglang_flags(turns_stack, role)
    assert "--enable-memory-saver" in flags and flags["--enable-memory-saver"] is None
    # target and draft weights come back from a host copy (load_model_utils.py:307-309)
    assert "--enable-weights-cpu-backup" in flags and flags["--enable-weights-cpu-backup"] is None
    env = svc["environment"]
    assert env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1" and env["TMS_RETAIN_CPU_BACKUP"] == "1"
    # breakable prefill graphs (the CUDA default) refuse the graphs' memory saver at start
    assert flags["--cuda-graph-backend-prefill"] in ("disabled", "full")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert "expandable_segments:True" not in env.get(name, "")
    assert flags["--admin-api-key"] == "<SGLANG_ADMIN_KEY>"  # required, no default
    assert "--api-key" not in flags  # /ping would then need it (utils/auth.py:101-106)
    assert svc["restart"] == "no"


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_turns_healthchecks_use_ping(turns_stack, role):
    svc = turns_stack["services"][SGLANG_SERVICES[role]]
    port = _sglang_flags(turns_stack, role)["--port"]
    urls = re.findall(r"http://[^'\" ]+", " ".join(svc["healthcheck"]["test"]))
    # /ready is 503 while parked and /health marks a paused server unhealthy after 20 s
    assert urls == [f"http://127.0.0.1:{port}/ping"]
    assert _duration_s(svc["healthcheck"]["start_period"]) >= 600


def test_turns_start_order_parks_the_first_before_the_second_starts(turns_stack):
    services = turns_stack["services"]
    first, second = (SGLANG_SERVICES[r] for r in TURNS_ORDER)
    assert "depends_on" not in services[first]
    park = services["turns-park"]
    assert park["depends_on"] == {first: {"condition": "service_healthy"}}
    assert park["restart"] == "no"
    assert park["build"] == services["gateway"]["build"]  # the module is in the gateway's image
    entry = park["command"]
    assert entry[:3] == ["python", "-m", "gateway.deploy.park"]
    ports = {r: _sglang_flags(turns_stack, r)["--port"] for r in TURNS_ORDER}
    assert _hostport(entry[entry.index("--server") + 1]) == f"{first}:{ports[TURNS_ORDER[0]]}"
    assert _hostport(entry[entry.index("--other") + 1]) == f"{second}:{ports[TURNS_ORDER[1]]}"
    assert park["environment"]["SGLANG_ADMIN_KEY"] == "<SGLANG_ADMIN_KEY>"
    assert services[second]["depends_on"] == {"turns-park": {"condition": "service_completed_successfully"}}
    gateway = {k: v["condition"] for k, v in services["gateway"]["depends_on"].items()}
    assert gateway == {first: "service_healthy", second: "service_healthy",
                       "turns-park": "service_completed_successfully"}


def test_turns_fractions_are_the_sizing_codes_and_safe(turns_stack):
    from gateway.sim import memory

    text = (DOCKER / "compose.turns.yaml").read_text()
    defaults = tuple(float(re.search(r"\$\{" + v + r":-([0-9.]+)\}", text).group(1))
                     for v in ("MEM_FRACTION_MTP", "MEM_FRACTION_PLAIN"))
    for hw in memory.HARDWARE.values():
        assert hw.turns_fractions == defaults
        turns = memory.size_turns(hw, defaults)  # raises on fractions a resume would not fit
        assert turns.first == TURNS_ORDER[0] and min(turns.resume_margin_gib.values()) > 0
    for role, variable in (("mtp", "MEM_FRACTION_MTP"), ("plain", "MEM_FRACTION_PLAIN")):
        fraction = _sglang_flags(turns_stack, role)["--mem-fraction-static"]
        assert float(fraction) == defaults[("mtp", "plain").index(role)], variable


def test_turns_gateway_drives_the_pair_with_the_servers_admin_key(turns_stack, monkeypatch):
    svc = turns_stack["services"]["gateway"]
    _check_gateway_service(svc)
    env = svc["environment"]
    settings = _gateway_settings(monkeypatch, env)
    for role, service in SGLANG_SERVICES.items():
        flags = _sglang_flags(turns_stack, role)
        backend = settings.backends.get(role)
        assert _hostport(backend.url) == f"{service}:{flags['--port']}"
        assert backend.admin_api_key == flags["--admin-api-key"]
    assert env["GATEWAY_MEMORY"] == "turns"
    state = env["GATEWAY_TURNS__STATE_FILE"]
    assert any(v.startswith("turns-state:") and state.startswith(v.split(":")[1] + "/")
               for v in svc["volumes"])
    # the image can read NVML (gateway/turns/nvml.py imports pynvml) for the memory check
    assert any("nvidia-ml-py" in r for w, r in _dockerfile_instructions() if w == "RUN")
    assert "utility" in svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"]
    (pair,) = settings.fleet()
    assert settings.memory_of(pair) == "turns"
    assert settings.turns.state_file == state


@pytest.mark.parametrize("name, shape", [("compose.yaml", "split"), ("compose.turns.yaml", "turns"),
                                         (STORE_OVERRIDE, "turns-store")])
def test_compose_sizing_comments_are_the_generated_ones(name, shape):
    from gateway.sim import memory

    text = (DOCKER / name).read_text()
    start = text.index(memory.COMPOSE_BEGIN.format(shape=shape))
    end = text.index(memory.COMPOSE_END, start) + len(memory.COMPOSE_END)
    assert text[start:end] == memory.compose_sizing(shape), (
        f"regenerate with `python -m gateway.sim.memory --compose {shape}`")
    # no other GB / GiB figure about memory outside the generated block, so none can drift
    outside = text[:start] + text[end:]
    figures = re.findall(r"\b\d+(?:\.\d+)? ?GiB\b|~\d+ GB per GPU|pools ~\d+", outside)
    assert not figures, figures


# --- gateway/deploy/park.py against the simulated memory saver ------------------------------

CLOSED = "http://127.0.0.1:9"  # discard port: nothing listens, as before sglang-mtp starts


@pytest.mark.timeout(30)
async def test_park_pauses_and_releases_the_first_server_once():
    import asyncio

    import httpx

    from gateway.deploy import park
    from gateway.sim.saver import SaverOptions
    from gateway.sim.server import SimOptions, start_sim_pair
    saver = SaverOptions(enable_memory_saver=True, weights_cpu_backup=True, cuda_graph_in_saver=True,
                         retain_cpu_backup=True)
    options = SimOptions(speed=200, saver=saver, admin_api_key="k")
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=5) as http:
        plain = pair.urls["plain"]
        with pytest.raises(SystemExit, match="pause_generation answered 401"):
            await asyncio.to_thread(park.park, plain, CLOSED, None, 5, 5)
        done = await asyncio.to_thread(park.park, plain, CLOSED, "k", 5, 5)
        assert "paused and released" in done
        assert pair.servers["plain"].saver.state.released == {"weights", "kv_cache", "cuda_graph"}
        assert (await http.get(plain + "/ready")).status_code == 503
        assert (await http.get(plain + "/ping")).status_code == 200
        # run again (compose up a second time): a second release would kill the server
        again = await asyncio.to_thread(park.park, plain, CLOSED, "k", 5, 5)
        assert "paused already" in again
        assert pair.servers["plain"].saver.state.status == "serving"
        # with the other server up the pair is the gateway's: nothing is touched
        mtp = pair.urls["mtp"]
        untouched = await asyncio.to_thread(park.park, mtp, plain, "k", 5, 5)
        assert "nothing done" in untouched and (await http.get(mtp + "/ready")).status_code == 200


def test_readme_turns_without_docker_matches_compose_turns(compose_turns):
    readme = (DOCKER / "README.md").read_text()
    block = readme[readme.index("The turns shape without Docker"):]
    block = block[block.index("```bash"):block.index("```", block.index("```bash") + 3)]
    common = readme[readme.index('COMMON="'):]
    common = common[:common.index('"', len('COMMON="'))].replace("\\\n", " ")
    text = block.replace("\\\n", " ")
    launches = [line for line in text.splitlines() if "sglang.launch_server" in line]
    assert len(launches) == 2
    turns_flags = re.search(r'TURNS="([^"]*)"', text).group(1)
    for line in launches:
        words = line.replace("$COMMON", common[len('COMMON="'):]).replace("$TURNS", turns_flags).split()
        words = words[words.index("sglang.launch_server") + 1:words.index(">")]
        flags = _flags(words)
        role = "plain" if flags["--port"] == "30002" else "mtp"
        compose_flags = _sglang_flags(compose_turns, role)
        assert set(flags) == set(compose_flags), role  # the same flags as compose.turns.yaml
        assert flags["--mem-fraction-static"] == compose_flags["--mem-fraction-static"], role
    env = compose_turns["services"]["sglang-plain"]["environment"]
    for name in ("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "TMS_RETAIN_CPU_BACKUP", "PYTORCH_CUDA_ALLOC_CONF"):
        assert f"{name}={env[name]}" in text.split("\n")[1], name
    # plain is parked before the MTP server starts
    assert text.index("--port 30002") < text.index("gateway.deploy.park") < text.index("--port 30001")


# ---------------------------------------------------------------------------------------------
# vLLM 0.33.0: docker/compose.vllm.yaml (split) and compose.vllm-turns.yaml (sleep mode)

VLLM_RELEASE = "0.33.0"
VLLM_FLAGS_FILE = Path(__file__).resolve().parent / "data" / f"vllm_{VLLM_RELEASE}_flags.txt"
VLLM_SERVICES = {"mtp": "vllm-mtp", "plain": "vllm-plain"}
VLLM_FILES = ("compose.vllm.yaml", "compose.vllm-turns.yaml")


def _vllm_flag_list() -> set[str]:
    lines = VLLM_FLAGS_FILE.read_text(encoding="utf-8").splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def _vllm_flags(compose: dict[str, Any], role: str) -> dict[str, str | None]:
    svc = compose["services"][VLLM_SERVICES[role]]
    assert svc["entrypoint"] == ["vllm", "serve"]
    assert svc["image"] == f"vllm/vllm-openai:v{VLLM_RELEASE}"
    assert isinstance(svc["command"], list), "use the list form: no shell re-splitting"
    return _flags(svc["command"])


def test_vllm_flag_list_is_the_pinned_release_and_regenerates():
    import importlib.util

    script = ROOT / "lab" / "scripts" / "extract_vllm_flags.py"
    spec = importlib.util.spec_from_file_location("extract_vllm_flags", script)
    assert spec is not None and spec.loader is not None
    extract_vllm_flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extract_vllm_flags)
    header = [ln for ln in VLLM_FLAGS_FILE.read_text().splitlines() if ln.startswith("#")]
    assert any(VLLM_RELEASE in ln for ln in header) and any("http" in ln for ln in header)
    flags = _vllm_flag_list()
    # the flags both compose files need, and forms argparse adds (BooleanOptionalAction)
    assert {"--gpu-memory-utilization", "--enable-sleep-mode", "--no-enable-sleep-mode",
            "--speculative-config", "--max-num-seqs", "--no-enable-prefix-caching", "--headless"} <= flags
    assert "--num-speculative-tokens" not in flags  # the speculative config's key, not a flag
    source = Path(os.environ.get("VLLM_SRC", "/nonexistent"))
    if not (source / "engine" / "arg_utils.py").is_file():
        pytest.skip("VLLM_SRC (an unpacked vllm 0.33.0 package) not set: the list is not regenerated")
    assert set(extract_vllm_flags.flags(source)) == flags


@pytest.mark.parametrize("name", VLLM_FILES)
@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_vllm_servers_use_the_pinned_releases_flags(name, role):
    flags = _vllm_flags(load_compose(name), role)
    unknown = set(flags) - _vllm_flag_list()
    assert not unknown, f"not flags of vLLM {VLLM_RELEASE}'s `vllm serve`: {unknown}"


@pytest.mark.parametrize("name", VLLM_FILES)
def test_vllm_pair_is_one_model_mtp_on_one_side(name):
    compose = load_compose(name)
    mtp, plain = (_vllm_flags(compose, r) for r in ("mtp", "plain"))
    speculative = json.loads(mtp["--speculative-config"] or "")
    assert speculative == {"method": "mtp", "num_speculative_tokens": 1}  # Qwen3.5's recipe
    assert "--speculative-config" not in plain
    for flag in ("--model", "--served-model-name", "--tensor-parallel-size", "--reasoning-parser",
                 "--tool-call-parser"):
        assert mtp[flag] == plain[flag], flag
    assert mtp["--port"] != plain["--port"]
    for role, flags in (("mtp", mtp), ("plain", plain)):
        # a Mamba-hybrid model refuses to start with the default 1024 above its Mamba blocks
        assert flags["--max-num-seqs"] is not None and int(flags["--max-num-seqs"]) < 1024, role
        svc = compose["services"][VLLM_SERVICES[role]]
        assert svc["restart"] == "no"
        urls = re.findall(r"http://[^'\" ]+", " ".join(svc["healthcheck"]["test"]))
        assert urls == [f"http://127.0.0.1:{flags['--port']}/health"]


def test_vllm_split_fractions_of_the_total_fit_and_start_in_order(monkeypatch):
    compose = load_compose("compose.vllm.yaml")
    services = compose["services"]
    utils = [float(_vllm_flags(compose, r)["--gpu-memory-utilization"] or 0) for r in ("mtp", "plain")]
    assert sum(utils) < 0.95  # fractions of the total: both budgets and both CUDA contexts fit
    assert "depends_on" not in services["vllm-mtp"]
    assert services["vllm-plain"]["depends_on"] == {"vllm-mtp": {"condition": "service_healthy"}}
    gateway = services["gateway"]
    _check_gateway_service(gateway)
    assert {k: v["condition"] for k, v in gateway["depends_on"].items()} == {
        "vllm-mtp": "service_healthy", "vllm-plain": "service_healthy"}
    settings = _gateway_settings(monkeypatch, gateway["environment"])
    for role, service in VLLM_SERVICES.items():
        port = _vllm_flags(compose, role)["--port"]
        assert _hostport(settings.backends.get(role).url) == f"{service}:{port}"


def test_vllm_turns_sleep_mode_and_start_order():
    compose = load_compose("compose.vllm-turns.yaml")
    services = compose["services"]
    split = load_compose("compose.vllm.yaml")
    for role in ("mtp", "plain"):
        flags = _vllm_flags(compose, role)
        assert "--enable-sleep-mode" in flags and flags["--enable-sleep-mode"] is None
        assert services[VLLM_SERVICES[role]]["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
        sized = {"--enable-sleep-mode", "--gpu-memory-utilization", "--max-num-seqs"}
        assert {k: v for k, v in flags.items() if k not in sized} == {
            k: v for k, v in _vllm_flags(split, role).items() if k not in sized}
    # plain first, asleep (level 1) before MTP starts
    assert "depends_on" not in services["vllm-plain"]
    sleeper = services["vllm-sleep"]
    assert sleeper["depends_on"] == {"vllm-plain": {"condition": "service_healthy"}}
    assert sleeper["restart"] == "no" and sleeper["build"]["dockerfile"] == "docker/Dockerfile"
    script = sleeper["command"][2]
    port = _vllm_flags(compose, "plain")["--port"]
    assert f'"http://vllm-plain:{port}"' in script and '"/sleep?level=1"' in script
    assert "/is_sleeping" in script
    after_sleep = {"vllm-sleep": {"condition": "service_completed_successfully"}}
    assert services["vllm-mtp"]["depends_on"] == after_sleep
    # each awake server's budget beside the other's leftovers (a few GiB) fits the total
    utils = [float(_vllm_flags(compose, r)["--gpu-memory-utilization"] or 0) for r in ("plain", "mtp")]
    assert max(utils) <= 0.9 and utils[1] <= utils[0]


def test_vllm_turns_host_memory_comment_is_the_generated_one():
    from gateway.sim import memory

    text = (DOCKER / "compose.vllm-turns.yaml").read_text()
    start = text.index(memory.COMPOSE_BEGIN.format(shape="vllm-turns"))
    end = text.index(memory.COMPOSE_END, start) + len(memory.COMPOSE_END)
    assert text[start:end] == memory.compose_sizing("vllm-turns"), (
        "regenerate with `python -m gateway.sim.memory --compose vllm-turns`")


@pytest.mark.timeout(30)
async def test_vllm_sleep_service_puts_the_first_server_to_sleep_once():
    """compose.vllm-turns.yaml's vllm-sleep script, run against the simulated vLLM pair in dev
    mode: plain asleep at level 1; run again, nothing changes; with MTP up, nothing is touched."""
    import asyncio
    import sys

    import httpx

    from gateway.sim.server import SimOptions, start_sim_pair
    from gateway.sim.vllm.app import VllmOptions

    script = load_compose("compose.vllm-turns.yaml")["services"]["vllm-sleep"]["command"][2]

    async def run(first: str, other: str) -> tuple[int, str]:
        code = script.replace('"http://vllm-plain:30002"', repr(first)).replace(
            '"http://vllm-mtp:30001"', repr(other))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode()

    options = SimOptions(speed=200, engine="vllm", vllm=VllmOptions(dev_mode=True, enable_sleep_mode=True))
    async with start_sim_pair(options) as pair, httpx.AsyncClient(timeout=5) as http:
        plain, mtp = pair.urls["plain"], pair.urls["mtp"]
        # with the other server up the pair is the controller's: nothing is done
        code, out = await run(plain, mtp)
        assert code == 0 and "nothing done" in out
        assert (await http.get(plain + "/is_sleeping")).json() == {"is_sleeping": False}
        code, out = await run(plain, CLOSED)
        assert code == 0, out
        assert (await http.get(plain + "/is_sleeping")).json() == {"is_sleeping": True}
        held = pair.servers["plain"].saver.device.holding("plain")
        code, out = await run(plain, CLOSED)  # compose up again: a sleep while asleep is a no-op
        assert code == 0, out
        assert pair.servers["plain"].saver.device.holding("plain") == held
        assert 'sleep_state="weights_offloaded"} 1.0' in (await http.get(plain + "/metrics")).text


@pytest.mark.parametrize("name, memory", [("compose.vllm.yaml", None), ("compose.vllm-turns.yaml", "auto")])
def test_vllm_gateway_service_runs_the_vllm_engine_after_both_servers(name, memory, monkeypatch):
    compose = load_compose(name)
    gateway = compose["services"]["gateway"]
    _check_gateway_service(gateway)
    assert {k: v["condition"] for k, v in gateway["depends_on"].items()} == {
        "vllm-mtp": "service_healthy", "vllm-plain": "service_healthy"}
    assert gateway["environment"].get("GATEWAY_MEMORY") == memory
    settings = _gateway_settings(monkeypatch, gateway["environment"])
    assert settings.engine == "vllm" and settings.memory == "auto"
    for role, service in VLLM_SERVICES.items():
        port = _vllm_flags(compose, role)["--port"]
        assert _hostport(settings.backends.get(role).url) == f"{service}:{port}"
    if name == "compose.vllm-turns.yaml":  # its journal survives a restart of the container
        state = Path(settings.turns.state_file or "")
        assert f"turns-state:{state.parent}" in gateway["volumes"] and "turns-state" in compose["volumes"]
        # an arrival waits through a whole turn (the streams' finish, then ~18 s of sleep and
        # wake), not a 503 in the middle of it
        turns = settings.turns
        assert turns.turn_cost_s >= 15 and turns.wait_max_s >= turns.finish_within_s + turns.turn_cost_s


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name, shape", [("compose.vllm.yaml", "split"),
                                         ("compose.vllm-turns.yaml", "turns")])
async def test_vllm_gateway_service_takes_the_shape_of_its_files_servers(name, shape, monkeypatch):
    """The gateway as the file configures it, in front of the simulated vLLM servers as the file
    starts them (compose.vllm.yaml: no dev mode, no sleep mode; compose.vllm-turns.yaml: both,
    plain asleep): `memory: auto` splits the one and takes turns with the other."""
    import httpx
    from prometheus_client import CollectorRegistry

    from gateway.app import create_app
    from gateway.cli import with_backend_urls
    from gateway.sim.server import SimOptions, start_sim_pair
    from gateway.sim.vllm.app import VllmOptions
    from tests.live import serve_app

    compose = load_compose(name)
    local = ("GATEWAY_LISTEN", "GATEWAY_TURNS__STATE")  # where it listens, its volume
    env = {k: v for k, v in compose["services"]["gateway"]["environment"].items() if not k.startswith(local)}
    settings = _gateway_settings(monkeypatch, env)
    settings = settings.model_copy(update={
        "turns": settings.turns.model_copy(update={"check_memory": False}),  # no GPU here
        "monitor": settings.monitor.model_copy(update={"interval_s": 0.05})})
    # the servers as the file starts them: dev mode and sleep mode, or neither
    sleep_mode = all("--enable-sleep-mode" in _vllm_flags(compose, role) for role in VLLM_SERVICES)
    server = VllmOptions(dev_mode=compose["x-vllm"]["environment"].get("VLLM_SERVER_DEV_MODE") == "1",
                         enable_sleep_mode=sleep_mode)
    options = SimOptions(speed=200, engine="vllm", memory="turns" if sleep_mode else "split", vllm=server)
    async with start_sim_pair(options) as pair:
        app = create_app(with_backend_urls(settings, pair.urls), registry=CollectorRegistry())
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
            answer = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert answer.status_code == 200
            assert app.state.runtime.turns.shape_of("default").shape == shape
            if shape == "turns":
                assert answer.headers["x-gateway-backend"] == "mtp"
