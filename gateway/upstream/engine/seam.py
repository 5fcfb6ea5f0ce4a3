"""Which engine module serves a backend: the seam's names (gateway/upstream/engine/__init__.py)
as a protocol each module meets, and the one lookup from a backend's engine
(`Settings.engine_of`, carried by its `BackendState`) to its module. The core asks
`engine_of(backend)` and uses what it names; nothing else tells engines apart."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from gateway.config import Backend, EngineName
from gateway.routing.backend import BackendState
from gateway.upstream.client import Header, Upstream
from gateway.upstream.engine import sglang, vllm
from gateway.upstream.engine.probe import Probe, SaverReport


class Control(Protocol):
    """The calls to one server of a turns pair that every engine answers (the engine's own
    hand-over calls are its class's: SGLang's `MemorySaver`, vLLM's `SleepControl`)."""

    name: str

    async def probe(self, timeout_s: float) -> Probe: ...

    async def busy(self, timeout_s: float) -> int | None: ...

    async def ready(self, timeout_s: float) -> bool: ...

    async def accept_length(self, timeout_s: float) -> float | None: ...


class Engine(Protocol):
    """What the core uses of an engine module."""

    @property
    def LOADS(self) -> str: ...  # noqa: N802 (module constants)

    @property
    def SERVER_INFO(self) -> str: ...  # noqa: N802

    @property
    def MODELS(self) -> str: ...  # noqa: N802

    @property
    def NOT_PROVIDED(self) -> tuple[int, ...]: ...  # noqa: N802

    @property
    def ABORT(self) -> str | None: ...  # noqa: N802 (None: a closed connection aborts)

    @property
    def USAGE_CHUNK(self) -> bytes: ...  # noqa: N802

    def probe_headers(self, target: Backend) -> list[Header]: ...

    def parse_loads(self, body: Any) -> tuple[int, int] | None: ...

    def parse_server_info(self, info: Any) -> tuple[int | None, float | None]: ...

    def usage_by_default(self, info: Any) -> bool: ...

    async def read_memory_saver(self, upstream: Upstream, target: Backend,
                                timeout_s: float) -> SaverReport: ...  # `memory: auto`

    async def abort(self, upstream: Upstream, target: Backend, name: str, rid: str) -> None: ...

    def control(self, upstream: Upstream, target: Backend, name: str) -> Control: ...


ENGINES: Mapping[EngineName, Engine] = {"sglang": sglang, "vllm": vllm}


def engine_of(backend: BackendState) -> Engine:
    return ENGINES[backend.engine]
