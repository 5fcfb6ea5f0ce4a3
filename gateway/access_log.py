"""The access log: one logfmt line per proxied request."""

from __future__ import annotations

import logging
import sys
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
        return self.asctime(record.created, record.msecs)

    def asctime(self, created: float, msecs: float) -> str:
        """formatTime's text for a record made at `created` (time.time()) with its `msecs`."""
        second, text = self._seconds
        if second != int(created):
            second = int(created)
            text = time.strftime(self.default_time_format, self.converter(created))
            self._seconds = (second, text)
        msec_format = self.default_msec_format
        return msec_format % (text, msecs) if msec_format else text


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
    handler = _plain_handler()
    if handler is None:
        access.handle(_record(args))
        return
    _write_plain(handler, args)


def _record(args: tuple[object, ...]) -> logging.LogRecord:
    # access.info's record, less its walk up the stack for the caller (findCaller): the
    # caller is always log_access (14k instructions a request, of the line's ~90k).
    return access.makeRecord(access.name, logging.INFO, __file__, _LINE, _FORMAT, args, None,
                             "log_access")


def _plain_handler() -> logging.StreamHandler | None:  # type: ignore[type-arg]
    """The one handler the line reaches when logging is as the gateway's own set-up leaves it
    (log_handler(), no filter on the way, logging's own records), or None: the line then goes
    through logging, so a handler, filter, formatter or record factory anyone added sees it."""
    if access.filters or logging.getLogRecordFactory() is not logging.LogRecord:
        return None
    found: logging.Handler | None = None
    logger: logging.Logger | None = access
    while logger is not None:  # Logger.callHandlers' walk
        for handler in logger.handlers:
            if found is not None:
                return None
            found = handler
        logger = logger.parent if logger.propagate else None
    if type(found) is not logging.StreamHandler or found.filters or found.level > logging.INFO:
        return None
    formatter = found.formatter
    if type(formatter) is not SecondsOnceFormatter or formatter._fmt != LOG_FORMAT \
            or formatter.datefmt is not None:
        return None
    return found


def _write_plain(handler: logging.StreamHandler, args: tuple[object, ...]) -> None:  # type: ignore[type-arg]
    """The line StreamHandler.emit writes for the record logging would make, without making
    it: the record, Handler.handle and Formatter.format were ~60k instructions a request."""
    formatter = handler.formatter
    assert isinstance(formatter, SecondsOnceFormatter)  # _plain_handler's finding
    line = (f"{formatter.asctime(*_record_time())} {logging.getLevelName(logging.INFO)} "
            f"{access.name}: {_FORMAT % args}{handler.terminator}")
    with handler.lock:  # type: ignore[union-attr]  # as Handler.handle
        try:
            handler.stream.write(line)
            handler.flush()
        except RecursionError:
            raise
        except Exception:
            handler.handleError(_record(args))


def _record_time() -> tuple[float, float]:
    """A LogRecord's `created` and `msecs`, as this Python's LogRecord takes them (gh-89047;
    from time_ns since 3.13, gh-102402)."""
    if sys.version_info >= (3, 13):
        ns = time.time_ns()
        created, msecs = ns / 1e9, (ns % 1_000_000_000) // 1_000_000 + 0.0
        return created, 0.0 if msecs == 999.0 and int(created) != ns // 1_000_000_000 else msecs
    created = time.time()
    return created, int((created - int(created)) * 1000) + 0.0


_FORMAT = ("path=%s backend=%s reason=%s status=%d ttft_ms=%s duration_ms=%.1f prompt_tokens=%s "
           "completion_tokens=%s ended=%s moved_from=%s continued_from=%s")
_LINE = log_access.__code__.co_firstlineno
