"""Errors the gateway raises, and their one mapping to JSON in the shape of each API:
OpenAI (chat, completions and the rest), Anthropic (/v1/messages), Responses (/v1/responses).

    GatewayError                      status, type, code
    ├── ClientError                   4xx: the caller's mistake
    │   ├── BadRequest                400 invalid_request_error
    │   ├── Unauthorized              401 authentication_error
    │   ├── Forbidden                 403 permission_error
    │   ├── NotFound                  404 not_found_error
    │   ├── MethodNotAllowed          405
    │   ├── RequestTimeout            408 the client stopped sending its body
    │   ├── PayloadTooLarge           413
    │   ├── UnsupportedMediaType      415
    │   ├── HeadersTooLarge           431 (answered by the HTTP protocol layer, see server.py)
    │   └── Overloaded                429 (Retry-After)
    └── UpstreamError                 5xx: a backend failed us
        ├── NoBackend                 503 no healthy backend
        ├── UpstreamConnectError      502 connection refused / reset before a response
        ├── UpstreamTimeout           504 a timeout fired (kind names which)
        ├── UpstreamBroken            502 the backend closed a response half way
        ├── UpstreamStatus            the backend's own 5xx status, passed on
        ├── UpstreamRefused           the backend's own answer was an error (in a 200 stream)
        └── UpstreamStreamError       the backend ended a begun stream with an error event
    RelayError                        500 the gateway failed writing to its client (not the backend's)
    ShuttingDown                      503 the gateway is shutting down
    EndedByTurn                       503 a turns pair handed its memory over mid-request
"""

from __future__ import annotations

import json

from gateway.apis import ANTHROPIC_API, OPENAI_API


class GatewayError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"
    kind = "internal"  # bounded label for metrics

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def body(self, api: str = OPENAI_API) -> dict[str, object]:
        if api == ANTHROPIC_API:
            return anthropic_error(self.status, self.message)
        return {"error": {"message": self.message, "type": self.type, "param": None,
                          "code": self.code}}

    def to_bytes(self, api: str = OPENAI_API) -> bytes:
        return json.dumps(self.body(api)).encode()


def let_go(error: BaseException | None) -> None:
    """Free a handled failure's tracebacks now. They hold the frames the failure went through,
    and those often hold the failure (a response keeps its error, a stream its failure for a
    continuation): a cycle with the request's objects in it that only the garbage collector
    would free, and the gateway runs it seldom (`cli.tune_process`)."""
    while error is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


class ClientError(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    kind = "client"


class BadRequest(ClientError):
    pass


class Unauthorized(ClientError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class Forbidden(ClientError):
    status, type, code = 403, "permission_error", "forbidden"


class NotFound(ClientError):
    status, type, code = 404, "not_found_error", "not_found"


class MethodNotAllowed(ClientError):
    status, code = 405, "method_not_allowed"


class RequestTimeout(ClientError):
    status, code = 408, "request_timeout"


class PayloadTooLarge(ClientError):
    status, code = 413, "request_too_large"


class HeadersTooLarge(ClientError):
    status, code = 431, "request_header_too_large"


class UnsupportedMediaType(ClientError):
    status, code = 415, "unsupported_media_type"


class Overloaded(ClientError):
    status, type, code = 429, "rate_limit_error", "gateway_overloaded"


class UpstreamError(GatewayError):
    status, type, code, kind = 502, "server_error", "upstream_error", "upstream"


class NoBackend(UpstreamError):
    status, code, kind = 503, "no_backend_available", "no_backend"


def no_healthy_backend(why: str = "") -> NoBackend:
    """Every server that could take the request is down, or its circuit is open."""
    return NoBackend("no healthy backend: all are down or their circuits are open"
                     + (f"; {why}" if why else ""), headers={"retry-after": "5"})


class UpstreamConnectError(UpstreamError):
    code, kind = "upstream_connect_error", "connect"


class UpstreamTimeout(UpstreamError):
    status, code = 504, "upstream_timeout"

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind  # timeout_connect | timeout_first_byte | timeout_idle | timeout_total


class UpstreamBroken(UpstreamError):
    code, kind = "upstream_stream_broken", "broken_stream"


class ContinuedElsewhere(UpstreamError):
    """A running stream taken off its server by a hand-off (no failure of the server's)."""

    code, kind = "handed_off", "handed_off"


class UpstreamStatus(UpstreamError):
    """The backend answered 5xx: OpenAI-shaped, keeping the backend's status."""

    kind = "status_5xx"

    def __init__(self, status: int, backend: str, detail: str) -> None:
        super().__init__(f"backend '{backend}' failed with HTTP {status}: {detail}")
        self.status = status


class UpstreamRefused(UpstreamError):
    """A stream whose first event is an error (SGLang's full queue or abort, in a 200).

    Nothing has gone to the client: it may be retried elsewhere. When it cannot be, the
    client gets the backend's own stream as it is (`head`, then the rest of the response):
    its error, in its API's shape."""

    kind = "stream_error"

    def __init__(self, status: int, backend: str, detail: str, head: bytes) -> None:
        super().__init__(f"backend '{backend}' refused the request in its stream "
                         f"({status}): {detail}")
        self.status = status
        self.head = head


class UpstreamStreamError(UpstreamError):
    """The backend ended a stream with an error event of its own, after its first byte."""

    kind = "stream_error"


class RelayError(GatewayError):
    """Writing to the client failed in the gateway itself: never the backend's failure."""

    kind = "relay"


class ShuttingDown(GatewayError):
    status, type, code, kind = 503, "server_error", "gateway_shutting_down", "shutdown"


class EndedByTurn(GatewayError):
    """A turns pair handed its memory over before this request finished (gateway/turns)."""

    status, type, code, kind = 503, "server_error", "memory_turn", "memory_turn"


# Anthropic error types by HTTP status, as SGLang maps them (anthropic/serving.py:74-85).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "request_timeout_error", 429: "rate_limit_error",
    500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "api_error",
}
ANTHROPIC_STATUS = {kind: status for status, kind in ANTHROPIC_ERROR_TYPES.items()
                    if kind != "api_error"} | {"api_error": 502}


def anthropic_error(status: int, message: str) -> dict[str, object]:
    """The Anthropic envelope (anthropic/protocol.py AnthropicErrorResponse)."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def openai_shaped(body: bytes) -> bytes:
    """A backend's HTTP error body in OpenAI's shape. SGLang answers with a flat object
    (`{"object": "error", "message", "type", "param", "code"}`); OpenAI clients look under
    "error". Wrapped with every field kept; any other body passes unchanged."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or data.get("object") != "error" or "message" not in data:
        return body
    return json.dumps({"error": {k: v for k, v in data.items() if k != "object"}}).encode()
