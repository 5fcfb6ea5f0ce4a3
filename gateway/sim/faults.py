"""Fault injection for one simulated server (reliability tests of the gateway).

Set by :class:`SimOptions` at start, by ``POST /sim/faults`` (JSON with the fields of
:class:`Faults`; fields left out take their defaults, so a POST replaces the whole set) or from
Python (``await pair.servers["mtp"].set_faults(Faults(...))``); ``DELETE /sim/faults`` clears.

- ``crash_after_chunks``: a stream sends N SSE events, then the connection drops (no [DONE]);
  a non-stream response sends its headers, then drops.
- ``error_after_chunks``: a stream sends N events, then SGLang's mid-stream error event and [DONE].
- ``hang_before_first_byte``: generation requests (and /health) wait, sending nothing, until
  the fault is cleared or the client goes away.
- ``fail_status`` (+ ``fail_count``): generation requests get that HTTP status with SGLang's flat
  error body; ``fail_count`` requests only (None: until cleared); /health answers 503 meanwhile.
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
            if field.name in raw and not _has_type(raw[field.name], field.type):
                raise ValueError(f"{field.name} must be {field.type}")
        faults = cls(**raw)
        if faults.slow_factor <= 0:
            raise ValueError("slow_factor must be > 0")
        if faults.fail_status is not None and not 400 <= faults.fail_status <= 599:
            raise ValueError("fail_status must be an HTTP error status")
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
        self._failures_left: int | None = None
        self._restore_task: asyncio.Task[None] | None = None

    async def set(self, faults: Faults) -> None:
        refusing_before = self.faults.refuse_connections
        self.faults = faults
        self._failures_left = faults.fail_count
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
        if status is None:
            return None
        if self._failures_left is not None:
            if self._failures_left <= 0:
                return None
            self._failures_left -= 1
        return status

    @property
    def failing(self) -> bool:
        return self.faults.fail_status is not None and self._failures_left != 0

    async def wait_unhung(self) -> None:
        await self._unhung.wait()

    def close(self) -> None:
        self._unhung.set()  # let hung handlers go so the server can stop
        if self._restore_task is not None:
            self._restore_task.cancel()
