"""How a simulated SGLang server answers: compact JSON, and each API's error envelope for a
request refused before any output (validation, a sim fault) or aborted by the scheduler with an
HTTP status (a full queue: 503). ``CrashResponse`` is the crash fault's half-sent answer."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.sim import formats
from gateway.sim.requests import RequestError


class SimulatedCrash(Exception):
    """Raised inside a response so uvicorn drops the connection mid-way (crash fault)."""


def json_response(body: Any, status: int = 200) -> Response:
    # Compact, as SGLang's ORJSONResponse writes it.
    return Response(formats.compact(body), status, media_type="application/json")


def openai_error(status: int, message: str, err_type: str) -> Response:
    return json_response(formats.openai_error_body(status, message, err_type), status)


# How each API answers a request refused before any output (validation, a sim fault) ...


def openai_refusal(exc: RequestError) -> Response:
    """serving_base.py:205, flat."""
    return openai_error(exc.status, str(exc), exc.err_type)


def anthropic_refusal(exc: RequestError) -> Response:
    """anthropic/serving.py:1409: ``{"type": "error", "error": {type, message}}``."""
    return json_response(formats.anthropic_error_body(exc.status, str(exc)), exc.status)


def responses_refusal(exc: RequestError) -> Response:
    """serving_responses.py:246, nested under "error"."""
    err_type = "invalid_request_error" if exc.err_type == "BadRequestError" else exc.err_type
    return json_response(formats.responses_error_body(exc.status, str(exc), err_type, exc.param), exc.status)


def generate_refusal(exc: RequestError) -> Response:
    """http_server.py:2246 (_create_error_response): ``{"error": {"message"}}``."""
    return json_response({"error": {"message": str(exc)}}, exc.status)


# ... and a non-stream request the scheduler aborted with an HTTP status (a full queue: 503).
# tokenizer_manager.py:1917 raises ValueError for a 400, HTTPException otherwise.


def openai_aborted(status: int, message: str) -> Response:
    """serving_base.py:117: HTTPException -> type str(status)."""
    return openai_error(status, message, "BadRequestError" if status == 400 else str(status))


def anthropic_aborted(status: int, message: str) -> Response:
    """anthropic/serving.py:780: a 5xx message is scrubbed to "Internal server error". A 400
    (a ValueError) is caught by the chat handler first and comes back as its flat error, whose
    4xx type the converter keeps (anthropic/serving.py:1393): "BadRequestError"."""
    if status == 400:
        body = {"type": "error", "error": {"type": "BadRequestError", "message": message}}
        return json_response(body, 400)
    return anthropic_refusal(RequestError("Internal server error" if status >= 500 else message, status))


def responses_aborted(status: int, message: str) -> Response:
    """serving_responses.py:730: the HTTPException is caught as any exception and becomes a 400
    whose message is str(exc), "503: The request queue is full."."""
    text = message if status == 400 else f"{status}: {message}"
    return responses_refusal(RequestError(text, err_type="invalid_request_error"))


def generate_aborted(status: int, message: str) -> Response:
    """A 400 is the ValueError above; another status is FastAPI's HTTPException handler,
    flat (http_server.py:624)."""
    if status == 400:
        return generate_refusal(RequestError(message))
    return openai_error(status, message, str(status))


class CrashResponse(Response):
    """Sends the headers, then drops the connection (a crash before the body)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Promise a body that never comes, so the client sees a truncated response.
        headers = [(b"content-type", b"application/json"), (b"content-length", b"1000")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        raise SimulatedCrash
