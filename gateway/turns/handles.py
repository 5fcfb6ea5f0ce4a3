"""What a turns pair's task works through: its servers, their engine's hand-over calls
(SGLang's memory saver, vLLM's sleep mode), the relay's streams, the settings and the clock.
One value per pair, built by gateway/turns/wiring.py and held by the pair's one task: the
controller's driver (gateway/turns/driver.py) or a replica that follows it
(gateway/turns/follow.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.config import Role, Turns
from gateway.routing.backend import BackendState
from gateway.upstream.engine.seam import Control


class Streams(Protocol):
    """What the relay does for a turn (gateway/relay/endpoint.py)."""

    def move_all_unstarted(self, source: BackendState, target: BackendState) -> int:
        """Move every stream on `source` that has sent no byte to `target`; how many."""
        ...

    def running_tokens(self, source: BackendState, tokens_per_piece: float) -> int:
        """Prompt + output tokens of `source`'s running streams: what a hand-off re-prefills."""
        ...

    def end_running(self, source: BackendState, why: str) -> int:
        """End every request still on `source` with an error in its API's shape; how many."""
        ...

    async def continue_running(self, source: BackendState, target: BackendState, *,
                       timeout_s: float = 10.0) -> Any:
        """Continue `source`'s running streams on `target` from what their clients have
        (gateway/relay/in_flight.py); those that cannot be stay on `source`."""
        ...


@dataclass(frozen=True, eq=False)
class PairHandles:
    name: str
    backends: Mapping[Role, BackendState]
    controls: Mapping[Role, Control]  # the engine's calls to each server (seam.Engine.control)
    streams: Streams
    turns: Turns
    on_change: Callable[[], None] = lambda: None  # where new requests may go changed
    clock: Callable[[], float] = time.monotonic

    def park(self, admitting: Role | None) -> None:
        """The server not admitting is parked: the monitor leaves it alone (a paused SGLang
        server answers 503 on /ready and /health, HS:714-798, and is not down; a sleeping vLLM
        server's load says nothing)."""
        for role, backend in self.backends.items():
            backend.set_parked(role != admitting)
