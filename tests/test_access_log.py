"""The gateway's log lines: formatted as logging.basicConfig's format writes them, the time's
seconds formatted once a second (gateway.access_log.SecondsOnceFormatter)."""

from __future__ import annotations

import logging

from gateway.access_log import LOG_FORMAT, SecondsOnceFormatter


def _record(created: float) -> logging.LogRecord:
    record = logging.LogRecord("mtp_gateway.access", logging.INFO, __file__, 1,
                               "path=%s status=%d", ("/v1/chat/completions", 200), None)
    record.created, record.msecs = created, (created - int(created)) * 1000
    return record


def test_every_line_is_the_one_logging_writes_within_a_second_and_across_seconds() -> None:
    ours, logging_own = SecondsOnceFormatter(LOG_FORMAT), logging.Formatter(LOG_FORMAT)
    moments = [1764633600.012, 1764633600.5, 1764633600.999, 1764633601.0, 1764633601.25,
               1764633599.75, 1764720000.3]  # on, later, back a second, a day on
    for created in moments:
        assert ours.format(_record(created)) == logging_own.format(_record(created))
    assert ours.formatTime(_record(moments[0]), "%H") == logging_own.formatTime(
        _record(moments[0]), "%H")
