"""Every deadline of a request without a timeout context per chunk, nor a clock read per piece.

Each request has one timer of its own, for the deadlines that do not move: the total, and a
stream's first byte. From a stream's first byte on, its idle and keep-alive deadlines are
looked at by one timer for every stream of the loop (`Looks`), every eighth of the keep-alive
interval and of `idle_s`: a stream's timer would be made and cancelled each time (12.4k
instructions, callgrind), the shared look costs a call per stream. While a stream relays, the
watchdog `follow`s a count of what the backend has sent and a look that sees it grown dates the
backend's last bytes to itself (the relay's hot loop does nothing for the watchdog: a clock
read per piece was 1,100 instructions of every chunk's ~15,000). So these deadlines are never
early and at most two looks (a quarter) late.

When a deadline passes (first byte, idle, total), the client disconnects, or the stream has
been silent long enough to need a keep-alive comment, the watchdog cancels the request's task
and records why; the relay catches the CancelledError, reads `reason`, and either ends the
request cleanly or, for a keep-alive, uncancels, writes the comment and reads on.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Protocol

from gateway.config import Timeouts

KEEPALIVE = "keepalive"
CLIENT_GONE = "client_disconnect"
IDLE = "timeout_idle"
LOOKS_PER_DEADLINE = 8  # a stream's idle and keep-alive deadlines are looked at this often


class Deadlines:
    def __init__(self, timeouts: Timeouts, task: asyncio.Task[object], *, stream: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = task
        self._timeouts = timeouts
        started = self._started = self._loop.time()  # the loop's clock: timers run on it
        # A non-streamed answer arrives all at once at the end: only the total deadline fits.
        self._stream = stream
        self._keepalive_s = timeouts.keepalive_s if stream else 0.0
        self.reason: str | None = None
        self.last_activity = started  # last bytes from the backend: the idle deadline
        self.last_sent = started  # last write to the client, keep-alives included
        self.first_byte_seen = False
        self.reading = False  # True only while awaiting upstream bytes: safe to interrupt
        self._handle: asyncio.TimerHandle | None = None
        self._looks: Looks | None = None  # from a stream's first byte until stop()
        self._progress: Callable[[], int] | None = None  # while following a relaying stream
        self._seen = 0  # the progress count at the last look
        keepalive_s = self._keepalive_s or timeouts.idle_s
        self._look_s = min(keepalive_s, timeouts.idle_s) / LOOKS_PER_DEADLINE

    def start(self) -> None:
        self._arm()

    def stop(self) -> None:
        self._cancel_timer()
        if self._looks is not None:
            self._looks.discard(self)
            self._looks = None

    def got_bytes(self) -> None:
        """Bytes from the backend, now (before a stream relays: its first events)."""
        self.last_activity = self.last_sent = self._loop.time()
        if not self.first_byte_seen:
            self.first_byte_seen = True
            if self._stream:  # from here on its idle and keep-alive deadlines are looked at
                self._looks = shared_looks(self._loop, self._look_s)
                self._looks.add(self)

    def follow(self, progress: Callable[[], int] | None) -> None:
        """From now on (until `follow(None)`) the backend's bytes are known by `progress()`, a
        count that grows with every piece it sends, read at each look instead of a clock read
        per piece."""
        self._progress = progress
        if progress is not None:
            self._seen = progress()

    def kick(self, reason: str) -> None:
        """Interrupt the request now (client gone, shutdown)."""
        if self.reason is None or self.reason == KEEPALIVE:
            self.reason = reason
            self._task.cancel()

    def client_gone(self) -> None:
        """The client's connection is lost: interrupt the request now."""
        self.kick(CLIENT_GONE)

    def resumed(self) -> None:
        """The request goes on after its interruption (a stream continued elsewhere after an
        idle timeout): cleared, and the idle deadline counted from now."""
        self.reason = None
        self._task.uncancel()
        self.last_activity = self.last_sent = self._loop.time()
        if self._handle is None:  # it fired while the request was interrupted
            self._arm()

    def handled_keepalive(self) -> None:
        """The relay wrote a keep-alive comment: clear the interruption."""
        self.reason = None
        self._task.uncancel()
        self.last_sent = self._loop.time()  # not last_activity: the backend is still silent

    def look(self, now: float) -> None:
        """A stream's idle and keep-alive deadlines, now (`Looks`, after its first byte)."""
        if self.reason is not None:
            return
        progress = self._progress
        if progress is not None:
            seen = progress()
            if seen != self._seen:  # bytes since the last look: dated now, nothing is due
                self._seen = seen
                self.last_activity = self.last_sent = now
                return
        if now >= self.last_activity + self._timeouts.idle_s:
            self.kick(IDLE)
        elif self._keepalive_s > 0 and now >= self.last_sent + self._keepalive_s \
                and self.reading:  # not reading: busy writing to a slow client, the next look
            self.kick(KEEPALIVE)

    def _cancel_timer(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        """The request's own timer: the total deadline, and before the first byte a stream's."""
        self._cancel_timer()
        t = self._timeouts
        when = self._started + t.total_s
        if self._stream and not self.first_byte_seen:
            when = min(when, self._started + t.first_byte_s)
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self.reason is not None:
            return
        now, t = self._loop.time(), self._timeouts
        if now >= self._started + t.total_s:
            self.kick("timeout_total")
        elif self._stream and not self.first_byte_seen and now >= self._started + t.first_byte_s:
            self.kick("timeout_first_byte")
        else:
            self._arm()


class Looked(Protocol):
    def look(self, now: float) -> None:
        """Its deadlines, now."""


class Looks:
    """One timer for every stream (or body being read) of a loop with the same look interval:
    each look calls every one's `look`, a call where a timer each was one made and one
    cancelled."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        self.loop = weakref.ref(loop)  # no reference to it from _LOOKS
        self._interval_s = interval_s
        self._watchdogs: dict[Looked, None] = {}  # a watchdog: from its first byte to its stop()
        self._handle: asyncio.TimerHandle | None = None

    def add(self, watchdog: Looked) -> None:
        self._watchdogs[watchdog] = None
        loop = self.loop()
        if self._handle is None and loop is not None:
            self._handle = loop.call_at(loop.time() + self._interval_s, self._look)

    def discard(self, watchdog: Looked) -> None:
        self._watchdogs.pop(watchdog, None)

    def _look(self) -> None:
        self._handle = None
        loop = self.loop()
        if loop is None or not self._watchdogs:
            return
        now = loop.time()
        for watchdog in list(self._watchdogs):
            watchdog.look(now)
        self._handle = loop.call_at(now + self._interval_s, self._look)


_LOOKS: dict[tuple[int, float], Looks] = {}  # by the loop's id (a WeakKeyDictionary makes a
# weak reference at every look-up) and the interval (tests run gateways of several settings)


def shared_looks(loop: asyncio.AbstractEventLoop, interval_s: float) -> Looks:
    """The loop's shared look at this interval."""
    key = (id(loop), interval_s)
    looks = _LOOKS.get(key)
    if looks is None or looks.loop() is not loop:  # none yet, or an ended loop's id reused
        looks = _LOOKS[key] = Looks(loop, interval_s)
    return looks
