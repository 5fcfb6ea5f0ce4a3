"""What the gateway learns about its backends: active probes and passive failure counting.

`Monitor` is one background task owned by the app's lifespan. Every `interval_s` it reads
each backend's `/v1/loads` (cheap: SGLang serves a snapshot; `/health` runs a generation and
takes over a second, so it would misfire under load) and, less often, `/server_info` for the
effective running cap and the speculative accept length. Probes mark a backend down after
`fall` failures and up after `rise` successes.
A backend without `/v1/loads` or `/server_info` (404/405: an OpenAI-compatible server that is
not SGLang, or SGLang's own router in front of a pool) stays usable: `/v1/models` is its probe,
the gateway routes on its own in-flight counts, and says so once in the log and in
`/admin/state` (`missing_endpoints`).

`CircuitBreaker` counts failures of real requests: `circuit_failures` in a row open the
circuit for `circuit_open_s`; then one trial is let through (half-open): success closes it,
failure opens it again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from gateway.config import BACKEND_NAMES, BackendName, Settings
from gateway.errors import GatewayError, UpstreamConnectError
from gateway.load import Router
from gateway.upstream import Upstream

log = logging.getLogger("mtp_gateway.monitor")

SERVER_INFO_EVERY = 5  # probes between /server_info reads (the cap rarely changes)
NOT_PROVIDED = (404, 405)  # the server answers, but has no such endpoint
LOADS, SERVER_INFO = "/v1/loads", "/server_info"


class _Missing:
    """An optional endpoint the backend does not have."""


MISSING = _Missing()


class CircuitBreaker:
    def __init__(self, router: Router, failures_to_open: int, open_s: float) -> None:
        self.router = router
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self.failures: dict[BackendName, int] = {name: 0 for name in BACKEND_NAMES}
        self._timers: dict[BackendName, asyncio.TimerHandle] = {}

    def success(self, backend: BackendName) -> None:
        self.failures[backend] = 0
        health = self.router.health[backend]
        health.circuit_open = health.half_open = health.trial_in_flight = False
        self._cancel_timer(backend)  # else it would cut a later opening short

    def failure(self, backend: BackendName) -> None:
        self.failures[backend] += 1
        health = self.router.health[backend]
        if health.half_open or (self.failures[backend] >= self.failures_to_open
                                and not health.circuit_open):
            log.warning("circuit for %s opened after %d failures", backend, self.failures[backend])
            health.circuit_open, health.half_open, health.trial_in_flight = True, False, False
            self._cancel_timer(backend)
            loop = asyncio.get_running_loop()
            self._timers[backend] = loop.call_later(self.open_s, self._half_open, backend)

    def _cancel_timer(self, backend: BackendName) -> None:
        timer = self._timers.pop(backend, None)
        if timer is not None:
            timer.cancel()

    def _half_open(self, backend: BackendName) -> None:
        # One trial request may go: its success closes the circuit, its failure reopens it.
        self._timers.pop(backend, None)
        health = self.router.health[backend]
        health.circuit_open, health.half_open, health.trial_in_flight = False, True, False

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


@dataclass
class ProbeStreak:
    good: int = 0
    bad: int = 0


def parse_server_info(info: Any) -> tuple[int | None, float | None]:
    """(effective running cap, accept length) from SGLang's /server_info."""
    if not isinstance(info, dict):
        return None, None
    states = info.get("internal_states") or [{}]
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    cap = state.get("effective_max_running_requests_per_dp", info.get("max_running_requests"))
    accept = state.get("avg_spec_accept_length")
    return (int(cap) if isinstance(cap, int | float) else None,
            float(accept) if isinstance(accept, int | float) else None)


def parse_loads(loads: Any) -> tuple[int, int] | None:
    """(running, waiting) summed over DP ranks from /v1/loads (0.5.23 and 0.5.10 shapes)."""
    if not isinstance(loads, dict) or not isinstance(loads.get("loads"), list):
        return None
    running = waiting = 0
    for rank in loads["loads"]:
        if isinstance(rank, dict):
            running += int(rank.get("num_running_reqs", 0))
            waiting += int(rank.get("num_waiting_reqs", 0))
    return running, waiting


class Monitor:
    def __init__(self, settings: Settings, router: Router, upstream: Upstream) -> None:
        self.settings = settings
        self.router = router
        self.upstream = upstream
        self.streaks = {name: ProbeStreak() for name in BACKEND_NAMES}
        # Optional endpoints each backend answered 404/405 on at its last reading.
        self.missing: dict[BackendName, frozenset[str]] = {n: frozenset() for n in BACKEND_NAMES}
        self._rounds = 0

    async def run(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # a bug in one round must not end health checking for good
                log.exception("probe round failed")
            await asyncio.sleep(self.settings.monitor.interval_s)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(name) for name in BACKEND_NAMES))
        self._rounds += 1

    async def probe(self, name: BackendName) -> None:
        backend = self.settings.backends.get(name)
        budget = self.settings.monitor.request_timeout_s
        headers = [(b"authorization", f"Bearer {backend.api_key}".encode())] if backend.api_key else []
        health = self.router.health[name]
        missing = set(self.missing[name])
        try:
            loads = await self._get_optional(backend.url + LOADS, headers, budget)
            if self._rounds % SERVER_INFO_EVERY == 0 or (
                    health.effective_cap is None and SERVER_INFO not in missing):
                info = await self._get_optional(backend.url + SERVER_INFO, headers, budget)
                self._note(missing, SERVER_INFO, info)
                health.effective_cap, health.accept_length = parse_server_info(info)
            self._note(missing, LOADS, loads)
            if loads is MISSING:  # /v1/models: the probe left
                await self.upstream.get_json(backend.url + "/v1/models", headers, budget)
            running_waiting = parse_loads(loads)
        except GatewayError as exc:
            self._probe_failed(name, exc.message)
            return
        except (ValueError, TypeError, ArithmeticError) as exc:
            # A 200 that is not what SGLang sends: not JSON, not UTF-8, a count that is no number.
            self._probe_failed(name, f"unexpected answer ({type(exc).__name__})")
            return
        self._set_missing(name, frozenset(missing))
        if running_waiting is not None:
            health.reported_running, health.reported_waiting = running_waiting
            health.reported_at = time.monotonic()
        self._probe_ok(name)

    async def _get_optional(self, url: str, headers: list[tuple[bytes, bytes]],
                            budget: float) -> object:
        """JSON of an endpoint only SGLang has; MISSING when the server answers 404/405."""
        status, body = await self.upstream.request("GET", url, headers, None, budget)
        if status in NOT_PROVIDED:
            return MISSING
        if status != 200:
            raise UpstreamConnectError(f"{url} answered {status}")
        return json.loads(body)

    @staticmethod
    def _note(missing: set[str], path: str, answer: object) -> None:
        if answer is MISSING:
            missing.add(path)
        else:
            missing.discard(path)

    def _set_missing(self, name: BackendName, missing: frozenset[str]) -> None:
        """Log once per change, not every probe."""
        if missing == self.missing[name]:
            return
        self.missing[name] = missing
        if missing:
            log.warning("backend %s has no %s: routing on the gateway's own in-flight counts%s",
                        name, " or ".join(sorted(missing)),
                        ", without its running cap or accept length" if SERVER_INFO in missing
                        else "")
        else:
            log.warning("backend %s answers /v1/loads and /server_info again", name)

    def _probe_ok(self, name: BackendName) -> None:
        streak = self.streaks[name]
        streak.good, streak.bad = streak.good + 1, 0
        health = self.router.health[name]
        if not health.up and streak.good >= self.settings.monitor.rise:
            log.warning("backend %s is up", name)
            health.up = True

    def _probe_failed(self, name: BackendName, why: str) -> None:
        streak = self.streaks[name]
        streak.good, streak.bad = 0, streak.bad + 1
        health = self.router.health[name]
        if health.up and streak.bad >= self.settings.monitor.fall:
            log.warning("backend %s is down: %s", name, why)
            health.up = False
