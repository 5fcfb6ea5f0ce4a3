"""The access log: one logfmt line per proxied request."""

from __future__ import annotations

import logging
import time

access = logging.getLogger("mtp_gateway.access")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class SecondsOnceFormatter(logging.Formatter):
    """logging's Formatter, the same lines, with the time's seconds formatted once a second:
    time.localtime and strftime were 12.8k instructions of every line's ~29k (callgrind,
    Formatter.formatTime alone), and the access line is one per request."""

    def __init__(self, fmt: str | None = None) -> None:
        super().__init__(fmt)
        self._seconds: tuple[int, str] = (-1, "")  # one tuple: read and replaced whole

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second, text = self._seconds
        if second != int(record.created):
            second = int(record.created)
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._seconds = (second, text)
        msec_format = self.default_msec_format
        return msec_format % (text, record.msecs) if msec_format else text


def log_handler() -> logging.Handler:
    """The gateway's log lines on stderr, as logging.basicConfig(format=LOG_FORMAT) writes them."""
    handler = logging.StreamHandler()
    handler.setFormatter(SecondsOnceFormatter(LOG_FORMAT))
    return handler


def log_access(path: str, backend: str | None, reason: str | None, status: int,
               ttft: float | None, started: float, ended: str,
               tokens: tuple[int, int] | None, moved_from: str | None = None,
               continued_from: str | None = None) -> None:
    """One line per request, logfmt: what an operator greps for when a client complains."""
    if not access.isEnabledFor(logging.INFO):
        return
    args = (path, backend or "-", reason or "-", status, "-" if ttft is None else f"{ttft * 1000:.1f}",
            (time.monotonic() - started) * 1000, "-" if tokens is None else tokens[0],
            "-" if tokens is None else tokens[1], ended, moved_from or "-", continued_from or "-")
    # access.info's record, less its walk up the stack for the caller (findCaller): the
    # caller is always this function (14k instructions a request, of the line's ~90k).
    access.handle(access.makeRecord(access.name, logging.INFO, __file__, _LINE, _FORMAT, args,
                                    None, "log_access"))


_FORMAT = ("path=%s backend=%s reason=%s status=%d ttft_ms=%s duration_ms=%.1f prompt_tokens=%s "
           "completion_tokens=%s ended=%s moved_from=%s continued_from=%s")
_LINE = log_access.__code__.co_firstlineno
