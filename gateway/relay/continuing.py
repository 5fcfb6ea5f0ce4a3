"""Continuing a running stream on another server: the relay's I/O around the pure pieces
(gateway/continuation): what the client got is read back, the next server asked how many
tokens that is (its /v1/tokenize, only where SGLang's stream does not count them), the
continuation opened there up to its first event, and its events spliced into the client's
stream by the framer the pump already calls.

Only a continued stream is touched: every other stream's pump runs as before, with one list
append per piece (the events the client got, kept for a continuation's transcript)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gateway.apis import GENERATE
from gateway.apis.errors import GatewayError, UpstreamBroken, UpstreamRefused, UpstreamStatus
from gateway.apis.sse import EventFramer, split_events
from gateway.apis.streams import event_error
from gateway.continuation import Relayed, Seam, Splicer, continuation, read, refusal, splicer
from gateway.continuation.convert import Unconvertible
from gateway.continuation.rules import SHAPE
from gateway.relay.exchange import Exchange
from gateway.relay.inbound import upstream_headers
from gateway.routing.backend import BackendState
from gateway.upstream.client import Upstream, UpstreamResponse
from gateway.upstream.engine import sglang as engine

FAILURE, TURN, FLIP = "failure", "turn", "flip"  # why a stream was continued (the metric's cause)
TOO_LONG = "transcript_chunks"  # more pieces sent than handoff.transcript_chunks keeps


class Uncontinuable(GatewayError):
    """The gateway could not build the continuation (the next server could not count the
    answer so far, or the request's shape): the gateway's failure, not a server's."""

    status, code, kind = 502, "continuation_failed", "continuation_failed"

    def instead_of(self, failure: GatewayError) -> Uncontinuable:
        """The server's failure as the client would have had it without a continuation,
        still the gateway's (no blame on the server that was to continue it)."""
        shown = Uncontinuable(failure.message)
        shown.status, shown.code = failure.status, failure.code
        return shown


class SplicingFramer(EventFramer):
    """Whole events of the continuation, spliced into the client's stream."""

    __slots__ = ("splicer",)

    def __init__(self, splice: Splicer) -> None:
        super().__init__()
        self.splicer = splice

    def feed(self, chunk: bytes) -> bytes:
        events = super().feed(chunk)
        return self.splicer.feed(events) if events else b""


@dataclasses.dataclass(frozen=True)
class Plan:
    """A stream that can be continued: its request and what its client got."""

    body: dict[str, Any]
    relayed: Relayed


def request_body(exchange: Exchange) -> dict[str, Any]:
    """The request as the backend got it (the rid the gateway set included)."""
    value = json.loads(b"".join(bytes(piece) for piece in exchange.inbound.body))
    return value if isinstance(value, dict) else {}


def plan(exchange: Exchange) -> Plan | str:
    """The stream's plan, or why it cannot be continued faithfully."""
    path = exchange.inbound.path
    if not exchange.transcript_whole():
        return TOO_LONG
    try:
        body = request_body(exchange)
    except ValueError:
        return SHAPE
    relayed = read(path, b"".join(exchange.recent))
    reason = refusal(path, body, relayed)
    return reason if reason is not None else Plan(body, relayed)


async def open_continuation(upstream: Upstream, exchange: Exchange, planned: Plan,
                            target: BackendState) -> tuple[UpstreamResponse, bytes]:
    """Ask `target` for the rest of the answer; the response and its first events, spliced.
    Raises an UpstreamError when it fails before its first event; the exchange then still
    names the old rid (nothing was sent to the client)."""
    inbound, path = exchange.inbound, exchange.inbound.path
    relayed = planned.relayed
    tokens, ids = await _tokens_before(upstream, exchange, planned, target)
    rid = engine.new_rid()
    try:
        made = continuation(path, planned.body, relayed, tokens, rid, prefix_ids=ids)
    except Unconvertible as exc:
        raise Uncontinuable(f"the stream cannot be continued: {exc}") from exc
    headers = upstream_headers(exchange.client_headers, target.target.api_key)
    response = await upstream.send("POST", target.target.url + made.path, headers, (made.body,))
    exchange.upstream = response
    if response.status >= 400:
        detail = (await response.read())[:500].decode("utf-8", "replace")
        raise UpstreamStatus(response.status, target.name, detail)
    options = planned.body.get("stream_options")  # the gateway's own when it asked (usage_asked)
    asked = isinstance(options, dict) and bool(options.get("include_usage"))
    seam = Seam(relayed, tokens, include_usage=target.usage_by_default
                or (asked and not inbound.usage_asked))
    framer = SplicingFramer(splicer(path, made.path, seam))
    head = await _first_event(response, framer, target.name, exchange)
    exchange.framer = framer
    exchange.inbound = dataclasses.replace(inbound, abort_rids=(rid,), headers=())
    return response, framer.splicer.feed(head)


async def _first_event(response: UpstreamResponse, framer: SplicingFramer, backend: str,
                       exchange: Exchange) -> bytes:
    """The continuation's raw events up to its first one; an error there fails it."""
    head = b""
    while not head:
        chunk = await response.next_chunk()
        if not chunk:
            raise UpstreamBroken(f"backend '{backend}' ended the continuation before its first event")
        exchange.deadlines.got_bytes()
        head = EventFramer.feed(framer, chunk)  # unspliced: an error here is checked first
    for event in split_events(head)[:1]:
        refused = event_error("openai", event)
        if refused is not None:
            raise UpstreamRefused(refused[0], backend, refused[1], head)
    return head


async def _tokens_before(upstream: Upstream, exchange: Exchange, planned: Plan,
                         target: BackendState) -> tuple[int, list[int] | None]:
    """Tokens of the answer so far, as `target` counts the prefix: /generate's own count;
    else the text tokenized there without special tokens (the prefix is appended without
    its BOS, serving_chat.py:572-574)."""
    relayed = planned.relayed
    if exchange.inbound.path == GENERATE:
        return relayed.completion_tokens or 0, None
    if not relayed.text:
        return 0, []
    body = json.dumps({"model": planned.body.get("model"), "prompt": relayed.text,
                       "add_special_tokens": False}).encode()
    headers = [*upstream_headers(exchange.client_headers, target.target.api_key),
               (b"content-type", b"application/json")]
    response = await upstream.send("POST", target.target.url + "/v1/tokenize", headers, (body,))
    try:
        answer = await response.read()
    finally:
        response.close()
    try:
        value = json.loads(answer) if response.status == 200 else None
    except ValueError:
        value = None
    if not isinstance(value, dict) or not isinstance(value.get("count"), int):
        raise Uncontinuable(f"backend '{target.name}' could not count the answer so far "
                            f"(/v1/tokenize: HTTP {response.status})")
    tokens = value.get("tokens")
    return value["count"], tokens if isinstance(tokens, list) else None

