"""Model aliases on the request path (models.aliases): the body's top-level `model` is rewritten
to the served name, only its value's bytes; a body no alias applies to goes upstream as it came."""

from __future__ import annotations

import json

import pytest

from gateway.apis import PROXY_PATHS
from gateway.config import Models
from gateway.relay.inbound import Inbound, model_span, parse_inbound

JSON = [(b"content-type", b"application/json")]
SERVED = "Qwen/Qwen3.5-122B-A10B"
ALIASES = Models(aliases={"gpt-5-codex": SERVED, "claude-*": SERVED})


def parse(body: bytes, path: str = "/v1/messages", aliases: Models | None = ALIASES) -> Inbound:
    return parse_inbound(path, JSON, body, session_headers=(), allow_pin=False, aliases=aliases)


def sent(inbound: Inbound) -> bytes:
    return b"".join(bytes(piece) for piece in inbound.body)


@pytest.mark.parametrize("aliases", [None, Models(), ALIASES])
def test_a_body_no_alias_applies_to_goes_upstream_byte_for_byte(aliases: Models | None) -> None:
    """The default maps nothing; with aliases, a name none matches (case counts) is not touched:
    the engine gets the client's bytes and answers as it always did."""
    for model in ("Claude-sonnet-4-5", "gpt-5", SERVED):
        body = (b'{ "model":"%s",  "messages": [{"role": "user", "content": "caf\\u00e9 \xc3\xa9"}],'
                b' "max_tokens": 5}' % model.encode())
        inbound = parse(body, aliases=aliases)
        assert sent(inbound) == body and inbound.body == (body,)
        assert inbound.model == model


def test_an_alias_changes_only_the_models_value() -> None:
    body = (b'{"messages": [{"role": "user", "content": "say \\"model\\": \\"claude-x\\""}],\n'
            b' "tools": [{"name": "t", "input_schema": {"properties": {"model": "claude-y"}}}],\n'
            b' "model" :  "claude-sonnet-4-5" , "max_tokens": 5}')
    inbound = parse(body)
    value = json.dumps(SERVED).encode()
    assert sent(inbound) == body.replace(b'"claude-sonnet-4-5"', value)
    assert inbound.model == SERVED  # what the relay's own error events name
    sent_json = json.loads(sent(inbound))
    assert sent_json["tools"][0]["input_schema"]["properties"]["model"] == "claude-y"


@pytest.mark.parametrize("path", sorted(PROXY_PATHS))
def test_every_relayed_path_gets_the_served_name(path: str) -> None:
    """Chat and completions get a rid and the usage request spliced in before it, Responses a
    request_id: the rewrite goes in the same pieces, nothing else of the client's changes."""
    required = PROXY_PATHS[path]
    fields = {"model": "gpt-5-codex", **({required: []} if required else {}), "stream": True}
    body = json.dumps(fields).encode()
    inbound = parse(body, path=path)
    upstream = json.loads(sent(inbound))
    assert upstream["model"] == SERVED and inbound.model == SERVED
    assert {k: v for k, v in upstream.items() if k != "model" and k in fields} == {
        k: v for k, v in fields.items() if k != "model"}
    assert sent(inbound).endswith(body[body.index(b'"gpt-5-codex"') + len(b'"gpt-5-codex"'):])


def test_exact_names_come_before_patterns_and_patterns_go_in_order() -> None:
    aliases = Models(aliases={"claude-*": "first", "claude-haiku-*": "second",
                              "claude-haiku-4-5": "exact", "o[0-9]*": "o-series", "gpt-?": "one"})
    assert [aliases.served_name(name) for name in (
        "claude-haiku-4-5", "claude-haiku-3", "claude-opus", "o3", "o", "gpt-5", "gpt-55",
        "CLAUDE-x")] == ["exact", "first", "first", "o-series", None, "one", None, None]


def test_a_key_spelled_with_an_escape_is_still_the_model() -> None:
    body = b'{"mod\\u0065l": "claude-x", "messages": [], "max_tokens": 5}'
    assert json.loads(sent(parse(body)))["model"] == SERVED


def test_a_repeated_model_is_read_as_the_engine_reads_it_the_last() -> None:
    """json.loads keeps the last of repeated names; the top level is encoded again with the
    served name, every other value's bytes as sent."""
    body = b'{"model": "other", "messages": [ {"role": "user"} ], "model": "claude-x", "max_tokens": 5}'
    inbound = parse(body)
    assert json.loads(sent(inbound)) == {"model": SERVED, "messages": [{"role": "user"}],
                                         "max_tokens": 5}
    assert b'[ {"role": "user"} ]' in sent(inbound)
    repeated_alias = parse(b'{"model": "claude-x", "messages": [], "model": "unknown"}')
    assert json.loads(sent(repeated_alias))["model"] == "unknown"  # the last one: no alias
    repeated_before = parse(b'{"system": "a", "system": "bb", "model": "claude-x", "messages": []}')
    assert json.loads(sent(repeated_before)) == {"system": "bb", "model": SERVED, "messages": []}


def test_a_model_that_is_not_a_name_is_left_to_the_engine() -> None:
    for body in (b'{"messages": [], "max_tokens": 5}', b'{"model": null, "messages": []}'):
        assert sent(parse(body)) == body
    assert model_span(b'{"messages": []}', "claude-x") is None


def test_an_alias_of_the_served_name_itself_changes_nothing() -> None:
    body = b'{"model": "%s", "messages": []}' % SERVED.encode()
    assert sent(parse(body, aliases=Models(aliases={"*": SERVED}))) == body
