"""Offline checks of the Kubernetes manifests in deploy/k8s (no cluster, no network).

- Each overlay is rendered by the real kustomize (`kubectl kustomize`, part of this machine's
  image; CI fails rather than skips without it).
- Every built-in document is validated against the Kubernetes API's own JSON schemas
  (kubernetes-validate, strict: an unknown or misspelled field fails); the ServiceMonitor (a
  CRD) against a structural schema of the fields used here.
- What the manifests promise: the gateway's probes hit endpoints that behave as the probes
  need, the drain fits in terminationGracePeriodSeconds, the gateway's backend URLs reach the
  servers' ports, the SGLang flags are exactly docker/compose.yaml's (and in the pinned 0.5.23
  flag list, shared with tests/test_deploy.py), the pair shares its GPUs and starts in
  compose's order, and the routers' arguments parse with sglang-router's own parser.
- The vLLM overlay (vllm-pair): docker/compose.vllm.yaml's servers, flags in vLLM 0.33.0's list,
  the same start order and GPU sharing as the SGLang pair.
- The turns overlays: pair-turns is docker/compose.turns.yaml's servers (no HiCache) and
  pair-turns-store, on top of it, the same with docker/compose.turns-store.yaml's opt-in store
  each; for both, the start order, the one gateway beside each pair driving its turns, probes on
  /ping only, the fractions safe, the host memory each server requests, and the gateway counting
  the stores exactly where both servers keep one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.config import Settings, load_settings
from tests.conftest import live_gateway
from tests.live import serve_app
from tests.test_deploy import (
    GATEWAY_CONFIG_TARGET,
    PREFIX_STORE,
    SGLANG_ENTRYPOINT,
    SGLANG_SERVICES,
    STORE_OVERRIDE,
    VLLM_SERVICES,
    _dockerfile_instructions,
    _duration_s,
    _flag_list,
    _flags,
    _vllm_flag_list,
    load_compose,
)
from tests.test_minimal_backend import MinimalOpenAI

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes each overlay needs: native sidecars are GA in 1.33 (the PDB's
# unhealthyPodEvictionPolicy in 1.31); DRA's resource.k8s.io/v1 in 1.34.
KUBERNETES = {"pair": "1.33", "pools": "1.33", "pair-dra": "1.34", "pair-turns": "1.33",
              "pair-turns-store": "1.33", "vllm-pair": "1.33"}
OVERLAYS = ["pair", "pools", "pair-dra"]  # the split shape; pair-turns has its own tests below
NAMESPACE = "mtp-gateway"
ABORT_WAIT_S = 2.0  # gateway/app.py lifespan: how long the shutdown waits for aborts in flight


# ---------------------------------------------------------------------------------------------
# Rendering and lookups


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl (with its built-in kustomize) is needed to render deploy/k8s")
        pytest.skip("kubectl not installed: the manifests cannot be rendered here")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def docs(overlay: str) -> list[dict[str, Any]]:
    return render(overlay)


@pytest.fixture(scope="module")
def pools() -> list[dict[str, Any]]:
    return render("pools")


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the render"
    return found[0]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def generated_configmap(docs: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith(prefix + "-")]
    return cm


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def all_containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in all_containers(pod) if c["name"] == name]
    return found


def port_number(c: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    return found


def expand(args: list[str], values: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in args, from the container's environment."""
    def one(arg: str) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values[m.group(1)], arg)
    return [one(a) for a in args]


def container_env(docs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


# ---------------------------------------------------------------------------------------------
# Schemas

# The ServiceMonitor fields these manifests use, named as in the Prometheus Operator's CRD
# (monitoring.coreos.com/v1). Anything else (a typo, a field of another kind) fails.
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                    "labels": _LABELS, "annotations": _LABELS}},
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "additionalProperties": False,
                             "properties": {"matchLabels": _LABELS}},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {"port": {"type": "string"},
                                   "path": {"type": "string", "pattern": "^/"},
                                   "scheme": {"enum": ["http", "https"]},
                                   "interval": _DURATION, "scrapeTimeout": _DURATION}}},
            },
        },
    },
}


def validate(doc: dict[str, Any], kubernetes: str = KUBERNETES["pair"]) -> None:
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        jsonschema.validate(doc, SERVICE_MONITOR)
        for endpoint in doc["spec"]["endpoints"]:
            assert _duration_s(endpoint["scrapeTimeout"]) <= _duration_s(endpoint["interval"])
    else:
        kubernetes_validate.validate(doc, kubernetes, strict=True)


def test_every_document_validates_against_the_kubernetes_schemas(overlay, docs) -> None:
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap",
            "ServiceMonitor", "StatefulSet"} <= kinds
    for doc in docs:
        try:
            validate(doc, KUBERNETES[overlay])
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at "
                        f"{'/'.join(map(str, exc.absolute_path))}")


def test_everything_lands_in_one_namespace(docs) -> None:
    """A name reference (ConfigMap, claim template, Role) only resolves inside its namespace."""
    assert find(docs, "Namespace", NAMESPACE)
    stray = [f"{d['kind']}/{d['metadata']['name']}" for d in docs
             if d["kind"] != "Namespace" and d["metadata"].get("namespace") != NAMESPACE]
    assert not stray


@pytest.mark.parametrize("kind, name, break_it", [
    ("Deployment", "mtp-gateway",
     lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={})),
    ("StatefulSet", "sglang-pair",
     lambda d: d["spec"]["template"]["spec"]["initContainers"][0].update(restartPolicy=1)),
    ("PodDisruptionBudget", "mtp-gateway", lambda d: d["spec"].update(maxAvailable=1)),
    ("ServiceMonitor", "mtp-gateway", lambda d: d["spec"]["endpoints"][0].update(paht="/m")),
    ("ServiceMonitor", "mtp-gateway",
     lambda d: d["spec"]["endpoints"][0].update(interval="5s", scrapeTimeout="10s")),
])
def test_the_validation_catches_a_broken_manifest(kind, name, break_it) -> None:
    doc = find(render("pair"), kind, name)
    validate(doc)
    break_it(doc)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError,
                        AssertionError)):
        validate(doc)


# ---------------------------------------------------------------------------------------------
# The gateway


def gateway_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Deployment", "mtp-gateway")["spec"]["template"]


def gateway_settings(docs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a gateway pod runs with: the ConfigMap's config.yaml + the pod's GATEWAY_*."""
    pod = gateway_pod(docs)["spec"]
    return gateway_settings_of(docs, pod, container(pod, "gateway"), tmp_path, monkeypatch)


def gateway_settings_of(docs, pod: dict[str, Any], gw: dict[str, Any], tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> Settings:
    cmd = gw["command"]
    config_path = cmd[cmd.index("--config") + 1]
    (mount,) = [m for m in gw["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    data = find(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    local = tmp_path / "config.yaml"
    local.write_text(data[config_path[len(mount["mountPath"]) + 1:]])
    for key in [k for k in os.environ if k.startswith("GATEWAY_")]:
        monkeypatch.delenv(key)
    for key, value in env_with_secrets(docs, gw).items():
        monkeypatch.setenv(key, value)
    return load_settings(local)


def test_gateway_replicas_probes_and_drain(docs, tmp_path, monkeypatch) -> None:
    deployment = find(docs, "Deployment", "mtp-gateway")
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = deployment["spec"]["template"]["spec"]
    gw = container(pod, "gateway")
    settings = gateway_settings(docs, tmp_path, monkeypatch)
    assert settings.listen.host == "0.0.0.0"
    for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/livez")):
        assert gw[probe]["httpGet"]["path"] == path
        assert port_number(gw, gw[probe]["httpGet"]["port"]) == settings.listen.port
    # preStop, then SIGTERM: the drain (shutdown_grace_s) and the aborts' wait, all before SIGKILL.
    pre_stop = gw["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain_s = float(pre_stop[1]) + settings.timeouts.shutdown_grace_s + ABORT_WAIT_S
    assert pod["terminationGracePeriodSeconds"] > drain_s


def test_gateway_pod_runs_the_image_as_built(docs) -> None:
    """docker/Dockerfile's command and user: the pod must not ask the image for another."""
    built = dict(_dockerfile_instructions())
    pod = gateway_pod(docs)["spec"]
    gw = container(pod, "gateway")
    assert gw["command"] == json.loads(built["CMD"])
    assert gw["command"][gw["command"].index("--config") + 1] == GATEWAY_CONFIG_TARGET
    uid, gid = built["USER"].split(":")
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) \
        == (int(uid), int(gid))


def test_gateway_service_pdb_and_servicemonitor_select_it(docs, tmp_path, monkeypatch) -> None:
    pod_labels = gateway_pod(docs)["metadata"]["labels"]
    settings = gateway_settings(docs, tmp_path, monkeypatch)
    service = find(docs, "Service", "mtp-gateway")
    assert selects(service["spec"]["selector"], pod_labels)
    (http,) = service["spec"]["ports"]
    assert port_number(container(gateway_pod(docs)["spec"], "gateway"), http["targetPort"]) \
        == settings.listen.port
    pdb = find(docs, "PodDisruptionBudget", "mtp-gateway")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert 1 <= pdb["spec"]["minAvailable"] < find(docs, "Deployment", "mtp-gateway")["spec"]["replicas"]
    monitor = find(docs, "ServiceMonitor", "mtp-gateway")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [http["name"]]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_every_servicemonitor_scrapes_named_service_ports(docs) -> None:
    for monitor in of_kind(docs, "ServiceMonitor"):
        services = [s for s in of_kind(docs, "Service")
                    if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert services, monitor["metadata"]["name"]
        for service in services:
            names = {p["name"] for p in service["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= names


@pytest.mark.timeout(30)
async def test_probe_endpoints_behave_as_the_probes_need() -> None:
    """Readiness (/health) drops when no backend can serve; liveness (/livez) does not, so an
    outage of both backends takes the gateways out of the Service without restarting them."""
    backend = MinimalOpenAI()
    async with serve_app(backend.app) as url:
        backends = SimpleNamespace(urls={"mtp": url, "plain": url})
        async with live_gateway(backends, monitor={"interval_s": 3600.0}) as gateway, \
                httpx.AsyncClient() as client:
            assert (await client.get(gateway.url + "/health")).status_code == 200
            backend.models_status = 503
            for _ in range(gateway.runtime.settings.monitor.fall):
                await gateway.runtime.probes.probe_all()
            assert (await client.get(gateway.url + "/health")).status_code == 503
            live = await client.get(gateway.url + "/livez")
            assert live.status_code == 200 and live.json() == {"status": "alive"}


def test_gateway_backends_reach_the_pair_servers(tmp_path, monkeypatch) -> None:
    docs = render("pair")
    settings = gateway_settings(docs, tmp_path, monkeypatch)
    pair = find(docs, "StatefulSet", "sglang-pair")
    headless = find(docs, "Service", pair["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # The pod is ready only when both servers are: its DNS name must not wait for that.
    assert headless["spec"]["publishNotReadyAddresses"] is True
    for role in ("mtp", "plain"):
        url = urlsplit(settings.backends.get(role).url)
        pod_name, service_name = url.hostname.split(".")
        ordinal = int(pod_name.removeprefix(pair["metadata"]["name"] + "-"))
        assert service_name == headless["metadata"]["name"] and ordinal < pair["spec"]["replicas"]
        server = container(pair["spec"]["template"]["spec"], SGLANG_SERVICES[role])
        assert url.port == int(_flags(server["args"])["--port"])
        assert url.port in {p["port"] for p in headless["spec"]["ports"]}


def test_gateway_backends_reach_the_pool_routers(pools, tmp_path, monkeypatch) -> None:
    from sglang_router.launch_router import parse_router_args

    settings = gateway_settings(pools, tmp_path, monkeypatch)
    pair = find(pools, "StatefulSet", "sglang-pair")
    assert pair["spec"]["replicas"] >= 2
    pair_labels = pair["spec"]["template"]["metadata"]["labels"]
    for role in ("mtp", "plain"):
        url = urlsplit(settings.backends.get(role).url)
        service = find(pools, "Service", url.hostname)
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
        (router,) = [d for d in of_kind(pools, "Deployment")
                     if selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert router["spec"]["replicas"] == 1  # its cache-aware state is in its memory
        pod = router["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["command"] == ["python3", "-m", "sglang_router.launch_router"]
        args = parse_router_args(expand(c["args"], {"POD_NAMESPACE": NAMESPACE}))
        assert port_number(c, port["targetPort"]) == args.port
        assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
        # The router watches the pair pods and sends to this role's server in each.
        server = container(pair["spec"]["template"]["spec"], SGLANG_SERVICES[role])
        assert args.service_discovery and args.selector == pair_labels
        assert args.service_discovery_port == int(_flags(server["args"])["--port"])
        assert args.service_discovery_namespace == NAMESPACE
        assert args.policy == "cache_aware"
        (binding,) = [b for b in of_kind(pools, "RoleBinding")
                      if {"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                          "namespace": NAMESPACE} in b["subjects"]]
        role_rules = find(pools, "Role", binding["roleRef"]["name"])["rules"]
        assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"])
                   for r in role_rules)


# ---------------------------------------------------------------------------------------------
# The SGLang pair


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose("compose.yaml")


def pair_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "StatefulSet", "sglang-pair")["spec"]["template"]["spec"]


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_sglang_flags_are_exactly_compose_flags(docs, compose, role) -> None:
    service = compose["services"][SGLANG_SERVICES[role]]
    server = container(pair_pod(docs), SGLANG_SERVICES[role])
    assert server["command"] == SGLANG_ENTRYPOINT
    assert server["image"] == service["image"]
    args = expand(server["args"], container_env(docs, server))
    assert args == service["command"]  # compose's defaults, flag for flag and in order
    assert set(_flags(args)) <= _flag_list()


def test_sglang_pair_shares_gpus_and_starts_mtp_first(docs, compose) -> None:
    pod = pair_pod(docs)
    mtp, plain = (container(pod, SGLANG_SERVICES[r]) for r in ("mtp", "plain"))
    tp = int(_flags(expand(mtp["args"], container_env(docs, mtp)))["--tp-size"])
    claims = pod.get("resourceClaims")
    if claims:  # DRA: one claim of TP GPUs, claimed by both servers
        (claim,) = claims
        template = find(docs, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
        assert request["exactly"]["allocationMode"] == "ExactCount"
        assert request["exactly"]["count"] == tp
        for server in (mtp, plain):
            assert server["resources"]["claims"] == [{"name": claim["name"]}]
            assert "nvidia.com/gpu" not in server["resources"].get("limits", {})
            assert "NVIDIA_VISIBLE_DEVICES" not in container_env(docs, server)
    else:  # device plugin: requested once (= TP, the whole node), seen by both servers
        assert int(mtp["resources"]["limits"]["nvidia.com/gpu"]) == tp
        assert "nvidia.com/gpu" not in plain.get("resources", {}).get("limits", {})
        assert container_env(docs, plain)["NVIDIA_VISIBLE_DEVICES"] == "all"
    # Start order: the MTP server is a sidecar whose startup probe (/ready: allocated and warmed
    # up) gates the start of the pod's containers, the plain server among them.
    assert mtp in pod["initContainers"] and mtp["restartPolicy"] == "Always"
    assert plain in pod["containers"]
    start_period = _duration_s(compose["services"]["sglang-mtp"]["healthcheck"]["start_period"])
    for server in (mtp, plain):
        probe = server["startupProbe"]
        assert probe["httpGet"]["path"] == "/ready"
        assert port_number(server, probe["httpGet"]["port"]) == int(_flags(server["args"])["--port"])
        assert probe["periodSeconds"] * probe["failureThreshold"] >= start_period
        assert "livenessProbe" not in server  # a server restarted alone sizes itself wrongly
    # Weights from the node's cache and shared memory in RAM, for each server.
    volumes = {v["name"]: v for v in pod["volumes"]}
    for server in (mtp, plain):
        mounts = {m["mountPath"]: volumes[m["name"]] for m in server["volumeMounts"]}
        assert "hostPath" in mounts["/root/.cache/huggingface"]
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    # One pair per node.
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"]["matchLabels"],
                   find(docs, "StatefulSet", "sglang-pair")["spec"]["template"]["metadata"]["labels"])


def test_sglang_metrics_jobs_are_the_dashboards(docs) -> None:
    """Prometheus names a ServiceMonitor's job after the Service: the Grafana dashboard
    (docker/grafana) tells the servers apart by the jobs sglang-mtp and sglang-plain."""
    pair_labels = find(docs, "StatefulSet", "sglang-pair")["spec"]["template"]["metadata"]["labels"]
    (monitor,) = [m for m in of_kind(docs, "ServiceMonitor") if m["metadata"]["name"] == "sglang"]
    scraped = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")
               if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])}
    assert set(scraped) == set(SGLANG_SERVICES.values())
    pod = pair_pod(docs)
    for name in SGLANG_SERVICES.values():
        (port,) = scraped[name]["spec"]["ports"]
        assert selects(scraped[name]["spec"]["selector"], pair_labels)
        server = container(pod, name)
        assert port_number(server, port["targetPort"]) == int(_flags(server["args"])["--port"])


# ---------------------------------------------------------------------------------------------
# The turns shape: overlays/pair-turns (docker/compose.turns.yaml on Kubernetes)

ADMIN_SECRET = "<SGLANG_ADMIN_KEY>"  # what tests/test_deploy.py's interpolation makes of compose's


# Each turns overlay and the compose files it is, flag for flag.
TURNS_OVERLAYS = {"pair-turns": ("compose.turns.yaml",),
                  "pair-turns-store": ("compose.turns.yaml", STORE_OVERRIDE)}


@pytest.fixture(scope="module", params=list(TURNS_OVERLAYS))
def turns_overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def turns(turns_overlay: str) -> list[dict[str, Any]]:
    return render(turns_overlay)


@pytest.fixture(scope="module")
def compose_turns(turns_overlay: str) -> dict[str, Any]:
    return load_compose(*TURNS_OVERLAYS[turns_overlay])


def env_with_secrets(docs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """container_env, with each secret-sourced variable as the name of its secret and key."""
    env = container_env(docs, c)
    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            env[e["name"]] = f"<secret {ref['name']}/{ref['key']}>"
    return env


def test_turns_documents_validate_and_land_in_one_namespace(turns_overlay, turns) -> None:
    for doc in turns:
        try:
            validate(doc, KUBERNETES[turns_overlay])
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at "
                        f"{'/'.join(map(str, exc.absolute_path))}")
    test_everything_lands_in_one_namespace(turns)


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_turns_servers_are_compose_turns_servers(turns, compose_turns, role) -> None:
    service = compose_turns["services"][SGLANG_SERVICES[role]]
    server = container(pair_pod(turns), SGLANG_SERVICES[role])
    assert server["command"] == SGLANG_ENTRYPOINT and server["image"] == service["image"]
    env = env_with_secrets(turns, server)
    admin = env["SGLANG_ADMIN_KEY"]
    args = [ADMIN_SECRET if a == admin else a for a in expand(server["args"], env)]
    assert args == service["command"]  # flag for flag, in order, compose's defaults
    assert set(_flags(args)) <= _flag_list()
    for name in ("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "TMS_RETAIN_CPU_BACKUP", "PYTORCH_CUDA_ALLOC_CONF",
                 "PYTORCH_ALLOC_CONF", "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES", "CUDA_DEVICE_ORDER"):
        assert env[name] == service["environment"][name], name
    # /ready is 503 while parked, /health marks a paused server unhealthy: /ping only
    for probe in ("startupProbe", "readinessProbe"):
        assert server[probe]["httpGet"]["path"] == "/ping"
        assert port_number(server, server[probe]["httpGet"]["port"]) == int(_flags(args)["--port"])
    assert "livenessProbe" not in server
    assert server["restartPolicy"] == "Always"  # a sidecar: what follows waits for its probe


def test_turns_pod_starts_plain_parks_it_then_mtp_then_the_gateway(turns) -> None:
    pod = pair_pod(turns)
    order = [c["name"] for c in pod["initContainers"]]
    assert order == ["sglang-plain", "turns-park", "sglang-mtp"]
    assert [c["name"] for c in pod["containers"]] == ["gateway"]
    park = container(pod, "turns-park")
    assert "restartPolicy" not in park  # runs to completion before sglang-mtp starts
    cmd = park["command"]
    assert cmd[:3] == ["python", "-m", "gateway.deploy.park"]
    for flag, role in (("--server", "plain"), ("--other", "mtp")):
        server = container(pod, SGLANG_SERVICES[role])
        url = urlsplit(cmd[cmd.index(flag) + 1])
        assert (url.hostname, url.port) == ("127.0.0.1", int(_flags(server["args"])["--port"]))
    admin = env_with_secrets(turns, container(pod, "sglang-plain"))["SGLANG_ADMIN_KEY"]
    assert env_with_secrets(turns, park)["SGLANG_ADMIN_KEY"] == admin
    assert park["image"] == container(pod, "gateway")["image"]  # the module is in that image


def test_turns_gateway_beside_the_pair_is_the_only_driver(turns, tmp_path, monkeypatch) -> None:
    assert not [d for d in of_kind(turns, "Deployment") if d["metadata"]["name"] == "mtp-gateway"]
    assert not of_kind(turns, "PodDisruptionBudget")
    pair = find(turns, "StatefulSet", "sglang-pair")
    pod = pair["spec"]["template"]
    (gw,) = [c for c in all_containers(pod["spec"]) if c["command"][:2] == ["mtp-gateway", "serve"]]
    settings = gateway_settings_of(turns, pod["spec"], gw, tmp_path, monkeypatch)
    env = env_with_secrets(turns, gw)
    admin = env_with_secrets(turns, container(pod["spec"], "sglang-mtp"))["SGLANG_ADMIN_KEY"]
    for role in ("mtp", "plain"):
        backend = settings.backends.get(role)
        server = container(pod["spec"], SGLANG_SERVICES[role])
        assert urlsplit(backend.url).hostname == "127.0.0.1"  # its own pair, on its own node
        assert urlsplit(backend.url).port == int(_flags(server["args"])["--port"])
        assert backend.admin_api_key == admin
    (pair_of_gateway,) = settings.fleet()
    assert settings.memory_of(pair_of_gateway) == "turns"
    # a turn is charged what the incoming server's store lacks only where both keep a store
    stores = [PREFIX_STORE & set(_flags(container(pod["spec"], SGLANG_SERVICES[role])["args"]))
              for role in ("mtp", "plain")]
    assert stores[0] == stores[1] and settings.turns.kv_store is (stores[0] == PREFIX_STORE)
    mounts = {m["mountPath"]: m["name"] for m in gw["volumeMounts"]}
    state_dir = str(Path(settings.turns.state_file).parent)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts[state_dir]]  # survives a gateway restart, not the pod's
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"  # NVML, no compute
    # the Service and its monitor reach the gateways beside the pairs
    service = find(turns, "Service", "mtp-gateway")
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    (http,) = service["spec"]["ports"]
    assert port_number(gw, http["targetPort"]) == settings.listen.port
    for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/livez")):
        assert gw[probe]["httpGet"]["path"] == path
    drain_s = float(gw["lifecycle"]["preStop"]["exec"]["command"][1]) \
        + settings.timeouts.shutdown_grace_s + ABORT_WAIT_S
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain_s
    # one pair, and so one driver, per node
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"


def test_turns_gpus_fractions_and_host_memory(turns, compose_turns) -> None:
    from gateway.sim import memory

    pod = pair_pod(turns)
    plain, mtp = (container(pod, SGLANG_SERVICES[r]) for r in ("plain", "mtp"))
    env = container_env(turns, plain)
    tp = int(env["TP"])
    assert int(plain["resources"]["limits"]["nvidia.com/gpu"]) == tp
    assert "nvidia.com/gpu" not in mtp["resources"].get("limits", {})
    assert container_env(turns, mtp)["NVIDIA_VISIBLE_DEVICES"] == "all"
    fractions = (float(env["MEM_FRACTION_MTP"]), float(env["MEM_FRACTION_PLAIN"]))
    for role in ("mtp", "plain"):
        compose_flags = _flags(compose_turns["services"][SGLANG_SERVICES[role]]["command"])
        assert float(compose_flags["--mem-fraction-static"]) == fractions[("mtp", "plain").index(role)]
    hardware = memory.HARDWARE[memory.DEFAULT_HARDWARE]
    assert hardware.gpus == tp
    memory.size_turns(hardware, fractions)  # refuses fractions a resume would not fit
    host = memory.hicache_host_memory()
    volumes = {v["name"]: v for v in pod["volumes"]}
    for role, server in (("plain", plain), ("mtp", mtp)):
        retained = (memory.size_server_weights_gib(role, hardware) + memory.CUDA_GRAPHS_GIB) * tp
        assert host[role].retained_gib >= retained
        stores = [m for m in server["volumeMounts"] if m["mountPath"] == memory.hicache_directory(role)]
        # its host copy, and with its store its HiCache host tier and its L3 store (an emptyDir in
        # RAM, counted in the pod's memory): the host memory table's row
        needed = host[role].total_gib if stores else retained
        request = server["resources"]["requests"]["memory"]
        assert request.endswith("Gi") and float(request[:-2]) >= needed, (role, needed)
        for store in stores:
            assert volumes[store["name"]]["emptyDir"] == {"medium": "Memory",
                                                          "sizeLimit": f"{host[role].tmpfs_gib}Gi"}
    mounts = [m for s in (plain, mtp) for m in s["volumeMounts"] if m["mountPath"].startswith("/hicache")]
    assert len({m["name"] for m in mounts}) == len(mounts)  # never one store for both


def test_turns_overlay_runs_without_hicache_and_the_store_overlay_adds_only_the_store() -> None:
    from gateway.sim import memory

    base, store = (pair_pod(render(overlay)) for overlay in TURNS_OVERLAYS)
    for role in ("plain", "mtp"):
        without, with_store = (container(pod, SGLANG_SERVICES[role]) for pod in (base, store))
        assert not [a for a in without["args"] if "hicache" in a or "hierarchical" in a]
        assert with_store["args"][:len(without["args"])] == without["args"]
        assert set(_flags(with_store["args"][len(without["args"]):])) == PREFIX_STORE
        assert sorted(m["mountPath"] for m in with_store["volumeMounts"]) == sorted(
            [m["mountPath"] for m in without["volumeMounts"]] + [memory.hicache_directory(role)])
    # the rest of the pod is pair-turns', in its order
    assert [c["name"] for c in all_containers(store)] == [c["name"] for c in all_containers(base)]
    assert container(store, "turns-park") == container(base, "turns-park")
    # what it costs, said at its top, is the generator's
    ratio = sum(m.total_gib for m in memory.hicache_host_memory().values()) / memory.turns_host_gib(
        memory.HARDWARE[memory.DEFAULT_HARDWARE])
    header = (K8S / "overlays" / "pair-turns-store" / "kustomization.yaml").read_text()
    assert f"{ratio:.1f}x the host memory" in header


# ---------------------------------------------------------------------------------------------
# The vLLM pair: overlays/vllm-pair (docker/compose.vllm.yaml on Kubernetes)


@pytest.fixture(scope="module")
def vllm_docs() -> list[dict[str, Any]]:
    return render("vllm-pair")


def vllm_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "StatefulSet", "vllm-pair")["spec"]["template"]["spec"]


def test_vllm_documents_validate_and_land_in_one_namespace(vllm_docs) -> None:
    for doc in vllm_docs:
        try:
            validate(doc, KUBERNETES["vllm-pair"])
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at "
                        f"{'/'.join(map(str, exc.absolute_path))}")
    test_everything_lands_in_one_namespace(vllm_docs)


@pytest.mark.parametrize("role", ["mtp", "plain"])
def test_vllm_flags_are_exactly_compose_vllm_flags(vllm_docs, role) -> None:
    service = load_compose("compose.vllm.yaml")["services"][VLLM_SERVICES[role]]
    server = container(vllm_pod(vllm_docs), VLLM_SERVICES[role])
    assert server["command"] == service["entrypoint"] and server["image"] == service["image"]
    args = expand(server["args"], container_env(vllm_docs, server))
    assert args == service["command"]  # compose's defaults, flag for flag and in order
    assert set(_flags(args)) <= _vllm_flag_list()


def test_vllm_pair_shares_gpus_and_starts_mtp_first(vllm_docs) -> None:
    pod = vllm_pod(vllm_docs)
    mtp, plain = (container(pod, VLLM_SERVICES[r]) for r in ("mtp", "plain"))
    tp = int(_flags(expand(mtp["args"], container_env(vllm_docs, mtp)))["--tensor-parallel-size"])
    assert int(mtp["resources"]["limits"]["nvidia.com/gpu"]) == tp
    assert "nvidia.com/gpu" not in plain.get("resources", {}).get("limits", {})
    assert container_env(vllm_docs, plain)["NVIDIA_VISIBLE_DEVICES"] == "all"
    # the MTP server is a sidecar whose startup probe gates the plain server's start
    assert mtp in pod["initContainers"] and mtp["restartPolicy"] == "Always"
    assert plain in pod["containers"]
    start_period = _duration_s(load_compose("compose.vllm.yaml")["services"]["vllm-mtp"]["healthcheck"]
                               ["start_period"])
    for server in (mtp, plain):
        probe = server["startupProbe"]
        assert probe["httpGet"]["path"] == "/health"
        assert port_number(server, probe["httpGet"]["port"]) == int(_flags(server["args"])["--port"])
        assert probe["periodSeconds"] * probe["failureThreshold"] >= start_period
        assert "livenessProbe" not in server


def test_gateway_backends_reach_the_vllm_pair_servers(vllm_docs, tmp_path, monkeypatch) -> None:
    settings = gateway_settings(vllm_docs, tmp_path, monkeypatch)
    assert settings.engine == "vllm"  # vLLM's load, aborts and sleep mode, not SGLang's
    pair = find(vllm_docs, "StatefulSet", "vllm-pair")
    headless = find(vllm_docs, "Service", pair["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    for role in ("mtp", "plain"):
        url = urlsplit(settings.backends.get(role).url)
        assert url.hostname == f"{pair['metadata']['name']}-0.{headless['metadata']['name']}"
        server = container(pair["spec"]["template"]["spec"], VLLM_SERVICES[role])
        assert url.port == int(_flags(server["args"])["--port"])
    # each server scraped as its own Prometheus job
    (monitor,) = [m for m in of_kind(vllm_docs, "ServiceMonitor") if m["metadata"]["name"] == "vllm"]
    scraped = {s["metadata"]["name"] for s in of_kind(vllm_docs, "Service")
               if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])}
    assert scraped == set(VLLM_SERVICES.values())
