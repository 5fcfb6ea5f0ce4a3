"""The HTTP app of one simulated SGLang 0.5.23 server (Starlette), assembled from its endpoint
families, one module each:

- generation.py: chat, completions, Messages, Responses (and stored responses), /generate;
  parsing.py turns their bodies into jobs;
- info.py: models, /model_info, /server_info, /v1/loads, /metrics;
- health.py: /health, /health_generate, /ready;
- admin.py: /abort_request and the sim-only /sim/faults, /sim/state;
- saver_http.py: the memory saver's /pause_generation, /continue_generation,
  /release_memory_occupation, /resume_memory_occupation (saver.py is the model behind them);
- tokenize.py: /tokenize, /detokenize, count_tokens, the embedding/classify 400s;
- auth.py: --api-key / --admin-api-key; replies.py: JSON and each API's error envelope.

Routes, JSON shapes, SSE bytes, error envelopes and disconnect behaviour follow SGLang 0.5.23
(``docs/compat.md``: row by row, with its source lines); the engine behind it is a
:class:`LiveEngine`.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp

from gateway.sim.admin import Admin
from gateway.sim.auth import ApiKeyMiddleware
from gateway.sim.context import ServerContext, ServerIdentity
from gateway.sim.faults import FaultState
from gateway.sim.generation import Generation
from gateway.sim.health import Health
from gateway.sim.info import Info
from gateway.sim.live import LiveEngine
from gateway.sim.parsing import JobParser
from gateway.sim.responses_store import ResponsesStore
from gateway.sim.saver import MemorySaver
from gateway.sim.saver_http import MemorySaverEndpoints
from gateway.sim.tokenize import Tokenization

__all__ = ["ServerIdentity", "SimApp"]


class SimApp:
    """The endpoint families of one simulated server; ``build()`` makes the ASGI app."""

    def __init__(self, identity: ServerIdentity, live: LiveEngine, faults: FaultState, saver: MemorySaver,
                 enable_response_store: bool = False, header_overrides: bool = False) -> None:  # fmt: skip
        self.context = ServerContext(identity, live, faults, ResponsesStore(enable_response_store),
                                     saver, header_overrides)  # fmt: skip
        parser = JobParser(self.context)
        self.generation = Generation(self.context, parser)
        self.info = Info(self.context)
        self.health = Health(self.context)
        self.admin = Admin(self.context)
        self.tokenization = Tokenization(self.context, parser)
        self.memory_saver = MemorySaverEndpoints(saver)

    def build(self, api_key: str | None = None, admin_api_key: str | None = None) -> ASGIApp:
        app = Starlette(routes=self.routes())
        return ApiKeyMiddleware(app, api_key, admin_api_key) if api_key or admin_api_key else app

    def routes(self) -> list[Route]:
        families = (self.generation, self.tokenization, self.info, self.health, self.admin,
                    self.memory_saver)
        return [route for family in families for route in family.routes()]
