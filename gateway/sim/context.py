"""What every endpoint family of one simulated server shares: who it is, its engine, faults,
metrics and stored responses (one owner each: the server that builds this)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.sim.faults import FaultState
from gateway.sim.live import LiveEngine
from gateway.sim.metrics import SimMetrics
from gateway.sim.profile import Profile
from gateway.sim.responses_store import ResponsesStore
from gateway.sim.saver import MemorySaver


@dataclass
class ServerIdentity:
    """What the server says about itself in /server_info (the port is known after binding)."""

    name: str  # "mtp" or "plain"
    host: str
    port: int
    seed: int


@dataclass
class ServerContext:
    identity: ServerIdentity
    live: LiveEngine
    faults: FaultState
    responses_store: ResponsesStore
    saver: MemorySaver
    header_overrides: bool = False  # SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES: x-override-rid
    started: float = field(default_factory=time.time)
    metrics: SimMetrics = field(init=False)
    # server_status: Up, or UnHealthy once a /health timed out (http_server.py:798) until one
    # succeeds again (:784); /ready and /ping read it (tokenizer_manager.py:728-734).
    healthy: bool = True

    def __post_init__(self) -> None:
        self.metrics = SimMetrics(self.live.engine, self.live.speed)

    @property
    def profile(self) -> Profile:
        return self.live.engine.profile
