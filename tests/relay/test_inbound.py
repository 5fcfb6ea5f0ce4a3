"""Request parsing: what the gateway reads from a request, and what it forwards."""

from __future__ import annotations

import json

import pytest

from gateway.apis.errors import BadRequest, UnsupportedMediaType
from gateway.relay.inbound import (
    RequestFields,
    bearer_token,
    parse_fields,
    parse_inbound,
    parse_json_object,
    upstream_headers,
    with_rid,
)

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
    body = b'{"model": "m", "input": [], "max_tokens": 5}'
    assert parse(body, path="/v1/embeddings").rid is None
    assert b"".join(parse(body, path="/v1/embeddings").body) == body


def test_messages_get_their_rid_in_sglangs_override_header_not_the_body() -> None:
    """/v1/messages has no rid field (SGLang ignores one); SGLang reads x-override-rid when
    launched with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1, so the abort can name it."""
    body = b'{"model": "claude-sonnet-4-5", "messages": [], "max_tokens": 5}'
    inbound = parse(body, path="/v1/messages")
    assert b"".join(inbound.body) == body
    assert inbound.abort_rids == (inbound.rid,) and inbound.rid
    sent = dict(upstream_headers(JSON, None, inbound.headers))
    assert sent[b"x-override-rid"] == inbound.rid.encode()
    own = parse(body, headers=[*JSON, (b"x-override-rid", b"mine")], path="/v1/messages")
    assert own.rid == "mine" and dict(upstream_headers(JSON, None, own.headers))[b"x-override-rid"] == b"mine"


def test_responses_get_a_request_id_that_is_also_the_response_id() -> None:
    """SGLang uses /v1/responses' `request_id` as the rid and as the response's id, which
    must start with "resp_" to be named as previous_response_id later."""
    inbound = parse(b'{"input": "hi", "previous_response_id": "resp_1"}', path="/v1/responses")
    sent = json.loads(b"".join(inbound.body))
    assert sent["request_id"] == inbound.rid and inbound.rid.startswith("resp_")
    assert "rid" not in sent and inbound.abort_rids == (inbound.rid,)
    assert inbound.previous_response_id == "resp_1"
    own = parse(b'{"input": "hi", "request_id": "resp_mine"}', path="/v1/responses")
    assert own.rid == "resp_mine" and own.abort_rids == ("resp_mine",)


@pytest.mark.parametrize(("path", "body", "suffixes"), [
    ("/v1/completions", b'{"prompt": "one"}', [""]),
    ("/v1/completions", b'{"prompt": [1, 2, 3]}', [""]),  # token ids of one prompt
    ("/v1/completions", b'{"prompt": ["a", "b", "c"]}', ["_0", "_1", "_2"]),
    ("/v1/completions", b'{"prompt": [[1], [2]]}', ["_0", "_1"]),
    ("/generate", b'{"text": ["a", "b"]}', ["_0", "_1"]),
    ("/generate", b'{"input_ids": [[1], [2], [3]]}', ["_0", "_1", "_2"]),
    ("/generate", b'{"text": "a"}', [""]),
    ("/v1/chat/completions", b'{"messages": [], "n": 3}', []),
    ("/v1/completions", b'{"prompt": "one", "n": 2}', []),
    ("/generate", b'{"text": "a", "sampling_params": {"n": 2}}', []),
])
def test_abort_names_every_rid_sglang_gives_the_work(path: str, body: bytes, suffixes) -> None:
    """A batch runs as rid_0, rid_1, ... (io_struct.py:764) and SGLang's abort needs the exact
    rid; with n > 1 each sample gets a fresh random rid (tokenizer_manager.py:2174): none can
    be named, so no abort is sent rather than one that stops nothing."""
    inbound = parse(body, path=path)
    assert inbound.abort_rids == tuple(inbound.rid + suffix for suffix in suffixes)


@pytest.mark.parametrize(("value", "stream"), [
    (True, True), (False, False), ("true", True), ("True", True), (1, True), ("1", True),
    ("yes", True), ("on", True), (0, False), ("false", False), ("off", False), (None, False),
])
def test_stream_is_read_as_sglangs_pydantic_reads_it(value, stream: bool) -> None:
    body = json.dumps({"messages": [], "stream": value}).encode()
    assert parse(body).stream is stream


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
    (b'{"messages": [], "stream": "maybe"}', "'stream' must be a boolean"),
    (b'{"messages": [], "stream": 2}', "'stream' must be a boolean"),
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


def test_headers_named_in_connection_describe_this_hop_only() -> None:
    """RFC 9110 7.6.1: a header a client names in Connection is for the gateway, not SGLang."""
    client = [(b"connection", b"X-Hop, Keep-Alive"), (b"x-hop", b"1"), (b"x-end", b"2")]
    assert dict(upstream_headers(client, None)) == {b"x-end": b"2"}
    assert dict(upstream_headers([(b"connection", b"close"), (b"x-end", b"2")], None)) == {
        b"x-end": b"2"}


def test_the_gateways_own_headers_replace_the_clients() -> None:
    client = [*JSON, (b"x-override-rid", b"theirs")]
    sent = upstream_headers(client, None, ((b"x-override-rid", b"ours"),))
    assert [value for key, value in sent if key == b"x-override-rid"] == [b"ours"]


@pytest.mark.parametrize(("headers", "token"), [
    ([(b"authorization", b"Bearer k1")], "k1"),
    ([(b"authorization", b"bearer  k1 ")], "k1"),
    ([(b"authorization", b"BEARER k1"), (b"x-api-key", b"k2")], "k1"),
    ([(b"authorization", b"Basic abc"), (b"x-api-key", b"k2")], "k2"),
    ([(b"authorization", b"Bearer")], None),
    ([(b"x-api-key", b"k2")], "k2"),
    ([], None),
])
def test_the_clients_key_from_either_api(headers, token) -> None:
    assert bearer_token(headers) == token


@pytest.mark.parametrize(("body", "rid"), [
    (b'{"rid": "", "messages": []}', None),  # SGLang makes its own: no id the gateway knows
    (b'{"rid": 7, "messages": []}', None),
    (b'{"rid": ["a", "b"], "messages": []}', None),
])
def test_a_client_rid_that_is_not_a_string_is_left_to_sglang(body: bytes, rid) -> None:
    inbound = parse(body)
    assert (inbound.rid, b"".join(inbound.body), inbound.abort_rids) == (rid, body, ())


def test_a_body_with_leading_whitespace_gets_its_rid_inside_the_object() -> None:
    body = b' \n{"messages": []}'
    parts, rid = with_rid(body, parse_fields(body))
    assert json.loads(b"".join(parts)) == {"rid": rid, "messages": []}
    assert rid is not None and len(rid) == 32 and int(rid, 16) >= 0  # SGLang's own rid shape


@pytest.mark.parametrize(("path", "body", "suffixes"), [
    ("/v1/completions", b'{"prompt": [ "a", "b"]}', ["_0", "_1"]),  # whitespace in the list
    ("/v1/completions", b'{"prompt": []}', [""]),
    ("/v1/completions", b'{"prompt": "one", "n": 1}', [""]),
    ("/v1/completions", b'{"prompt": "one", "n": "2"}', [""]),  # not a count SGLang takes
    ("/generate", b'{"text": "a", "n": 1, "sampling_params": {"n": 2}}', [""]),
    ("/generate", b'{"text": "a", "sampling_params": {"n": 1}}', [""]),
    ("/generate", b'{"input_ids": [1, 2]}', [""]),
])
def test_abort_rids_at_the_edges(path: str, body: bytes, suffixes) -> None:
    inbound = parse(body, path=path)
    assert inbound.abort_rids == tuple(inbound.rid + suffix for suffix in suffixes)


def test_no_previous_response_for_an_empty_or_odd_one() -> None:
    for previous in (b'""', b"7", b"null"):
        body = b'{"input": "hi", "previous_response_id": %s}' % previous
        assert parse(body, path="/v1/responses").previous_response_id is None


@pytest.mark.parametrize(("body", "model"), [
    (b'{"messages": [], "model": null}', None), (b'{"messages": []}', None),
    (b'{"messages": [], "model": "m"}', "m"),
])
def test_model_is_optional(body: bytes, model) -> None:
    assert parse(body).model == model


def test_only_chat_needs_messages_as_an_array() -> None:
    assert parse(b'{"messages": "hi", "max_tokens": 5}', path="/v1/messages").rid
    assert parse(b'{"text": "a"}', path="/generate").stream is False


def test_the_first_session_header_that_is_set_wins() -> None:
    headers = [*JSON, (b"x-session-id", b""), (b"thread-id", b"t-1"), (b"x-session-id", b"late")]
    assert parse(b'{"messages": [], "user": "u"}', headers=headers).session == "t-1"
    assert parse(b'{"messages": [], "user": ""}').session is None
    assert parse(b'{"messages": [], "metadata": {"user_id": 7}}').session is None


@pytest.mark.parametrize(("body", "message"), [
    (b"[1]", "request body must be a JSON object"),
    (b'{"messages": ["\xff"]}', "request body is not valid UTF-8"),
    (b'{"messages": "hi"}', "'messages' must be an array"),
    (b'{"messages": [], "model": 7}', "'model' must be a string"),
    (b'{"messages": [], "stream": "maybe"}', "'stream' must be a boolean"),
    (b'{"messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "request body is nested too deeply"),
])
def test_the_clients_error_messages_exactly(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as raised:
        parse(body)
    assert raised.value.message == message


def test_the_pin_error_names_the_roles() -> None:
    with pytest.raises(BadRequest) as raised:
        parse(b'{"messages": []}', headers=[*JSON, (b"x-gateway-pin", b"gpu9")], allow_pin=True)
    assert raised.value.message == "x-gateway-pin must be one of mtp, plain"


@pytest.mark.parametrize("content_type", [
    b"application/json; charset=utf-8; x=y", b"Application/JSON", b" application/json ;x=1"])
def test_json_content_types_with_parameters(content_type: bytes) -> None:
    assert parse(b'{"messages": []}', headers=[(b"content-type", content_type)]).stream is False


@pytest.mark.parametrize("headers", [[], [(b"content-type", b"text/json")],
                                     [(b"content-type", b"application/json-seq")]])
def test_anything_else_is_415_with_its_message(headers) -> None:
    with pytest.raises(UnsupportedMediaType) as raised:
        parse(b'{"messages": []}', headers=headers)
    assert raised.value.message == "Content-Type must be application/json"


def test_an_admin_body_is_a_json_object() -> None:
    assert parse_json_object(b'{"routing": {"crossover": 20}}') == {"routing": {"crossover": 20}}
    with pytest.raises(BadRequest) as raised:
        parse_json_object(b"[1]")
    assert raised.value.message == "request body must be a JSON object"
    for bad, message in ((b"[1]", "must be a JSON object"), (b'"x"', "must be a JSON object"),
                         (b"{", "not valid JSON"), (b'{"a": "\xff"}', "not valid UTF-8")):
        with pytest.raises(BadRequest, match=message):
            parse_json_object(bad)


def test_sampling_params_without_n_are_one_sample() -> None:
    inbound = parse(b'{"text": "a", "sampling_params": {"temperature": 0}}', path="/generate")
    assert inbound.abort_rids == (inbound.rid,)


def test_what_a_parsed_request_says_about_itself() -> None:
    chat = parse(b'{"messages": []}')
    assert (chat.path, chat.api, chat.headers) == ("/v1/chat/completions", "openai", ())
    embeddings = parse(b'{"input": "x"}', path="/v1/embeddings")
    assert (embeddings.api, embeddings.headers) == ("openai", ())
    assert dict(upstream_headers(JSON, None, embeddings.headers)) == dict(JSON)
    messages = parse(b'{"messages": [], "max_tokens": 5}', path="/v1/messages")
    assert (messages.path, messages.api) == ("/v1/messages", "anthropic")
    assert parse(b'{"input": "x"}', path="/v1/responses").api == "responses"


def test_a_header_value_never_drops_another_header() -> None:
    client = [(b"x-session-id", b"x-title"), (b"x-title", b"t")]
    assert dict(upstream_headers(client, None)) == {b"x-session-id": b"x-title", b"x-title": b"t"}
