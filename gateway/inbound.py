"""Pure functions over the incoming request: validate, extract routing facts, build the
upstream headers and body. No I/O; the relay calls these once per request.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from gateway.config import BACKEND_NAMES, BackendName
from gateway.errors import BadRequest, UnsupportedMediaType

Headers = list[tuple[bytes, bytes]]
T = TypeVar("T")
_EMPTY_REST = re.compile(rb"[ \t\r\n]*}")  # what follows "{" in an empty object (JSON whitespace)
Body = tuple[bytes | memoryview, ...]  # written upstream one after the other, never joined

# Paths the gateway proxies, and the field each one needs (None: only "a JSON object").
PROXY_PATHS: dict[str, str | None] = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages",
    "/v1/responses": "input",
    "/v1/embeddings": "input",
    "/v1/rerank": None,
    "/v1/score": None,
    "/v1/classify": None,
    "/v1/tokenize": None,
    "/v1/detokenize": None,
}
# Endpoints where SGLang takes a client `rid`: setting it lets the gateway abort by id.
RID_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

# Request ids: random per process (no clash between gateway replicas), then a counter, so
# no system call per request; 32 hex characters like SGLang's own.
_RID_PREFIX = f"{secrets.randbits(64):016x}"
_rids = (f"{_RID_PREFIX}{n:016x}" for n in itertools.count())

# Never forwarded: they describe this hop, or carry the client's credentials to the gateway.
_DROP_REQUEST_HEADERS = frozenset({
    b"host", b"connection", b"keep-alive", b"proxy-authorization", b"proxy-connection", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"authorization",
    b"x-api-key", b"cookie", b"expect", b"x-gateway-pin", b"accept-encoding",
})


@dataclass(frozen=True, slots=True)
class Inbound:
    """What the gateway needs from one proxied request."""

    path: str
    body: Body  # what goes upstream, in pieces: the client's bytes, plus a rid where SGLang takes one
    stream: bool
    model: str | None
    session: str | None
    pin: BackendName | None
    rid: str | None


def header(headers: Headers, name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def check_content_type(headers: Headers) -> None:
    content_type = header(headers, b"content-type") or ""
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise UnsupportedMediaType("Content-Type must be application/json")


class RequestFields(msgspec.Struct):
    """The top-level fields the gateway reads. The rest of the body is checked as JSON and
    skipped; the big fields (the conversation) stay raw bytes, never become Python objects."""

    model: Any = UNSET
    stream: Any = UNSET
    rid: Any = UNSET
    user: Any = UNSET
    metadata: Any = UNSET  # Anthropic Messages: metadata.user_id
    messages: msgspec.Raw | UnsetType = UNSET
    prompt: msgspec.Raw | UnsetType = UNSET
    input: msgspec.Raw | UnsetType = UNSET


_decode_fields = msgspec.json.Decoder(RequestFields).decode
_decode_any = msgspec.json.Decoder().decode


def _decoded(decode: Callable[[bytes], T], body: bytes) -> T:
    """JSON is UTF-8 (RFC 8259), checked in full first: msgspec does not look inside the strings
    it skips, and invalid UTF-8 or UTF-8-encoded surrogates (b"\xed\xa0\x80") would fail in
    the backend with a 500 that counts against a healthy backend's circuit. They are the
    client's 400 here. CPython's decoder does it at memory speed."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest("request body is not valid UTF-8") from exc
    try:
        return decode(body)
    except msgspec.ValidationError as exc:  # the only type declared: an object at the top
        raise BadRequest("request body must be a JSON object") from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc


def parse_json_object(body: bytes) -> dict[str, Any]:
    data = _decoded(_decode_any, body)
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def parse_fields(body: bytes) -> RequestFields:
    """Only the fields the gateway reads become Python objects: a full parse of a 400 KB agent
    context builds thousands, for nothing (docs/perf/profile-c128.md)."""
    return _decoded(_decode_fields, body)


def validate_fields(path: str, fields: RequestFields) -> None:
    required = PROXY_PATHS.get(path)
    if required is not None and getattr(fields, required) is UNSET:
        raise BadRequest(f"missing required field '{required}'")
    for value, kind, label in ((fields.stream, bool, "stream' must be a boolean"),
                               (fields.model, str, "model' must be a string")):
        if value is not UNSET and value is not None and not isinstance(value, kind):
            raise BadRequest(f"'{label}")
    if path == "/v1/chat/completions" and not _is_array(fields.messages):
        raise BadRequest("'messages' must be an array")


def _is_array(raw: msgspec.Raw | UnsetType) -> bool:
    return raw is not UNSET and memoryview(raw)[:1] == b"["


def session_of(headers: Headers, fields: RequestFields, session_headers: tuple[str, ...]) -> str | None:
    for name in session_headers:
        value = header(headers, name.lower().encode("latin-1"))
        if value:
            return value
    user = fields.user
    if isinstance(user, str) and user:
        return user
    metadata = fields.metadata
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        return metadata["user_id"]
    return None


def pin_of(headers: Headers, allowed: bool) -> BackendName | None:
    value = header(headers, b"x-gateway-pin")
    if value is None or not allowed:
        return None
    if value not in BACKEND_NAMES:
        raise BadRequest(f"x-gateway-pin must be one of {', '.join(BACKEND_NAMES)}")
    return value  # type: ignore[return-value]


def with_rid(body: bytes, fields: RequestFields) -> tuple[Body, str | None]:
    """Give the request an id SGLang will use, by splicing bytes rather than re-encoding: the
    id goes in a small piece of its own, the client's bytes follow as a view (no copy)."""
    if fields.rid is not UNSET:
        existing = fields.rid
        return (body,), existing if isinstance(existing, str) and existing else None
    if not body.lstrip().startswith(b"{"):
        return (body,), None  # e.g. UTF-16: leave it alone rather than guess
    rid = next(_rids)
    start = body.index(b"{") + 1
    separator = b"" if _EMPTY_REST.match(body, start) else b","
    head = b'%s"rid":"%s"%s' % (body[:start], rid.encode(), separator)
    return (head, memoryview(body)[start:]), rid


def parse_inbound(path: str, headers: Headers, body: bytes, *, session_headers: tuple[str, ...],
                  allow_pin: bool) -> Inbound:
    check_content_type(headers)
    fields = parse_fields(body)
    validate_fields(path, fields)
    rid = None
    parts: Body = (body,)
    if path in RID_PATHS:
        parts, rid = with_rid(body, fields)
    return Inbound(
        path=path,
        body=parts,
        stream=fields.stream is True,
        model=fields.model if isinstance(fields.model, str) else None,
        session=session_of(headers, fields, session_headers),
        pin=pin_of(headers, allow_pin),
        rid=rid,
    )


def upstream_headers(headers: Headers, api_key: str | None) -> list[tuple[bytes, bytes]]:
    drop = _DROP_REQUEST_HEADERS
    for key, value in headers:
        # Headers named in Connection describe this hop only (RFC 9110 7.6.1).
        if key == b"connection" and value.lower() not in (b"keep-alive", b"close"):
            drop = drop | {token.strip().lower() for token in value.split(b",")}
    kept = [(key, value) for key, value in headers if key not in drop]
    if api_key:
        kept.append((b"authorization", b"Bearer " + api_key.encode("latin-1")))
    return kept


def bearer_token(headers: Headers) -> str | None:
    """The client's key: `Authorization: Bearer` (OpenAI) or `x-api-key` (Anthropic)."""
    auth = header(headers, b"authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return header(headers, b"x-api-key")
