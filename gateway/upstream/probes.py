"""What the gateway learns about its backends: active probes and passive failure counting.

`Probes` is one background task owned by the app's lifespan. Every `interval_s` it reads
each backend's load endpoint, as its engine names it (gateway/upstream/engine/seam.py
`engine_of`): SGLang's `/v1/loads` (cheap: a snapshot; `/health` runs a generation and takes
over a second, so it would misfire under load), vLLM's `/metrics` text; and, less often, the
server-info endpoint for the effective running cap and the speculative accept length.
Probes mark a backend down after `fall` failures and up after `rise` successes.
A backend without `/v1/loads` or `/server_info` (404/405: an OpenAI-compatible server that is
not SGLang, or SGLang's own router in front of a pool) stays usable: `/v1/models` is its probe,
the gateway routes on its own in-flight counts, and says so once in the log and in
`/admin/state` (`missing_endpoints`).

What it learns goes into each backend's `BackendState` by that state's own methods; the
circuit breaker is not here: a request's end judges it (`gateway.routing.pool.Lease.end`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from gateway.apis.errors import GatewayError, UpstreamConnectError
from gateway.config import Settings
from gateway.routing.backend import BackendState
from gateway.routing.pool import Pool
from gateway.upstream.client import Upstream
from gateway.upstream.engine.seam import Engine, engine_of

log = logging.getLogger("mtp_gateway.monitor")

SERVER_INFO_EVERY = 5  # probes between /server_info reads (the cap rarely changes)


class _Missing:
    """An optional endpoint the backend does not have."""


MISSING = _Missing()


class Probes:
    def __init__(self, get_settings: Callable[[], Settings], pool: Pool,
                 upstream: Upstream) -> None:
        self.get_settings = get_settings  # the runtime's one settings object, as reloaded
        self.pool = pool
        self.upstream = upstream
        self._rounds = 0

    async def run(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # a bug in one round must not end health checking for good
                log.exception("probe round failed")
            await asyncio.sleep(self.get_settings().monitor.interval_s)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(b) for b in self.pool.backends.values()))
        self._rounds += 1

    async def probe(self, backend: BackendState) -> None:
        if backend.parked:  # a turns pair's server without the memory: paused, not down
            return
        target, engine = backend.target, engine_of(backend)
        budget = self.get_settings().monitor.request_timeout_s
        headers = engine.probe_headers(target)
        missing = set(backend.missing_endpoints)
        try:
            loads = await self._get_optional(engine, target.url + engine.LOADS, headers, budget)
            if self._rounds % SERVER_INFO_EVERY == 0 or (
                    backend.effective_cap is None and engine.SERVER_INFO not in missing):
                raw = await self._get_optional(engine, target.url + engine.SERVER_INFO, headers,
                                               budget)
                info = raw if isinstance(raw, _Missing) else json.loads(raw)
                self._note(missing, engine.SERVER_INFO, info)
                backend.record_server_info(*engine.parse_server_info(info))
                backend.usage_by_default = engine.usage_by_default(info)
            self._note(missing, engine.LOADS, loads)
            if loads is MISSING:  # /v1/models: the probe left
                await self.upstream.get_json(target.url + engine.MODELS, headers, budget)
            running_waiting = engine.parse_loads(loads)
        except GatewayError as exc:
            self._probe_failed(backend, exc.message)
            return
        except (ValueError, TypeError, ArithmeticError) as exc:
            # A 200 that is not what the engine sends: not JSON, not UTF-8, a count that is no number.
            self._probe_failed(backend, f"unexpected answer ({type(exc).__name__})")
            return
        self._set_missing(backend, frozenset(missing))
        if running_waiting is not None:
            backend.record_loads(*running_waiting, now=time.monotonic())
        if backend.probe_ok():
            log.warning("backend %s is up", backend.name)

    async def _get_optional(self, engine: Engine, url: str, headers: list[tuple[bytes, bytes]],
                            budget: float) -> bytes | _Missing:
        """The body of an endpoint only the engine has; MISSING when the server answers
        404/405 (not that engine, or its router)."""
        status, body = await self.upstream.request("GET", url, headers, None, budget)
        if status in engine.NOT_PROVIDED:
            return MISSING
        if status != 200:
            raise UpstreamConnectError(f"{url} answered {status}")
        return body

    @staticmethod
    def _note(missing: set[str], path: str, answer: object) -> None:
        if answer is MISSING:
            missing.add(path)
        else:
            missing.discard(path)

    @staticmethod
    def _set_missing(backend: BackendState, missing: frozenset[str]) -> None:
        """Log once per change, not every probe."""
        if not backend.record_missing(missing):
            return
        engine = engine_of(backend)
        if missing:
            log.warning("backend %s has no %s: routing on the gateway's own in-flight counts%s",
                        backend.name, " or ".join(sorted(missing)),
                        ", without its running cap or accept length" if engine.SERVER_INFO in missing
                        else "")
        else:
            log.warning("backend %s answers %s and %s again", backend.name, engine.LOADS,
                        engine.SERVER_INFO)

    @staticmethod
    def _probe_failed(backend: BackendState, why: str) -> None:
        if backend.probe_failed():
            log.warning("backend %s is down: %s", backend.name, why)
