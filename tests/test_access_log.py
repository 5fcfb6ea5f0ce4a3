"""The gateway's log lines: formatted as logging.basicConfig's format writes them, the time's
seconds formatted once a second (gateway.access_log.SecondsOnceFormatter)."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator

import pytest

from gateway.access_log import LOG_FORMAT, SecondsOnceFormatter, access, log_access, log_handler


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


class _Clock:
    """time.time / time_ns / monotonic held at one moment, so two lines can be compared."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(time, "time", lambda: self.now)
        monkeypatch.setattr(time, "time_ns", lambda: round(self.now * 1e9))
        monkeypatch.setattr(time, "monotonic", lambda: 100.0)


def _line(stream: io.StringIO) -> str:
    text = stream.getvalue()
    stream.seek(0)
    stream.truncate()
    return text


def _log_one() -> None:
    log_access("/v1/chat/completions", "mtp", "below-crossover", 200, 0.0123, 99.5, "done",
               (12, 34), None, "plain")


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[logging.Handler, io.StringIO]]:
    """Logging as the CLI sets it up: log_handler() the root's one handler, access at INFO
    (each test puts it there itself: pytest adds its capturing handlers to the root's list
    after the fixtures)."""
    stream = io.StringIO()
    handler = log_handler()
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    level = access.level
    access.setLevel(logging.INFO)
    yield handler, stream
    access.setLevel(level)


def test_the_plain_set_ups_line_is_logging_own_byte_for_byte_without_its_record(
        plain: tuple[logging.Handler, io.StringIO], monkeypatch: pytest.MonkeyPatch) -> None:
    handler, stream = plain
    monkeypatch.setattr(logging.root, "handlers", [handler])
    clock = _Clock(monkeypatch)
    for now in (1764633600.012, 1764633600.9995, 1764633601.25, 1764633599.75):
        clock.now = now
        with monkeypatch.context() as no_record:  # the plain line makes no LogRecord
            no_record.setattr(access, "makeRecord", lambda *a, **k: pytest.fail("a record"))
            _log_one()
        direct = _line(stream)
        handler.addFilter(lambda record: True)  # any filter: logging's own path
        _log_one()
        handler.filters.clear()
        assert direct == _line(stream)
        assert direct.endswith(" INFO mtp_gateway.access: path=/v1/chat/completions backend=mtp "
                               "reason=below-crossover status=200 ttft_ms=12.3 duration_ms=500.0 "
                               "prompt_tokens=12 completion_tokens=34 ended=done moved_from=- "
                               "continued_from=plain\n")


def test_a_handler_filter_level_or_record_factory_anyone_adds_sees_the_line_as_before(
        plain: tuple[logging.Handler, io.StringIO], monkeypatch: pytest.MonkeyPatch) -> None:
    handler, stream = plain
    monkeypatch.setattr(logging.root, "handlers", [handler])
    seen: list[logging.LogRecord] = []
    collector = logging.Handler()
    collector.emit = seen.append  # type: ignore[method-assign]
    logging.root.addHandler(collector)
    _log_one()
    assert len(seen) == 1 and _line(stream) == handler.format(seen[0]) + "\n"
    logging.root.removeHandler(collector)

    access.addFilter(lambda record: False)
    _log_one()
    access.filters.clear()
    handler.setLevel(logging.WARNING)
    _log_one()
    handler.setLevel(logging.NOTSET)
    assert _line(stream) == ""

    factory = logging.getLogRecordFactory()

    def tagged(*args: object, **kwargs: object) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.msg = "tagged " + str(record.msg)
        return record

    monkeypatch.setattr(logging, "_logRecordFactory", tagged)
    _log_one()
    assert " INFO mtp_gateway.access: tagged path=" in _line(stream)
