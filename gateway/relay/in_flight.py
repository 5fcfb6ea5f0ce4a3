"""Moves and continuations: a request handed from one server of a pair to the other while it
is in flight, the relay's side of it.

Today: at a pair's flip to plain, streams on its MTP server that have had no event move to its
plain server, whole (`InFlight.apply`, given the Flip the admission or retry that flipped
returned): the attempt waiting for the first event is cancelled, the backend told to abort,
and the lease moved; the request's task opens the stream again on the new server when it
wakes (gateway.relay.attempts). The pool plans how many (policy.plan_moves); which ones is
`gateway.routing.policy.choose_moves`.

A running stream continues on another server from what its client has (the hand-off,
gateway.relay.continuing for the I/O, gateway.continuation for the rules): when its server fails it
after the first byte (`relay_stream`, once per stream, the failure still counted against that
server), at a pair's flip with `handoff_running`, and at a turn (`continue_running`, called by the
turns controller)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from gateway.apis.errors import ContinuedElsewhere, UpstreamBroken, UpstreamError, UpstreamTimeout, let_go
from gateway.config import Settings
from gateway.metrics import GatewayMetrics
from gateway.relay.aborts import Aborts
from gateway.relay.asgi import Send
from gateway.relay.client_io import ClientWriter
from gateway.relay.continuing import FAILURE, FLIP, TURN, Plan, Uncontinuable, open_continuation, plan
from gateway.relay.deadlines import IDLE  # the watchdog's reason for a silent backend
from gateway.relay.endings import MEMORY_TURN
from gateway.relay.exchange import Continuing, Exchange, Waiting, failure_of
from gateway.relay.pump import pump
from gateway.routing.backend import BackendState
from gateway.routing.lease import Flip
from gateway.routing.policy import choose_moves
from gateway.upstream.client import UpstreamResponse

log = logging.getLogger("mtp_gateway.relay")


@dataclass(frozen=True)
class ContinueOutcome:
    """How a hand-off of one server's running streams went."""

    continued: int = 0  # re-opened on the target (its continuation's first event in)
    staying: dict[str, int] = field(default_factory=dict)  # not continued, by reason: they run on
    failed: int = 0  # the continuation could not be opened: ended with their API's error
    finished: int = 0  # ended on their own before the hand-off took them


class InFlight:
    def __init__(self, metrics: GatewayMetrics, aborts: Aborts) -> None:
        self.metrics = metrics
        self.aborts = aborts
        # The streams whose opening can be moved now (waiting for their first event), by
        # lease. Which requests have not started, and in which order, is the backends' record
        # (BackendState.unstarted).
        self.openings: dict[object, Exchange] = {}
        self.exchanges: set[Exchange] = set()  # every request relayed now (a turn ends some)
        # Streams relaying their events, per backend: what a hand-off can take.
        self.running: dict[BackendState, dict[Exchange, None]] = {}
        self.settings: Settings | None = None  # the latest a stream ran under (continue_running's)

    async def relay_stream(self, exchange: Exchange, send: Send, response: UpstreamResponse,
                           first: bytes, writer: ClientWriter | None, settings: Settings) -> None:
        """Relay a committed stream to its end; continued on another server when its server
        fails it after the first byte (once), or when a hand-off takes it."""
        self.settings = settings
        failures = 0
        while True:
            backend = exchange.lease.backend
            self.running.setdefault(backend, {})[exchange] = None
            failure: UpstreamError | None = None
            interrupted = False
            try:
                await pump(exchange, send, response, first, writer, self.metrics,
                           stop_at_error=settings.handoff.on_failure and not failures
                           and not exchange.refused)  # a refusal goes out as it was sent
                if exchange.stream_error is not None:
                    raise exchange.stream_error
                if exchange.framer.holding:
                    raise UpstreamBroken(f"backend '{backend.name}' ended the stream in the "
                                         "middle of an event")
            except ContinuedElsewhere:
                interrupted = True
            except UpstreamError as exc:
                failure = exc
            except asyncio.CancelledError:
                if exchange.deadlines.reason != IDLE or not settings.handoff.on_failure \
                        or failures:
                    raise  # ended as any interrupted request (gateway.relay.endings)
                failure = UpstreamTimeout(f"backend '{backend.name}' timeout idle", kind=IDLE)
                exchange.deadlines.resumed()
            finally:
                del self.running[backend][exchange]
                exchange.stream_error = None
            continuing, exchange.continuing = exchange.continuing, None
            if continuing is not None and interrupted:
                response, first = await self._continue(exchange, continuing)
                continue
            if continuing is not None:  # it ended (or failed) before the hand-off took it
                continuing.done.set_result("finished" if failure is None else "failed")
            if failure is None:
                return  # the backend ended the stream
            if not settings.handoff.on_failure or failures:
                raise failure
            failures += 1
            try:
                response, first = await self._continue_after(exchange, failure)
            finally:
                let_go(failure)  # handled here, whether continued or not

    async def _continue_after(self, exchange: Exchange, failure: UpstreamError
                              ) -> tuple[UpstreamResponse, bytes]:
        """The stream's server failed it: on another server, or the failure ends it."""
        planned = plan(exchange)
        if not isinstance(planned, Plan):
            log.info("not continuing a %s stream after %s: %s", exchange.inbound.path,
                     failure.kind, planned)
            raise failure
        source, now = exchange.lease.backend, time.monotonic()
        self.aborts.abort(exchange)
        placement = exchange.lease.continue_elsewhere(failure_of(failure), now)
        if placement is None or placement.backend is None:
            raise failure
        target = placement.backend
        self.apply(placement.flip)  # the decision may have flipped its pair
        log.warning("continuing a stream on %s after %s from %s", target.name, failure.kind,
                    source.name)
        try:
            return await self._reopen(exchange, planned, source, target, FAILURE)
        except Uncontinuable as exc:
            log.warning("the continuation was not built: %s", exc.message)
            raise exc.instead_of(failure) from exc

    async def _continue(self, exchange: Exchange, continuing: Continuing
                      ) -> tuple[UpstreamResponse, bytes]:
        """A hand-off took the stream: on its target, or the stream ends with the error."""
        try:
            planned = plan(exchange)
            if not isinstance(planned, Plan):  # decided before, so only a bug lands here
                raise UpstreamBroken(f"the stream cannot be continued: {planned}")
            source = exchange.lease.backend
            self.aborts.abort(exchange)
            exchange.lease.move_to(continuing.target, time.monotonic())
            opened = await self._reopen(exchange, planned, source, continuing.target, continuing.cause)
        except BaseException:
            continuing.done.set_result("failed")
            raise
        continuing.done.set_result("continued")
        return opened

    async def _reopen(self, exchange: Exchange, planned: Plan, source: BackendState,
                      target: BackendState, cause: str) -> tuple[UpstreamResponse, bytes]:
        opened = await open_continuation(self.aborts.upstream, exchange, planned, target)
        exchange.continued_from = source.name
        self.metrics.continued.labels(source.name, target.name, cause).inc()
        return opened

    def take_running(self, exchanges: list[Exchange], target: BackendState, cause: str
                     ) -> tuple[list[asyncio.Future[str]], Counter[str]]:
        """Ask the streams' tasks to continue them on `target`, those that can be; at once,
        without an await, so no event reaches a client between the decision and the ask."""
        loop = asyncio.get_running_loop()
        handed: list[asyncio.Future[str]] = []
        staying: Counter[str] = Counter()
        for exchange in exchanges:
            planned = plan(exchange)
            if not isinstance(planned, Plan):
                staying[planned] += 1
                continue
            continuing = exchange.continuing = Continuing(target, cause, loop.create_future())
            assert exchange.upstream is not None  # a running stream's response
            exchange.upstream.interrupt(ContinuedElsewhere(f"handed off to {target.name}"))
            handed.append(continuing.done)
        return handed, staying

    async def continue_running(self, source: BackendState, target: BackendState, *,
                       timeout_s: float = 10.0, wait_opened: bool = True) -> ContinueOutcome:
        """At a turn: `source`'s running streams that can be continued go on on `target`.
        Returns once each is re-opened there (its first event in) or failed, or after
        `timeout_s`; the rest stay running on `source` (ContinueOutcome.staying, by reason). Streams
        that have had no event yet are not touched (move_unstarted's). Off with
        `handoff.at_turn: false` (all stay).

        `wait_opened=False`: returns as soon as the streams are taken (each stops relaying
        from `source`, and its task aborts it there and asks `target` for the rest), with
        `continued` counting them: for a turn whose `target` is paused until `source` has
        released its memory (a paused SGLang holds new requests, tokenizer_manager.py:938-939,
        and runs them once resumed)."""
        exchanges = [e for e in self.running.get(source, ()) if e.continuing is None]
        if self.settings is not None and not self.settings.handoff.at_turn:
            return ContinueOutcome(staying={"off": len(exchanges)} if exchanges else {})
        handed, staying = self.take_running(exchanges, target, TURN)
        if not wait_opened:
            return ContinueOutcome(len(handed), dict(staying))
        if handed:
            await asyncio.wait(handed, timeout=timeout_s)
        results = Counter(f.result() if f.done() else "failed" for f in handed)
        return ContinueOutcome(results["continued"], dict(staying), results["failed"], results["finished"])

    def wait_for_first_event(self, exchange: Exchange) -> Waiting:
        """The stream's opening, in the request's task, may be moved until `done_waiting`."""
        task = asyncio.current_task()
        assert task is not None  # always inside the request's task
        waiting = exchange.waiting = Waiting(task)
        self.openings[exchange.lease] = exchange
        return waiting

    def done_waiting(self, exchange: Exchange) -> None:
        del self.openings[exchange.lease]
        exchange.waiting = None

    def apply(self, flip: Flip | None) -> None:
        """A flip's moves (`routing.move_unstarted`): of the streams on the pair's MTP server
        that have had no event, those `choose_moves` picks move to its plain server."""
        if flip is None:
            return
        now = time.monotonic()
        candidates = self._unstarted_streams(flip.source, flip.target)
        for exchange in choose_moves(candidates, flip.moves.not_started):
            self._move(exchange, flip.target, now)
        if flip.moves.running:  # routing.handoff_running: the oldest streams first
            running = [e for e in self.running.get(flip.source, ()) if e.continuing is None
                       and e.lease.movable][:flip.moves.running]
            self.take_running(running, flip.target, FLIP)

    def running_tokens(self, source: BackendState, tokens_per_piece: float) -> int:
        """What continuing `source`'s running streams elsewhere makes the other server prefill:
        each one's prompt (as estimated at admission) and its output so far, the pieces
        relayed times `tokens_per_piece`. Read when a turn is decided, never per chunk."""
        return sum(e.lease.ask.prompt_tokens + round(e.relayed_pieces() * tokens_per_piece)
                   for e in self.running.get(source, ()))

    def move_all_unstarted(self, source: BackendState, target: BackendState) -> int:
        """A turn: every stream on `source` that has had no byte moves to `target` (which
        holds new requests while paused: SGLang's tokenizer_manager.py:938-939)."""
        now = time.monotonic()
        chosen = self._unstarted_streams(source, target)
        for exchange in chosen:
            self._move(exchange, target, now)
        return len(chosen)

    def end_running(self, source: BackendState, why: str) -> int:
        """A turn: every request still on `source` ends now, with an error in its API's
        shape (errors.EndedByTurn), its upstream aborted."""
        ending = [e for e in self.exchanges if e.lease.backend is source and not e.lease.ended]
        for exchange in ending:
            exchange.deadlines.kick(MEMORY_TURN)
        return len(ending)

    def _unstarted_streams(self, source: BackendState, target: BackendState) -> list[Exchange]:
        """The streams on `source` that have had no event and may move to `target`, in
        arrival order."""
        return [exchange for lease in source.unstarted
                if (exchange := self.openings.get(lease)) is not None
                and movable(exchange, source, target)]

    def _move(self, exchange: Exchange, target: BackendState, now: float) -> None:
        """Cancel the attempt where it waits (SGLang frees its queue slot at the abort, not at
        its own disconnect check) and hand the lease to `target`; the request's task opens it
        there when it wakes."""
        source, waiting = exchange.lease.backend, exchange.waiting
        assert waiting is not None
        waiting.moved = True
        waiting.task.cancel()  # the opening's next step is its end: nothing more sent or read
        self.aborts.abort(exchange)
        exchange.lease.move_to(target, now)
        self.metrics.moves.labels(source.name, target.name).inc()


def movable(exchange: Exchange, source: BackendState, target: BackendState) -> bool:
    """A stream still waiting on `source` for its first event that says anything: no byte of
    one has come (taken, or waiting to be read; whole lead-in events only), neither pinned
    nor bound to `source` (Lease.movable), and `target` has not failed it already."""
    waiting, upstream = exchange.waiting, exchange.upstream
    return (waiting is not None and not waiting.moved and not waiting.mid_event
            and (upstream is None or not upstream.unread)
            and exchange.lease.backend is source and exchange.lease.movable
            and all(attempt.backend is not target for attempt in exchange.lease.attempts))
