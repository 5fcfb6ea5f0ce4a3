"""Every metric the Grafana dashboard queries is really exported: scraped from a live gateway
in front of the simulated pair (gateway_*) and from the simulated SGLang servers (sglang:*).

Traffic first, so that counters and histograms have samples and not only a HELP line:
non-stream and stream requests on MTP, a 500 from MTP retried on plain (upstream error, retry,
failover), a client that leaves mid-stream (disconnect) and a malformed body (rejected).
A name counts as exported only when the scrape has at least one sample with exactly that name
(`_total`, `_bucket`, `_sum`, `_count` included), as PromQL would select it.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.faults import Faults
from gateway.upstream.probes import SERVER_INFO_EVERY
from tests.conftest import live_gateway
from tests.live import wait_until
from tests.test_deploy import DASHBOARD, PROMETHEUS_SYNTHETIC, dashboard_metric_names
from tests.test_gateway_live import OpenStream, chat

# sglang:* series a panel reads only from the MTP server (speculative decoding).
MTP_ONLY = {"sglang:spec_accept_length"}


def sample_names(text: str) -> dict[str, list[dict[str, str]]]:
    """Scrape text -> {sample name: [label sets]} (only names that have samples)."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample.labels)
    return out


def test_dashboard_queries_names_of_both_sources():
    names = dashboard_metric_names(DASHBOARD)
    assert {n for n in names if n.startswith("gateway_")}
    assert {n for n in names if n.startswith("sglang:")}
    unknown = {n for n in names if not n.startswith(("gateway_", "sglang:"))}
    assert unknown <= PROMETHEUS_SYNTHETIC, f"neither gateway nor SGLang nor Prometheus: {unknown}"


@pytest.mark.timeout(30)
async def test_every_dashboard_metric_is_exported_by_a_live_scrape(sim) -> None:
    wanted = dashboard_metric_names(DASHBOARD) - PROMETHEUS_SYNTHETIC
    # The monitor probes once at start (caps, loads, accept length) and then stays out of the
    # way, so the injected 500 is met by the request path, not by a health probe.
    async with live_gateway(sim, monitor={"interval_s": 60}) as gateway, \
            httpx.AsyncClient(timeout=10) as client:
        url = gateway.url + "/v1/chat/completions"
        ok = await client.post(url, json=chat(max_tokens=8))
        assert ok.status_code == 200 and ok.headers["x-gateway-backend"] == "mtp"
        streamed = await client.post(url, json=chat(max_tokens=8, stream=True,
                                                    stream_options={"include_usage": True}))
        assert streamed.status_code == 200 and streamed.content.endswith(b"data: [DONE]\n\n")

        await sim.servers["mtp"].set_faults(Faults(fail_status=500, fail_count=1))
        retried = await client.post(url, json=chat(max_tokens=8))
        assert retried.status_code == 200
        assert retried.headers["x-gateway-backend"] == "plain"
        assert retried.headers["x-gateway-route-reason"] == "failover"
        await sim.servers["mtp"].set_faults(Faults())

        left = await OpenStream(client, url, chat(max_tokens=100000, stream=True,
                                                  ignore_eos=True)).open()
        await left.close()
        bad = await client.post(url, content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400

        def counted(name: str) -> bool:
            metric = getattr(gateway.runtime.metrics, name)
            return any(s.value for m in metric.collect() for s in m.samples)

        await wait_until(lambda: counted("disconnects") and gateway.pool.concurrency == 0)
        # SGLang reports an accept length only once MTP has verified drafts; the monitor reads
        # /server_info every SERVER_INFO_EVERY rounds: run those rounds now, as time would.
        for _ in range(SERVER_INFO_EVERY):
            await gateway.runtime.probes.probe_all()
        assert gateway.pool.backends["mtp"].accept_length

        scrape = await client.get(gateway.url + "/metrics")
        assert scrape.status_code == 200
        exported = sample_names(scrape.text)
        backend_scrapes = {}
        for name, backend_url in sim.urls.items():
            response = await client.get(backend_url + "/metrics")
            assert response.status_code == 200
            backend_scrapes[name] = sample_names(response.text)

    gateway_wanted = {n for n in wanted if n.startswith("gateway_")}
    missing = sorted(gateway_wanted - set(exported))
    assert not missing, f"queried by the Grafana dashboard, not exported by the gateway: {missing}"
    for role, names in backend_scrapes.items():
        sglang_wanted = {n for n in wanted if n.startswith("sglang:")}
        if role != "mtp":
            sglang_wanted -= MTP_ONLY
        missing = sorted(sglang_wanted - set(names))
        assert not missing, f"queried by the Grafana dashboard, not exported by {role}: {missing}"

    # The traffic above reached the series the error panels read, with bounded labels only.
    assert {"from_backend": "mtp", "to_backend": "plain"} in exported["gateway_retries_total"]
    assert any(ls["backend"] == "mtp" for ls in exported["gateway_upstream_errors_total"])
    assert any(ls["backend"] == "plain" and ls["reason"] == "failover"
               for ls in exported["gateway_requests_total"])
    for name, label_sets in exported.items():
        for labels in label_sets:
            for key in ("backend", "from_backend", "to_backend"):
                assert labels.get(key, "mtp") in {"mtp", "plain"}, (name, labels)
