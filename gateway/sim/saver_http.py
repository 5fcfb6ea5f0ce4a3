"""The memory saver's four endpoints, as SGLang 0.5.23 answers them (http_server.py:1575-1595,
1831-1855; admin-optional auth, utils/auth.py:133-147): ``/pause_generation``,
``/continue_generation`` (200 with a message), ``/release_memory_occupation`` and
``/resume_memory_occupation`` (GET or POST; 200 ``null`` once done, however long that takes).
A body the request model refuses is FastAPI's validation error, which SGLang turns into a 400
(http_server.py:635-690)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.sim.replies import json_response, openai_error
from gateway.sim.requests import RequestError, read_json
from gateway.sim.saver import MemorySaver, SaverError, ServerDied, parse_mode, parse_tags

PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}
SAVER_PATHS = frozenset({"/pause_generation", "/continue_generation", "/release_memory_occupation",
                         "/resume_memory_occupation"})  # fmt: skip


class MemorySaverEndpoints:
    def __init__(self, saver: MemorySaver) -> None:
        self.saver = saver

    def routes(self) -> list[Route]:
        both = ["GET", "POST"]
        return [
            Route("/pause_generation", self.pause_generation, methods=["POST"]),
            Route("/continue_generation", self.continue_generation, methods=["POST"]),
            Route("/release_memory_occupation", self.release, methods=both),
            Route("/resume_memory_occupation", self.resume, methods=both),
        ]

    async def pause_generation(self, request: Request) -> Response:
        try:
            mode = parse_mode(await _body(request))
        except SaverError as exc:
            return _invalid(exc)
        try:
            await self.saver.pause(mode)
        except ServerDied:
            return _never_sent()
        return json_response(PAUSED)

    async def continue_generation(self, request: Request) -> Response:
        try:
            await _body(request)
        except SaverError as exc:
            return _invalid(exc)
        await self.saver.continue_generation()
        return json_response(CONTINUED)

    async def release(self, request: Request) -> Response:
        try:
            tags = parse_tags(await _body(request))
        except SaverError as exc:
            return _invalid(exc)
        try:
            await self.saver.release(tags)
        except ServerDied:
            return _never_sent()
        return json_response(None)

    async def resume(self, request: Request) -> Response:
        try:
            tags = parse_tags(await _body(request))
        except SaverError as exc:
            return _invalid(exc)
        try:
            await self.saver.resume(tags)
        except ServerDied:
            return _never_sent()
        return json_response(None)


async def _body(request: Request) -> object:
    """The JSON body; a missing one is "Field required" (the model is a required Body())."""
    if not await request.body():
        raise SaverError("body: Field required")
    try:
        return await read_json(request, require_json_type=False)
    except RequestError as exc:
        raise SaverError(str(exc)) from exc


def _invalid(exc: SaverError) -> Response:
    return openai_error(400, str(exc), "Bad Request")


def _never_sent() -> Response:
    # The server died with this request open; its connections are already closed, so nothing
    # of this answer reaches the client (uvicorn drops a send on a closed connection).
    return Response(status_code=500)
