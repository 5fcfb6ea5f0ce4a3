"""Control endpoints of a simulated server: SGLang's /abort_request, and the simulator's own
``POST``/``DELETE /sim/faults`` and ``GET /sim/state`` (see faults.py)."""

from __future__ import annotations

from dataclasses import asdict

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.sim.context import ServerContext
from gateway.sim.faults import Faults
from gateway.sim.replies import json_response, openai_error
from gateway.sim.requests import RequestError, read_json


class Admin:
    def __init__(self, context: ServerContext) -> None:
        self.identity = context.identity
        self.live = context.live
        self.faults = context.faults
        self.profile = context.profile
        self.saver = context.saver

    def routes(self) -> list[Route]:
        return [
            Route("/abort_request", self.abort_request, methods=["POST"]),
            Route("/sim/faults", self.set_faults, methods=["POST"]),
            Route("/sim/faults", self.clear_faults, methods=["DELETE"]),
            Route("/sim/state", self.state, methods=["GET"]),
        ]

    async def abort_request(self, request: Request) -> Response:
        """tokenizer_manager.py:2241: an empty rid without abort_all is ignored, and so is a rid
        the server is not running (a prefix, an `n > 1` parent rid, a finished request): only
        a known rid reaches the scheduler, whose prefix match (scheduler.py:5688) then also
        takes the requests it prefixes."""
        try:
            body = await read_json(request)
        except RequestError as exc:
            return openai_error(exc.status, str(exc), exc.err_type)
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all"))
        if abort_all or rid in self.live.engine:
            self.live.abort(rid, abort_all)
        return Response(status_code=200)

    # --- sim admin -----------------------------------------------------------------------

    async def set_faults(self, request: Request) -> Response:
        try:
            faults = Faults.from_json(await read_json(request))
        except (RequestError, ValueError, TypeError) as exc:
            return openai_error(400, str(exc), "BadRequestError")
        await self.faults.set(faults)
        return json_response({"faults": asdict(faults)})

    async def clear_faults(self, request: Request) -> Response:
        await self.faults.clear()
        return json_response({"faults": asdict(self.faults.faults)})

    async def state(self, request: Request) -> Response:
        engine = self.live.engine
        return json_response({
            "backend": self.identity.name, "faults": asdict(self.faults.faults),
            "num_running_reqs": engine.num_running, "num_waiting_reqs": engine.num_waiting,
            "effective_max_running_requests": self.profile.effective_max_running,
            "generated_tokens": engine.stats.generated_tokens,
            "avg_spec_accept_length": engine.stats.avg_spec_accept_length,
            "speed": self.live.speed,
            "memory": self._memory(),
        })  # fmt: skip

    def _memory(self) -> dict[str, object]:
        """The memory saver, sim-only (SGLang shows none of this): paused, released tags, this
        server's and the shared device's memory per GPU, requests waiting in the tokenizer."""
        engine, device = self.live.engine, self.saver.device
        return {**self.saver.state.view(), "held_gib": round(device.holding(self.identity.name), 3),
                "device_free_gib": _finite(device.free_gib), "num_held_requests": self.live.num_held,
                "retracted_requests": engine.stats.retracted_requests,
                "reprefill_tokens": engine.stats.reprefill_tokens}  # fmt: skip


def _finite(value: float) -> float | None:
    return None if value == float("inf") else round(value, 3)
