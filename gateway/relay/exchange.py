"""One proxied request on its way through the relay: what every step of it shares.

Each relay module owns its own part (the attempt runner the upstream response and framer, the
hand-over the wait for a first event, the endings how it ended); how the request ended is
written in one place, `Exchange.settle`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from gateway.apis.errors import UpstreamError, UpstreamRefused, UpstreamStatus
from gateway.apis.sse import EventFramer
from gateway.config import Handoff
from gateway.relay.deadlines import Deadlines
from gateway.relay.inbound import Headers, Inbound
from gateway.routing.backend import BackendState
from gateway.routing.lease import Failure, Lease, Outcome
from gateway.upstream.client import UpstreamResponse

RECENT_CHUNKS = 4  # read for usage and the ending: SGLang's error, usage and [DONE] come apart


@dataclass(eq=False)
class Waiting:
    """A stream's opening while it waits for its first event: what a planned move at the
    flip interrupts (see gateway.relay.in_flight). The opening runs in the request's own `task`."""

    task: asyncio.Task[Any]
    moved: bool = False  # a planned move cancelled `task` where the opening waits
    # Of the backend's bytes this attempt took, some end inside an event (the answer may have
    # begun): not movable. Whole lead-in events (Responses' response.created) say nothing yet.
    mid_event: bool = False


@dataclass(eq=False)
class Continuing:
    """A hand-off of a running stream to `target`: `done` says how it went ("continued",
    "failed", or "finished": it ended on its own first)."""

    target: BackendState
    cause: str
    done: asyncio.Future[str]


@dataclass(eq=False)
class Exchange:
    """One request: the facts, the lease, what has been sent, and how it ended."""

    inbound: Inbound
    client_headers: Headers
    lease: Lease
    started: float
    deadlines: Deadlines
    committed: bool = False  # response headers went to the client: no more retries
    status: int = 0  # what the client got, for the access log
    first_byte_at: float | None = None
    upstream: UpstreamResponse | None = None  # the current attempt's response
    framer: EventFramer = field(default_factory=EventFramer)  # whole events out, one per attempt
    # The events sent, as the pieces they came in: the last few say how it ended
    # (RECENT_CHUNKS), the whole is the transcript of a continuation (gateway.relay.continuing), up to
    # `transcript_chunks` pieces (handoff.transcript_chunks): beyond it the stream is not
    # continued and all but the last few are let go of (`bound_transcript`).
    recent: list[bytes] = field(default_factory=list)
    transcript_chunks: int = Handoff().transcript_chunks
    dropped: int = 0  # pieces let go of from the front of `recent`
    waiting: Waiting | None = None  # while a stream waits for its first event
    refused: bool = False  # the stream relayed is the backend's own refusal
    tokens: tuple[int, int] | None = None  # prompt and completion tokens, when usage was seen
    continuing: Continuing | None = None  # a hand-off asked for, until the stream is continued
    continued_from: str | None = None  # the server a continuation took it off (the last)
    stream_error: UpstreamError | None = None  # its server's own error event, not relayed
    # How it ended, written by settle() only:
    outcome: Outcome | None = None  # for the lease (None: a bug, judged the gateway's)
    failure: Failure | None = None  # the last attempt's failure, with BACKEND_FAILURE
    ended: str = "complete"  # for the access log

    def settle(self, outcome: Outcome, ended: str | None = None,
               failure: Failure | None = None) -> None:
        """How the request ended (the last word counts): `Lease.end` is told it at the end."""
        self.outcome = outcome
        if ended is not None:
            self.ended = ended
        if failure is not None:
            self.failure = failure

    def relayed_pieces(self) -> int:
        """The pieces that carried events to the client, those let go of included."""
        return self.dropped + len(self.recent)

    def transcript_whole(self) -> bool:
        """Every event sent is still kept: the stream can be read back for a continuation."""
        return self.relayed_pieces() <= self.transcript_chunks

    def bound_transcript(self) -> None:
        """Beyond its bound, all but the last few pieces are let go of (called now and then,
        not per piece: the watchdog's looks; the decision is `transcript_whole`'s)."""
        recent = self.recent
        if len(recent) > RECENT_CHUNKS and (self.dropped or len(recent) > self.transcript_chunks):
            cut = len(recent) - RECENT_CHUNKS
            del recent[:cut]
            self.dropped += cut

    def refuse(self, failure: Failure) -> None:
        """The backend's refusal in its stream goes to the client as sent: the backend
        failed the request, whatever happens next."""
        self.refused, self.failure = True, failure


def failure_of(exc: UpstreamError) -> Failure:
    """A backend's failure as its lease judges it. The backend answered, with an error (a 5xx,
    or one in its stream's first event): when the other server answers the same request the
    same way, the request is the cause."""
    return Failure(exc.kind, answered=isinstance(exc, UpstreamStatus | UpstreamRefused))
