"""Which requests move at a pair's flip: one pure rule, for the relay and the virtual bench.

The pool plans how many (policy.plan_moves); this picks them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def choose_moves(unstarted: Sequence[T], count: int) -> list[T]:
    """Of the movable requests that have not started, in arrival order, the `count` newest:
    they are surely queued behind MTP's running cap, while the oldest may be prefilling
    already. They are returned in arrival order, so the other server queues them in it."""
    if count <= 0:
        return []
    return list(unstarted[max(0, len(unstarted) - count):])
