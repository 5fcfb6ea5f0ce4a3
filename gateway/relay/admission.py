"""Admission: from an ASGI request to a lease on a backend, or a clear refusal.

Method, client key, body (bounded in size and in time), one parse, the in-flight limit, then
the pool's decision. Every refusal is a GatewayError in the shape of the request's API."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.apis import PUT_PATHS
from gateway.apis.errors import (
    BadRequest,
    GatewayError,
    MethodNotAllowed,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    no_healthy_backend,
)
from gateway.config import Settings
from gateway.relay.asgi import Receive, Scope
from gateway.relay.client_io import client_writer
from gateway.relay.deadlines import LOOKS_PER_DEADLINE, shared_looks
from gateway.relay.inbound import (
    Headers,
    Inbound,
    bearer_token,
    parse_inbound,
    prompt_tokens_from_bytes,
)
from gateway.routing.lease import Ask, Lease
from gateway.routing.pool import Pool
from gateway.routing.sessions import ResponseStore
from gateway.turns.waiting import WaitingRoom, waits

T = TypeVar("T")


async def admit(scope: Scope, receive: Receive, settings: Settings, pool: Pool,
                responses: ResponseStore, now: float, waiting: WaitingRoom | None = None
                ) -> tuple[Inbound, Lease]:
    """The request, parsed, and its lease; raises the GatewayError the client gets. With
    turns pairs, a request that finds no server admitting waits in `waiting` (for the turn, or
    for the circuit of the server holding the memory) while its client stays."""
    if scope["method"] != "POST" and not (scope["method"] == "PUT" and scope["path"] in PUT_PATHS):
        raise method_not_allowed(scope["path"])
    headers: Headers = scope["headers"]
    check_client_key(headers, settings)
    body = await read_body(receive, settings.limits.max_body_bytes, settings.timeouts.idle_s)
    inbound = parse_inbound(scope["path"], headers, body,
                            session_headers=settings.routing.session_headers,
                            allow_pin=settings.routing.allow_pin_header,
                            aliases=settings.models)
    if pool.concurrency >= settings.limits.max_inflight:
        raise Overloaded("the gateway is at its in-flight limit; retry shortly",
                         headers={"retry-after": "1"})
    ask = Ask(inbound.session, inbound.pin, responses.holder(inbound.previous_response_id),
              prompt_tokens_from_bytes(len(body)))
    admitted = pool.admit(ask, now)
    if waiting is not None and waits(admitted):
        admitted = await wait_connected(scope, receive, waiting.admit(
            lambda: pool.admit(ask, time.monotonic())))
    if not isinstance(admitted, Lease):
        raise no_healthy_backend()
    return inbound, admitted


async def wait_connected(scope: Scope, receive: Receive, waited: Awaitable[T]) -> T:
    """`waited`, in the request's task, given up when the client leaves meanwhile: its
    task is cancelled, and the request ends as a BadRequest it no longer reads (what it held,
    the waiting room's place, is left by the cancellation)."""
    task = asyncio.current_task()
    assert task is not None  # always inside the request's task
    left = False

    def client_gone() -> None:
        nonlocal left
        if not left:
            left = True
            task.cancel()

    writer = client_writer(scope)
    listener = None
    if writer is not None:  # the server says when the client is gone
        writer.on_client_gone(client_gone)
    else:
        listener = asyncio.create_task(_until_disconnect(receive, client_gone))
    try:
        return await waited
    except asyncio.CancelledError:
        if not left or task.uncancel() > 0:  # not ours, or not ours alone
            raise
        raise BadRequest("client disconnected while waiting for a server to admit it") from None
    finally:
        if writer is not None:
            writer.on_client_gone(None)
        if listener is not None:
            listener.cancel()


async def _until_disconnect(receive: Receive, client_gone: Callable[[], None]) -> None:
    """After the whole body, the next message an ASGI server has is the client's leaving."""
    while (await receive())["type"] != "http.disconnect":
        pass
    client_gone()


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
    """The request's body, whole; RequestTimeout when none of it came for `idle_s` (a
    half-sent body must not hold a task for ever)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None  # always inside the request's task
    arriving = _Arriving(task, idle_s, loop.time())
    looks = shared_looks(loop, idle_s / LOOKS_PER_DEADLINE)
    looks.add(arriving)
    parts: list[bytes] = []
    size = 0
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)
            arriving.last = loop.time()
    except asyncio.CancelledError:
        if not arriving.expired or task.uncancel() > 0:  # not ours, or not ours alone
            raise
        # The rest of the body may still come: the connection cannot carry another request.
        raise RequestTimeout(f"the request body stopped arriving for {idle_s} s",
                             headers={"connection": "close"}) from None
    finally:
        looks.discard(arriving)


class _Arriving:
    """A request body being read, looked at by the loop's shared timer (gateway.relay.deadlines's
    Looks, every eighth of idle_s): asyncio.timeout made and cancelled a timer for every
    request, whose body has almost always arrived whole before its task runs (27k
    instructions of a request's ~1.09M, callgrind). Never early, at most a look late."""

    __slots__ = ("task", "idle_s", "last", "expired")

    def __init__(self, task: asyncio.Task[object], idle_s: float, now: float) -> None:
        self.task, self.idle_s, self.last, self.expired = task, idle_s, now, False

    def look(self, now: float) -> None:
        if not self.expired and now >= self.last + self.idle_s:
            self.expired = True
            self.task.cancel()
