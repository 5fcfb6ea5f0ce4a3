"""One timer per request for every deadline, instead of a timeout context per chunk.

The relay's hot loop does nothing for the watchdog: while a stream relays, the watchdog
`follow`s a count of what the backend has sent and compares it when its timer fires, looking at
least every quarter of the keep-alive interval and of `idle_s` (a clock read per piece was
1,100 instructions of every chunk's ~15,000). A look that sees the count grown dates the
backend's last bytes to itself: a deadline is never early and at most a quarter late. A
stream's timer is never further than a look from the start, so its first byte re-arms nothing.
When a deadline passes (first byte, idle, total), the client disconnects, or the stream has
been silent long enough to need a keep-alive comment, the watchdog cancels the request's task
and records why; the relay catches the CancelledError, reads `reason`, and either ends the
request cleanly or, for a keep-alive, uncancels, writes the comment and reads on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.config import Timeouts

KEEPALIVE = "keepalive"
CLIENT_GONE = "client_disconnect"
LOOKS_PER_DEADLINE = 4  # while following a stream: the idle and keep-alive deadlines' precision


class Watchdog:
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
        self._progress: Callable[[], int] | None = None  # while following a relaying stream
        self._seen = 0  # the progress count at the last look
        keepalive_s = self._keepalive_s or timeouts.idle_s
        self._look_s = min(keepalive_s, timeouts.idle_s) / LOOKS_PER_DEADLINE

    def start(self) -> None:
        self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def got_bytes(self) -> None:
        """Bytes from the backend, now (before a stream relays: its first events)."""
        self.last_activity = self.last_sent = self._loop.time()
        # From here on the idle deadline applies: the next look (a stream's timer is never
        # further than _look_s) arms for it, no timer made and cancelled here (12k
        # instructions a request).
        self.first_byte_seen = True

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

    def resumed(self) -> None:
        """The request goes on after its interruption (a stream continued elsewhere after an
        idle timeout): cleared, and the idle deadline counted from now."""
        self.reason = None
        self._task.uncancel()
        self.last_activity = self.last_sent = self._loop.time()
        self._arm()

    def handled_keepalive(self) -> None:
        """The relay wrote a keep-alive comment: clear the interruption and re-arm."""
        self.reason = None
        self._task.uncancel()
        self.last_sent = self._loop.time()  # not last_activity: the backend is still silent
        self._arm()

    def _deadlines(self) -> list[tuple[float, str]]:
        t = self._timeouts
        deadlines = [(self._started + t.total_s, "timeout_total")]
        if not self._stream:
            return deadlines
        if self.first_byte_seen:
            deadlines.append((self.last_activity + t.idle_s, "timeout_idle"))
        else:
            deadlines.append((self._started + t.first_byte_s, "timeout_first_byte"))
        if self._keepalive_s > 0 and self.first_byte_seen:  # before it: relay._attempt's job
            deadlines.append((self.last_sent + self._keepalive_s, KEEPALIVE))
        return deadlines

    def _arm(self) -> None:
        self.stop()
        when = min(deadline for deadline, _ in self._deadlines())
        if self._stream:  # a stream may be followed, or see its first byte: look again soon
            when = min(when, self._loop.time() + self._look_s)
        self._handle = self._loop.call_at(when, self._fire)

    def _look(self, now: float) -> None:
        """A stream's bytes since the last look are dated now: at most a look late."""
        progress = self._progress
        if progress is not None:
            seen = progress()
            if seen != self._seen:
                self._seen = seen
                self.last_activity = self.last_sent = now

    def _fire(self) -> None:
        self._handle = None
        if self.reason is not None:
            return
        now = self._loop.time()
        self._look(now)
        due = [reason for deadline, reason in self._deadlines() if deadline <= now]
        timeouts = [reason for reason in due if reason != KEEPALIVE]
        if timeouts:
            self.kick(timeouts[0])
            return
        if due and self.reading:
            self.kick(KEEPALIVE)
            return
        if due:  # silent but busy writing to a slow client: look again shortly
            self._handle = self._loop.call_at(now + 0.5, self._fire)
            return
        self._arm()
