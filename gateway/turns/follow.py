"""A gateway replica that follows another's turns (`turns.controller_url`): it never sends a
memory-saver call; it mirrors the controller's `GET /turns/state` for its pair, admits only to
the server the controller admits to, and at a turn hands off its own streams on the outgoing
server: the unstarted ones move to the incoming server, the running ones finish within
`turns.finish_within_s` and are then ended with an error in their API's shape. (The
controller waits for the outgoing server's own count, /v1/loads, to reach 0 within the same
bound before it pauses: every replica's streams.)

When the controller does not answer, the servers' readiness decides: the one server answering
/ready 200 is the holder (a paused server answers 503); none or both: the requests wait.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from gateway.apis.errors import GatewayError
from gateway.config import ROLES, Role
from gateway.turns.handles import PairHandles
from gateway.turns.state import PHASES, Phase, other
from gateway.upstream.client import Upstream

log = logging.getLogger("mtp_gateway.turns")

FOLLOW_EVERY_S = 0.1


class FollowDriver:
    def __init__(self, pair: PairHandles, upstream: Upstream, controller_url: str) -> None:
        self.pair = pair
        self.upstream = upstream
        self.url = controller_url.rstrip("/") + "/turns/state"
        self.remote: dict[str, Any] = {"phase": "discovering", "holder": None,
                                       "admitting": None}
        self.source: Role | None = None  # the server a turn in progress leaves
        self.turn_seen_at = 0.0
        self.ended_running = False
        self.via = "controller"  # or "readiness", when the controller does not answer
        pair.park(self.admitting)

    # --- what the pool, the metrics and /admin/state read -------------------------------------

    @property
    def admitting(self) -> Role | None:
        value = self.remote.get("admitting")
        return value if value in ROLES else None

    @property
    def holder(self) -> Role | None:
        value = self.remote.get("holder")
        return value if value in ROLES else None

    @property
    def phase(self) -> Phase:
        value = self.remote.get("phase")
        return value if value in PHASES else "discovering"

    @property
    def waiting_for_turn(self) -> bool:
        return self.phase in ("discovering", "settling", "handing")

    def describe(self) -> dict[str, Any]:
        return {**self.remote, "following": self.url, "via": self.via}

    # --- the task ----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                self._mirror(await self._read())
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop following
                log.exception("pair %s: following %s failed", self.pair.name, self.url)
            await asyncio.sleep(FOLLOW_EVERY_S)

    async def _read(self) -> dict[str, Any]:
        timeout = self.pair.turns.call_timeout_s
        try:
            status, body = await self.upstream.request("GET", self.url, [], None, timeout)
            answer = json.loads(body)["pairs"][self.pair.name] if status == 200 else None
        except (GatewayError, ValueError, KeyError, TypeError):  # down, or not its answer
            answer = None
        if isinstance(answer, dict):
            self.via = "controller"
            return answer
        if self.via == "controller":
            log.warning("pair %s: controller %s does not answer: following the servers' "
                        "readiness", self.pair.name, self.url)
        self.via = "readiness"
        ready = await asyncio.gather(*(self.pair.controls[role].ready(timeout) for role in ROLES))
        serving = [role for role, ok in zip(ROLES, ready, strict=True) if ok]
        holder = serving[0] if len(serving) == 1 else None
        return {"phase": "holding" if holder else "discovering", "holder": holder,
                "admitting": holder}

    def _mirror(self, remote: dict[str, Any]) -> None:
        before = self.admitting
        self.remote = remote
        if self.phase == "handing" and self.source is None:
            target = remote.get("target")
            if target in ROLES:
                self.source, self.turn_seen_at, self.ended_running = other(target), self.pair.clock(), False
        if self.source is not None:
            self._continue_running(self.source)
            if self.phase != "handing":
                self.source = None
        self.pair.park(self.admitting)
        if self.admitting != before:
            self.pair.on_change()

    def _continue_running(self, source: Role) -> None:
        """This replica's own streams on the outgoing server, as the controller does its own."""
        outgoing, incoming = self.pair.backends[source], self.pair.backends[other(source)]
        self.pair.streams.move_all_unstarted(outgoing, incoming)
        late = self.pair.clock() - self.turn_seen_at >= self.pair.turns.finish_within_s
        if late and outgoing.inflight and not self.ended_running:
            self.ended_running = True
            ended = self.pair.streams.end_running(outgoing, "memory_turn")
            log.warning("pair %s: %d streams on %s did not finish within %g s of the turn: "
                        "ended with an error", self.pair.name, ended, outgoing.name,
                        self.pair.turns.finish_within_s)
