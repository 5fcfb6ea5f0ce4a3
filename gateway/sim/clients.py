"""A handler waiting on the engine while its client may leave (what SGLang's HTTP layer sees)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while the handler was waiting."""


async def until_or_disconnect(work: Awaitable[T], request: Request) -> T:
    """``work``'s result; raises ClientGone (and cancels ``work``) if the client goes first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
    if task.cancelled():
        raise ClientGone
    return task.result()


async def wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
