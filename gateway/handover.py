"""Moves and continuations: a request handed from one server of a pair to the other while it
is in flight, the relay's side of it.

Today: at a pair's flip to plain, streams on its MTP server that have had no event move to its
plain server, whole (`Handover.move_unstarted`): the attempt waiting for the first event is
cancelled, the backend told to abort, and the lease moved; the request's task opens the
stream again on the new server when it wakes (gateway.attempts). The pool plans how many
(policy.plan_moves); which ones is `gateway.moves.choose_moves`.

A running stream's continuation on the other server (the hand-off) belongs here too."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gateway.aborts import Aborts
from gateway.backends import BackendState
from gateway.endings import MEMORY_TURN
from gateway.exchange import Exchange, Waiting
from gateway.metrics import GatewayMetrics
from gateway.moves import choose_moves
from gateway.pool import Pool
from gateway.upstream import UpstreamResponse


class Handover:
    def __init__(self, pool: Pool, metrics: GatewayMetrics, aborts: Aborts) -> None:
        self.pool = pool
        self.metrics = metrics
        self.aborts = aborts
        # Streams waiting for their first event, per backend, in arrival order: what a
        # planned move at a pair's flip can take.
        self.unstarted: dict[BackendState, dict[Exchange, None]] = {}
        self.exchanges: set[Exchange] = set()  # every request relayed now (a turn ends some)

    def wait_for_first_event(self, exchange: Exchange,
                             opening: asyncio.Future[tuple[UpstreamResponse, bytes]]) -> Waiting:
        """The stream's opening may be moved until `done_waiting`."""
        waiting = exchange.waiting = Waiting(opening, asyncio.get_running_loop().create_future())
        self.unstarted.setdefault(exchange.lease.backend, {})[exchange] = None
        return waiting

    def done_waiting(self, exchange: Exchange, backend: BackendState) -> None:
        del self.unstarted[backend][exchange]
        exchange.waiting = None

    def move_unstarted(self) -> None:
        """At a pair's flip to plain, streams on its MTP server that have had no byte move to
        its plain server, as many as the pool plans (`routing.move_unstarted`)."""
        now = time.monotonic()
        for name, moves in self.pool.take_moves(now).items():
            pair = self.pool.pairs[name]
            source, target = pair.backends["mtp"], pair.backends["plain"]
            candidates = [e for e in self.unstarted.get(source, ()) if movable(e, source, target)]
            for exchange in choose_moves(candidates, moves.not_started):
                self._move(exchange, target, now)

    def move_all_unstarted(self, source: BackendState, target: BackendState) -> int:
        """A turn: every stream on `source` that has had no byte moves to `target` (which
        holds new requests while paused: SGLang's tokenizer_manager.py:938-939)."""
        now = time.monotonic()
        chosen = [e for e in self.unstarted.get(source, ()) if movable(e, source, target)]
        for exchange in chosen:
            self._move(exchange, target, now)
        return len(chosen)

    def end_running(self, source: BackendState, why: str) -> int:
        """A turn: every request still on `source` ends now, with an error in its API's
        shape (errors.EndedByTurn), its upstream aborted."""
        ending = [e for e in self.exchanges if e.lease.backend is source and not e.lease.ended]
        for exchange in ending:
            exchange.watchdog.kick(MEMORY_TURN)
        return len(ending)

    def _move(self, exchange: Exchange, target: BackendState, now: float) -> None:
        """Cancel the attempt where it waits (SGLang frees its queue slot at the abort, not at
        its own disconnect check) and hand the lease to `target`; the request's task opens it
        there when it wakes."""
        source, waiting = exchange.lease.backend, exchange.waiting
        assert waiting is not None
        waiting.opening.cancel()  # its next step is the end: nothing more is sent or read
        self.aborts.abort(exchange)
        exchange.lease.move_to(target, now)
        waiting.moved.set_result(None)
        self.metrics.moves.labels(source.name, target.name).inc()


def movable(exchange: Exchange, source: BackendState, target: BackendState) -> bool:
    """A stream still waiting on `source` for its first event that says anything: no byte of
    one has come (taken, or waiting to be read; whole lead-in events only), neither pinned
    nor bound to `source` (Lease.movable), and `target` has not failed it already."""
    waiting, upstream = exchange.waiting, exchange.upstream
    return (waiting is not None and not waiting.opening.done() and not waiting.moved.done()
            and not waiting.mid_event
            and (upstream is None or not upstream.unread)
            and exchange.lease.backend is source and exchange.lease.movable
            and all(attempt.backend is not target for attempt in exchange.lease.attempts))


async def unwind(opening: asyncio.Future[Any]) -> None:
    """Wait until an opening the move cancelled has let go of everything; what it raised or
    returned is dropped (its response was closed)."""
    await asyncio.wait((opening,))
    if not opening.cancelled():
        opening.exception()  # retrieved: a failure of the old attempt judges no one
