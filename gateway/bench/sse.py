"""An incremental Server-Sent Events parser that tolerates any chunk boundary.

Bytes go in as they arrive (``feed``), complete events come out. A chunk may end anywhere: in
the middle of a field name, of a multi-byte UTF-8 character, or between the ``\\r`` and ``\\n``
of a CRLF. Whole events are cut by the gateway's own framer (gateway/apis/sse.py, the relay's);
within them lines end with CRLF, LF or CR (the SSE spec); lines are decoded only once complete,
so a split character is never mangled. Comment lines (``: keep-alive``) are skipped; several
``data:`` lines join with ``\\n``. ``close()`` flushes the end of the stream, dispatching a last
event even when the server forgot the blank line after it (lenient where the spec discards).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.apis.sse import EventFramer

_EOL = re.compile(rb"[\r\n]")


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str | None = None


class SSEParser:
    def __init__(self) -> None:
        self._framer = EventFramer()
        self._buf = bytearray()
        self._data: list[str] = []
        self._event: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        return self._lines(self._framer.feed(chunk))

    def _lines(self, data: bytes) -> list[SSEEvent]:
        self._buf += data
        events: list[SSEEvent] = []
        pos = 0
        while True:
            match = _EOL.search(self._buf, pos)
            if match is None:
                break
            i = match.start()
            if self._buf[i] == 0x0D:  # CR: a CRLF may be split across chunks
                if i + 1 == len(self._buf):
                    break
                end = i + 2 if self._buf[i + 1] == 0x0A else i + 1
            else:
                end = i + 1
            self._line(bytes(self._buf[pos:i]), events)
            pos = end
        del self._buf[:pos]
        return events

    def close(self) -> list[SSEEvent]:
        events = self._lines(self._framer.flush())
        if self._buf:
            rest = bytes(self._buf).rstrip(b"\r")
            self._buf.clear()
            if rest:
                self._line(rest, events)
        self._line(b"", events)
        return events

    def _line(self, raw: bytes, events: list[SSEEvent]) -> None:
        if not raw:
            if self._data:
                events.append(SSEEvent("\n".join(self._data), self._event))
            self._data, self._event = [], None
            return
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
