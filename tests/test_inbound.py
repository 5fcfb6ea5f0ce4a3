"""Request parsing: what the gateway reads from a request, and what it forwards."""

from __future__ import annotations

import json

import pytest

from gateway.errors import BadRequest, UnsupportedMediaType
from gateway.inbound import RequestFields, parse_inbound, upstream_headers, with_rid

JSON = [(b"content-type", b"application/json")]
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "thread-id")


def parse(body: bytes, headers=JSON, path: str = "/v1/chat/completions", allow_pin: bool = False):
    return parse_inbound(path, headers, body, session_headers=SESSION_HEADERS, allow_pin=allow_pin)


def test_rid_is_spliced_in_without_reencoding_the_body() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\\u00e9 caf\xc3\xa9"}]}'
    inbound = parse(body)
    assert inbound.rid is not None and len(inbound.rid) == 32
    sent = b"".join(inbound.body)
    assert sent.endswith(body[1:])  # the client's bytes follow untouched
    assert json.loads(sent)["rid"] == inbound.rid


def test_client_rid_is_kept() -> None:
    inbound = parse(b'{"rid": "abc", "messages": []}')
    assert (inbound.rid, b"".join(inbound.body)) == ("abc", b'{"rid": "abc", "messages": []}')


def test_rid_only_where_sglang_takes_it() -> None:
    body = b'{"model": "m", "messages": [], "max_tokens": 5}'
    inbound = parse(body, path="/v1/messages")
    assert (inbound.rid, b"".join(inbound.body)) == (None, body)


@pytest.mark.parametrize("empty", [b"{}", b"{ \n\t }", b"{" + b" " * 200 + b"}"])
def test_empty_object_gets_a_valid_rid(empty: bytes) -> None:
    body, rid = with_rid(empty, RequestFields())
    assert json.loads(b"".join(body)) == {"rid": rid}


def test_fields_far_from_the_start_are_read_and_the_rest_skipped() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}],
                       "tools": [{"deep": [[[{"a": None}]]]}], "stream": True, "model": "m",
                       "user": "agent-7"}).encode()
    inbound = parse(body)
    assert (inbound.stream, inbound.model, inbound.session) == (True, "m", "agent-7")


@pytest.mark.parametrize(("body", "message"), [
    (b"{bad", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"messages": "hi"}', "'messages' must be an array"),
    (b'{"prompt": "x"}', "missing required field 'messages'"),
    (b'{"messages": [], "stream": "yes"}', "'stream' must be a boolean"),
    (b'{"messages": [], "model": 7}', "'model' must be a string"),
    (b'{"messages": ["\xff\xfe"]}', "not valid UTF-8"),
    (b'{"messages": [], "x": "\xed\xa0\x80"}', "not valid UTF-8"),  # a surrogate, UTF-8-encoded
    (b'{"messages": [], "x": "\\ud800"}', "not valid JSON"),  # a lone surrogate escape
    (b'{"messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"messages": [] } trailing', "not valid JSON"),
])
def test_bad_bodies_are_client_errors(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse(body)


def test_content_type_must_be_json() -> None:
    with pytest.raises(UnsupportedMediaType):
        parse(b'{"messages": []}', headers=[(b"content-type", b"text/plain")])
    inbound = parse(b'{"messages": []}', headers=[(b"content-type", b"application/json; charset=utf-8")])
    assert inbound.stream is False


@pytest.mark.parametrize(("headers", "body", "session"), [
    ([(b"x-session-id", b"open-1")], b'{"messages": [], "user": "u"}', "open-1"),
    ([(b"x-claude-code-session-id", b"cc-1")], b'{"messages": []}', "cc-1"),
    ([(b"thread-id", b"codex-1")], b'{"messages": []}', "codex-1"),
    ([], b'{"messages": [], "user": "u-7"}', "u-7"),
    ([], b'{"messages": [], "metadata": {"user_id": "anthropic-u"}}', "anthropic-u"),
    ([], b'{"messages": []}', None),
])
def test_session_identity(headers, body, session) -> None:
    inbound = parse(body, headers=JSON + headers)
    assert inbound.session == session


def test_pin_only_when_allowed() -> None:
    pinned = [*JSON, (b"x-gateway-pin", b"plain")]
    assert parse(b'{"messages": []}', headers=pinned).pin is None
    assert parse(b'{"messages": []}', headers=pinned, allow_pin=True).pin == "plain"
    with pytest.raises(BadRequest, match="x-gateway-pin"):
        parse(b'{"messages": []}', headers=[*JSON, (b"x-gateway-pin", b"gpu9")], allow_pin=True)


def test_client_credentials_and_hop_headers_never_go_upstream() -> None:
    client = [(b"authorization", b"Bearer client-key"), (b"x-api-key", b"k2"), (b"cookie", b"c"),
              (b"connection", b"keep-alive"), (b"host", b"gw"), (b"content-length", b"10"),
              (b"x-session-id", b"s"), (b"content-type", b"application/json")]
    forwarded = dict(upstream_headers(client, api_key="backend-key"))
    assert forwarded == {b"x-session-id": b"s", b"content-type": b"application/json",
                         b"authorization": b"Bearer backend-key"}
    assert b"authorization" not in dict(upstream_headers(client, api_key=None))


def test_request_ids_never_repeat_within_a_process() -> None:
    rids = [parse(b'{"messages": []}').rid for _ in range(2000)]
    assert len(set(rids)) == 2000 and all(rid and len(rid) == 32 for rid in rids)
