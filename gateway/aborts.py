"""Upstream aborts: stop a backend's work on a request the client no longer wants now,
instead of SGLang's own check 2 s after the socket closes."""

from __future__ import annotations

import asyncio
import json
import logging

from gateway.backends import BackendState
from gateway.errors import GatewayError
from gateway.exchange import Exchange
from gateway.upstream import Upstream

log = logging.getLogger("mtp_gateway.relay")


class Aborts:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.background: set[asyncio.Task[None]] = set()  # aborts on their way to the backends

    def abort(self, exchange: Exchange) -> None:
        """Close the current attempt's response and ask its backend to abort the request."""
        if exchange.upstream is not None:
            exchange.upstream.close()
            exchange.upstream = None
        for rid in exchange.inbound.abort_rids:
            task = asyncio.create_task(self._post_abort(exchange.lease.backend, rid))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    async def _post_abort(self, state: BackendState, rid: str) -> None:
        target, backend = state.target, state.name
        key = target.admin_api_key or target.api_key  # SGLang: the admin key when it has one
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        try:
            status = await self.upstream.post_json(target.url + "/abort_request",
                                                   json.dumps({"rid": rid}).encode(), headers, 5.0)
        except GatewayError as exc:
            log.info("abort of %s on %s failed: %s", rid, backend, exc.message)
            return
        if status in (401, 403):
            log.warning("abort of %s on %s refused with HTTP %d: set backends.%s.admin_api_key "
                        "to the server's --admin-api-key", rid, backend, status, backend)
