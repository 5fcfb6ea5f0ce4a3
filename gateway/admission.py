"""Admission: from an ASGI request to a lease on a backend, or a clear refusal.

Method, client key, body (bounded in size and in time), one parse, the in-flight limit, then
the pool's decision. Every refusal is a GatewayError in the shape of the request's API."""

from __future__ import annotations

import asyncio
import hmac
import time

from gateway.asgi import Receive, Scope
from gateway.config import Settings
from gateway.errors import (
    BadRequest,
    GatewayError,
    MethodNotAllowed,
    NoBackend,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
)
from gateway.inbound import PUT_PATHS, Headers, Inbound, bearer_token, parse_inbound
from gateway.leases import Ask, Lease, Placement
from gateway.placement import prompt_tokens_from_bytes
from gateway.pool import Pool
from gateway.response_ids import ResponseStore
from gateway.turns.waiting import WaitingRoom


async def admit(scope: Scope, receive: Receive, settings: Settings, pool: Pool,
                responses: ResponseStore, now: float, waiting: WaitingRoom | None = None
                ) -> tuple[Inbound, Lease]:
    """The request, parsed, and its lease; raises the GatewayError the client gets. With
    turns pairs, a request that finds no server admitting waits in `waiting` for the turn."""
    if scope["method"] != "POST" and not (scope["method"] == "PUT" and scope["path"] in PUT_PATHS):
        raise method_not_allowed(scope["path"])
    headers: Headers = scope["headers"]
    check_client_key(headers, settings)
    body = await read_body(receive, settings.limits.max_body_bytes, settings.timeouts.idle_s)
    inbound = parse_inbound(scope["path"], headers, body,
                            session_headers=settings.routing.session_headers,
                            allow_pin=settings.routing.allow_pin_header)
    if pool.concurrency >= settings.limits.max_inflight:
        raise Overloaded("the gateway is at its in-flight limit; retry shortly",
                         headers={"retry-after": "1"})
    ask = Ask(inbound.session, inbound.pin, responses.holder(inbound.previous_response_id),
              prompt_tokens_from_bytes(len(body)))
    admitted = pool.admit(ask, now)
    if waiting is not None and _waits_for_turn(admitted):
        admitted = await waiting.admit(lambda: pool.admit(ask, time.monotonic()), _waits_for_turn)
    if not isinstance(admitted, Lease):
        raise NoBackend("no healthy backend: all are down or their circuits are open",
                        headers={"retry-after": "5"})
    return inbound, admitted


def _waits_for_turn(admitted: Lease | Placement) -> bool:
    return not isinstance(admitted, Lease) and admitted.decision.reason == "memory_turn"


def check_client_key(headers: Headers, settings: Settings) -> None:
    """The gateway's own client keys (auth.api_keys), when it has any."""
    keys = settings.auth.api_keys
    if keys and not _key_matches(bearer_token(headers), keys):
        raise Unauthorized("invalid or missing API key")


def _key_matches(given: str | None, keys: tuple[str, ...]) -> bool:
    if given is None:
        return False
    candidate = given.encode()
    # Compare against every key so the time taken does not tell which one nearly matched.
    return any([hmac.compare_digest(candidate, key.encode()) for key in keys])


def method_not_allowed(path: str) -> GatewayError:
    allowed = "POST, PUT" if path in PUT_PATHS else "POST"
    return MethodNotAllowed(f"method not allowed; use {allowed}", headers={"allow": allowed})


async def read_body(receive: Receive, limit: int, idle_s: float) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(idle_s):  # a half-sent body must not hold a task forever
                message = await receive()
        except TimeoutError:
            # The rest of the body may still come: the connection cannot carry another request.
            raise RequestTimeout(f"the request body stopped arriving for {idle_s} s",
                                 headers={"connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise BadRequest("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)
