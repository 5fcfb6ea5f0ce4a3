"""Pure functions over the incoming request: validate, extract routing facts, build the
upstream headers and body. No I/O; the relay calls these once per request.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType
from pydantic import TypeAdapter, ValidationError

from gateway.apis import CHAT, COMPLETIONS, OPENAI_API, PROXY_PATHS, api_of
from gateway.apis.errors import BadRequest, UnsupportedMediaType
from gateway.config import ROLES, Models, Role
from gateway.upstream.engine import sglang as engine

Headers = list[tuple[bytes, bytes]]
T = TypeVar("T")
_EMPTY_REST = re.compile(rb"[ \t\r\n]*}")  # what follows "{" in an empty object (JSON whitespace)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes and all
# The next member of an object: its comma (none for the first), its name's bytes, its colon.
_MEMBER = re.compile(rb'[ \t\r\n]*(,?)[ \t\r\n]*"([^"\\]*(?:\\.[^"\\]*)*)"[ \t\r\n]*:[ \t\r\n]*')
Body = tuple[bytes | memoryview, ...]  # written upstream one after the other, never joined

# Streams that end with a usage chunk when asked (stream_options.include_usage).
USAGE_PATHS = frozenset({CHAT, COMPLETIONS})
_as_bool = TypeAdapter(bool).validate_python  # how SGLang's pydantic models read `stream`


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
    pin: Role | None
    rid: str | None
    api: str = OPENAI_API
    abort_rids: tuple[str, ...] = ()  # what /abort_request must name to stop all of its work
    headers: tuple[tuple[bytes, bytes], ...] = ()  # added to the upstream request
    previous_response_id: str | None = None  # /v1/responses: a stored response it continues
    usage_asked: bool = False  # the gateway asked for the usage chunk its client did not ask for


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
    request_id: Any = UNSET  # /v1/responses
    previous_response_id: Any = UNSET
    stream_options: Any = UNSET
    n: Any = UNSET
    sampling_params: Any = UNSET  # /generate: n lives there
    text: msgspec.Raw | UnsetType = UNSET  # /generate
    input_ids: msgspec.Raw | UnsetType = UNSET
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
    context builds thousands, for nothing (lab/results/perf/profile-c128.md)."""
    return _decoded(_decode_fields, body)


def validate_fields(path: str, fields: RequestFields) -> None:
    required = PROXY_PATHS.get(path)
    if required is not None and getattr(fields, required) is UNSET:
        raise BadRequest(f"missing required field '{required}'")
    model = fields.model
    if model is not UNSET and model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    if path == "/v1/chat/completions" and not _is_array(fields.messages):
        raise BadRequest("'messages' must be an array")


def is_stream(value: Any) -> bool:
    """`stream` as SGLang's pydantic models read it: true, 1, "true", "yes", "on", ... (lax
    bool); a value pydantic refuses is the client's 400 here too."""
    if value is True or value is False:
        return value
    if value is UNSET or value is None:
        return False
    try:
        return _as_bool(value)
    except ValidationError:
        raise BadRequest("'stream' must be a boolean") from None


def _is_array(raw: msgspec.Raw | UnsetType) -> bool:
    return raw is not UNSET and memoryview(raw)[:1].tobytes() == b"["


def session_of(headers: Headers, fields: RequestFields, session_headers: tuple[str, ...]) -> str | None:
    for name in session_headers:
        value = header(headers, name.lower().encode("latin-1"))
        if value:
            return value
    user = fields.user
    if isinstance(user, str) and user:
        return user
    metadata = fields.metadata
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user_id if isinstance(user_id, str) else None


def pin_of(headers: Headers, allowed: bool) -> Role | None:
    value = header(headers, b"x-gateway-pin")
    if value is None or not allowed:
        return None
    if value not in ROLES:
        raise BadRequest(f"x-gateway-pin must be one of {', '.join(ROLES)}")
    return value


def with_rid(body: bytes, fields: RequestFields, name: str = "rid",
             prefix: str = "") -> tuple[Body, str | None]:
    """Give the request an id SGLang will use, by splicing bytes rather than re-encoding: the
    id goes in a small piece of its own, the client's bytes follow as a view (no copy)."""
    existing = getattr(fields, name)
    if existing is not UNSET:
        return (body,), existing if isinstance(existing, str) and existing else None
    if not body.lstrip().startswith(b"{"):
        return (body,), None  # e.g. UTF-16: leave it alone rather than guess
    rid = prefix + engine.new_rid()
    start = body.index(b"{") + 1
    separator = b"" if _EMPTY_REST.match(body, start) else b","
    head = b'%s"%s":"%s"%s' % (body[:start], name.encode(), rid.encode(), separator)
    return (head, memoryview(body)[start:]), rid


def asking_usage(parts: Body) -> Body:
    """The body with stream_options.include_usage set, for a stream whose client did not set
    stream_options: spliced after the opening brace like the rid (the rid's piece, or the body's
    own first bytes), so the learned crossover gets every stream's usage. The relay takes the
    usage chunk out of what the client gets (relay/pump.py)."""
    first = parts[0]
    assert isinstance(first, bytes)  # the body, or the rid's piece before it (with_rid)
    start = first.index(b"{") + 1
    rest = memoryview(first)[start:] if len(parts) == 1 else first[start:]
    empty = len(parts) == 1 and _EMPTY_REST.match(first, start) is not None
    head = first[:start] + engine.ASK_USAGE + (b"" if empty else b",")
    return (head, rest, *parts[1:])


_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def model_span(body: bytes, model: str) -> tuple[int, int] | None:
    """Where the value of the body's top-level `model` lies: (start, end). The top-level
    members are walked in order up to it; one before it is skipped by its value's length, which
    msgspec gives without parsing the value (each as raw bytes: read only when `model` is not
    the first member), so a `model` nested in a value (a tool's schema, metadata) is never taken
    for it. None where the walk cannot place it: a name repeated before it (a dict holds one
    entry per name), or a first `model` whose value is not the one the engine reads (the last,
    as json.loads reads it)."""
    at, index = body.index(b"{") + 1, 0
    members: list[tuple[str, msgspec.Raw]] | None = None
    while True:
        member = _MEMBER.match(body, at)
        if member is None or member.group(1) != (b"," if index else b""):
            return None
        raw_name = member.group(2)
        name = _decode_any(b'"%s"' % raw_name) if b"\\" in raw_name else raw_name.decode()
        at = member.end()
        if name == "model":
            value = _STRING.match(body, at)
            return (at, value.end()) if value and _decode_any(value.group()) == model else None
        if members is None:
            members = list(_decode_members(body).items())
        if index >= len(members) or members[index][0] != name:
            return None
        at += len(members[index][1])
        index += 1


def alias_rewrite(body: bytes, model: str, served: str) -> tuple[bytes, tuple[int, int, bytes] | None]:
    """The body whose `model` is an alias of `served` (models.aliases), and the bytes of its
    `model` value to replace, as (start, end, new value): only that value changes, the client's
    other bytes are relayed as they came (`with_model` splices it into the pieces). Where the
    walk cannot place it (names repeated), the top level is encoded again with the served
    name, each value's bytes kept as sent. A body naming `model` twice with the same value has
    its first rewritten, and the engine reads the last: as if no alias applied."""
    value = msgspec.json.encode(served)
    span = model_span(body, model)
    if span is None:
        members = {**_decode_members(body), "model": msgspec.Raw(value)}
        return msgspec.json.encode(members), None
    return body, (*span, value)


def with_model(parts: Body, body_length: int, start: int, end: int, value: bytes) -> Body:
    """The pieces with body[start:end] replaced by `value`, nothing copied. Whatever was
    spliced in before (the rid, the usage request) went after the opening brace, before any
    member: the last piece is the body's own bytes from there to its end."""
    tail = memoryview(parts[-1])
    offset = body_length - len(tail)
    return (*parts[:-1], tail[:start - offset], value, tail[end - offset:])


def abort_rids(path: str, fields: RequestFields, rid: str | None) -> tuple[str, ...]:
    """The rids the engine gives the work of one request (a batch is a list of prompts on
    /v1/completions or /generate): engine.abort_rids."""
    if rid is None:
        return ()
    samples = _samples(fields)
    batch = None if samples > 1 else _batch_size(  # n > 1: no rid to name, no list to read
        fields.prompt if path == "/v1/completions" else
        fields.text if fields.text is not UNSET else fields.input_ids)
    return engine.abort_rids(rid, samples, batch)


def _samples(fields: RequestFields) -> int:
    n = fields.n
    params = fields.sampling_params
    if n is UNSET and isinstance(params, dict):
        n = params.get("n", 1)
    return n if isinstance(n, int) else 1


def _batch_size(raw: msgspec.Raw | UnsetType) -> int | None:
    """Length of a list of prompts (strings or token lists); None for a single prompt."""
    if raw is UNSET:
        return None
    view = memoryview(raw)
    if bytes(view[:1]) != b"[" or bytes(view[1:].tobytes().lstrip()[:1]) not in (b'"', b"["):
        return None
    items = msgspec.json.decode(view)
    return len(items) if isinstance(items, list) else None


def parse_inbound(path: str, headers: Headers, body: bytes, *, session_headers: tuple[str, ...],
                  allow_pin: bool, aliases: Models | None = None) -> Inbound:
    check_content_type(headers)
    fields = parse_fields(body)
    validate_fields(path, fields)
    model = fields.model if isinstance(fields.model, str) else None
    rewrite = None
    served = None if aliases is None or model is None else aliases.served_name(model)
    if model is not None and served is not None and served != model:
        body, rewrite = alias_rewrite(body, model, served)
        model = served
    rid = None
    parts: Body = (body,)
    extra: tuple[tuple[bytes, bytes], ...] = ()
    # Set before a pair (and its engine) is chosen: SGLang's names, which vLLM ignores but for
    # the Responses request_id, its response's id too (docs/compat.md, the vLLM section).
    name = engine.RID_FIELDS.get(path)
    if name is not None:
        prefix = engine.RESPONSE_ID_PREFIX if name == "request_id" else ""
        parts, rid = with_rid(body, fields, name, prefix)
    elif path in engine.RID_HEADER_PATHS:
        rid = header(headers, engine.RID_HEADER) or engine.new_rid()
        extra = ((engine.RID_HEADER, rid.encode("latin-1")),)
    stream = is_stream(fields.stream)
    usage_asked = (stream and path in USAGE_PATHS and fields.stream_options is UNSET
                   and body.lstrip()[:1] == b"{")
    if usage_asked:
        parts = asking_usage(parts)
    if rewrite is not None:
        parts = with_model(parts, len(body), *rewrite)
    previous = fields.previous_response_id
    return Inbound(
        path=path,
        body=parts,
        stream=stream,
        model=model,
        session=session_of(headers, fields, session_headers),
        pin=pin_of(headers, allow_pin),
        rid=rid,
        api=api_of(path),
        abort_rids=abort_rids(path, fields, rid),
        headers=extra,
        previous_response_id=previous if isinstance(previous, str) and previous else None,
        usage_asked=usage_asked,
    )


def upstream_headers(headers: Headers, api_key: str | None,
                     extra: tuple[tuple[bytes, bytes], ...] = ()) -> list[tuple[bytes, bytes]]:
    drop = _DROP_REQUEST_HEADERS | {name for name, _ in extra}
    for key, value in headers:
        # Headers named in Connection describe this hop only (RFC 9110 7.6.1).
        if key == b"connection" and value.lower() not in (b"keep-alive", b"close"):
            drop = drop | {token.strip().lower() for token in value.split(b",")}
    kept = [(key, value) for key, value in headers if key not in drop]
    kept.extend(extra)
    if api_key:
        kept.append((b"authorization", b"Bearer " + api_key.encode("latin-1")))
    return kept


def bearer_token(headers: Headers) -> str | None:
    """The client's key: `Authorization: Bearer` (OpenAI) or `x-api-key` (Anthropic)."""
    auth = header(headers, b"authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return header(headers, b"x-api-key")


BYTES_PER_TOKEN = 4  # what a body's length says about its prompt, without tokenizing it


def prompt_tokens_from_bytes(body_bytes: int) -> int:
    """The gateway's estimate of a request's prompt tokens from its body's size."""
    return max(0, body_bytes) // BYTES_PER_TOKEN
