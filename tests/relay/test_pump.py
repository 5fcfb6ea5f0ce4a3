"""The stream pump (gateway.relay.pump): what it tells the router about each relayed stream."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.conftest import live_gateway
from tests.test_gateway_live import chat, settled


@pytest.mark.timeout(30)
async def test_live_streams_through_mtp_give_the_recent_accept_length(sim) -> None:
    """MTP's recent accept length is tokens per SSE chunk over its relayed streams: the pump
    counts the chunks. Without the count a live gateway never has it (only the virtual bench
    did), so the metric stays empty and the learned crossover runs on SGLang's lifetime mean."""
    async with live_gateway(sim, routing={"adaptive_crossover": True}) as gateway, \
            httpx.AsyncClient(timeout=10) as client:
        pair = gateway.pool.pairs["default"]
        body = chat(max_tokens=64, stream=True, stream_options={"include_usage": True},
                    ignore_eos=True)
        for _ in range(3):  # adaptive.MIN_SAMPLES streams
            response = await client.post(gateway.url + "/v1/chat/completions", json=body)
            assert response.status_code == 200 and response.headers["x-gateway-backend"] == "mtp"
        await settled(gateway, 0)
        recent = pair.estimator.accept_length
        # Tokens per chunk: above one (MTP accepts drafts) and at most a whole step's tokens.
        assert recent is not None and 1.0 < recent <= sim.servers["mtp"].live.engine.profile.num_draft_tokens
        assert pair.accept_length == recent  # what the learned crossover is given
        metrics = (await client.get(gateway.url + "/metrics")).text
        match = re.search(r"^gateway_recent_accept_length ([0-9.]+)$", metrics, re.M)
        assert match is not None and float(match.group(1)) == pytest.approx(recent, abs=0.01)
