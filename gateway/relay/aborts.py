"""Upstream aborts: stop a backend's work on a request the client no longer wants now,
instead of SGLang's own check 2 s after the socket closes. An engine without an abort
endpoint (vLLM: `ABORT` None) stops the request when its connection closes, and nothing more
is sent."""

from __future__ import annotations

import asyncio

from gateway.relay.exchange import Exchange
from gateway.upstream.client import Upstream
from gateway.upstream.engine.seam import engine_of


class Aborts:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.background: set[asyncio.Task[None]] = set()  # aborts on their way to the backends

    def abort(self, exchange: Exchange) -> None:
        """Close the current attempt's response and ask its backend to abort the request."""
        if exchange.upstream is not None:
            exchange.upstream.close()
            exchange.upstream = None
        backend = exchange.lease.backend
        engine = engine_of(backend)
        if engine.ABORT is None:
            return
        for rid in exchange.inbound.abort_rids:
            task = asyncio.create_task(engine.abort(self.upstream, backend.target, backend.name, rid))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
