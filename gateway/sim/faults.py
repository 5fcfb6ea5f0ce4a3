"""Fault injection for one simulated server (reliability tests of the gateway).

Set by :class:`SimOptions` at start, by ``POST /sim/faults`` (JSON with the fields of
:class:`Faults`; fields left out take their defaults, so a POST replaces the whole set) or from
Python (``await pair.servers["mtp"].set_faults(Faults(...))``); ``DELETE /sim/faults`` clears.

Which SGLang behaviour each one stands for is in docs/compat.md.

- ``abort_status`` (+ ``abort_count``): SGLang's scheduler aborts the request with that HTTP
  status (as it does for a full queue, 503): a stream gets HTTP 200 whose first event is the
  error (then usage if asked, then [DONE]; ``event: error`` on /v1/messages, ``response.failed``
  on /v1/responses); a non-stream request gets the status. With ``error_after_chunks`` the abort
  comes after that many events instead (status 500 when ``abort_status`` is unset).
- ``crash_after_chunks``: a stream sends N SSE events, then the connection drops (no [DONE]);
  a non-stream response sends its headers, then drops.
- ``error_after_chunks``: a stream sends N events, then SGLang's mid-stream error event (see
  ``abort_status``).
- ``hang_before_first_byte``: generation requests (and /health) wait, sending nothing, until
  the fault is cleared or the client goes away.
- ``fail_status`` (+ ``fail_count``): generation requests get that HTTP status before any byte,
  in the error shape of their API; ``fail_count`` requests only (None: until cleared); /health
  answers 503 meanwhile. SGLang itself answers a stream that way only for a 400 (validation):
  a 5xx before the stream is what a proxy in front of it, or a dying process, sends.
- ``slow_factor``: every engine step takes that many times longer.
- ``refuse_connections``: the server goes down like a crashed process: the listening socket
  closes (connects are refused), open connections drop, running requests are lost; clearing it
  listens again on the SAME port, like a restarted backend.
  ``restore_after_s`` (wall seconds) re-opens by itself; needed when you cannot reach Python,
  since a refusing server cannot receive the DELETE.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Faults:
    crash_after_chunks: int | None = None
    error_after_chunks: int | None = None
    hang_before_first_byte: bool = False
    fail_status: int | None = None
    fail_count: int | None = None
    abort_status: int | None = None
    abort_count: int | None = None
    slow_factor: float = 1.0
    refuse_connections: bool = False
    restore_after_s: float | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Faults:
        """Build from an admin request body; raises ValueError on unknown fields or bad values."""
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        for field in dataclasses.fields(cls):
            # A string, never a type: this module has `from __future__ import annotations`.
            assert isinstance(field.type, str)
            if field.name in raw and not _has_type(raw[field.name], field.type):
                raise ValueError(f"{field.name} must be {field.type}")
        faults = cls(**raw)
        if faults.slow_factor <= 0:
            raise ValueError("slow_factor must be > 0")
        for name in ("fail_status", "abort_status"):
            status = getattr(faults, name)
            if status is not None and not 400 <= status <= 599:
                raise ValueError(f"{name} must be an HTTP error status")
        return faults


def _has_type(value: Any, annotation: str) -> bool:
    """JSON value against a field's annotation ("int | None", "float", "bool", ...)."""
    if value is None:
        return "None" in annotation
    if isinstance(value, bool):  # JSON true is no count
        return annotation.startswith("bool")
    if isinstance(value, int):
        return annotation.startswith(("int", "float"))
    return isinstance(value, float) and annotation.startswith("float")


class FaultState:
    """The faults in force on one server, and the waiting they cause."""

    def __init__(self, on_refuse: Callable[[bool], Awaitable[None]] | None = None) -> None:
        self.faults = Faults()
        self._on_refuse = on_refuse  # the server stops/starts listening
        self._unhung = asyncio.Event()
        self._unhung.set()
        self._failures = _Countdown(None)
        self._aborts = _Countdown(None)
        self._restore_task: asyncio.Task[None] | None = None

    async def set(self, faults: Faults) -> None:
        refusing_before = self.faults.refuse_connections
        self.faults = faults
        self._failures = _Countdown(faults.fail_count)
        self._aborts = _Countdown(faults.abort_count)
        if faults.hang_before_first_byte:
            self._unhung.clear()
        else:
            self._unhung.set()
        if self._on_refuse is not None and faults.refuse_connections != refusing_before:
            await self._on_refuse(faults.refuse_connections)
        pending = self._restore_task
        if pending is not None and pending is not asyncio.current_task():
            pending.cancel()  # a timer from an earlier fault must not end this one
        self._restore_task = None
        if faults.refuse_connections and faults.restore_after_s is not None:
            self._restore_task = asyncio.create_task(self._restore_later(faults.restore_after_s))

    async def clear(self) -> None:
        await self.set(Faults())

    async def _restore_later(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self.set(dataclasses.replace(self.faults, refuse_connections=False))

    def take_failure(self) -> int | None:
        """The status to fail this request with, or None; counts down ``fail_count``."""
        status = self.faults.fail_status
        return status if status is not None and self._failures.take() else None

    def take_abort_at_start(self) -> int | None:
        """The status the scheduler aborts this request with before its first token, or None;
        counts down ``abort_count`` (a mid-stream abort, ``error_after_chunks``, does not)."""
        status = self.faults.abort_status
        if status is None or self.faults.error_after_chunks is not None:
            return None
        return status if self._aborts.take() else None

    @property
    def failing(self) -> bool:
        return self.faults.fail_status is not None and self._failures.left != 0

    async def wait_unhung(self) -> None:
        await self._unhung.wait()

    def close(self) -> None:
        self._unhung.set()  # let hung handlers go so the server can stop
        if self._restore_task is not None:
            self._restore_task.cancel()


class _Countdown:
    """How many more times a counted fault fires (None: every time)."""

    def __init__(self, count: int | None) -> None:
        self.left = count

    def take(self) -> bool:
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True
