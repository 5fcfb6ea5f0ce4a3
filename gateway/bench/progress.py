"""A small progress bar on stderr (redrawn in place on a terminal, one line per level otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    WIDTH = 28

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.label, self.total, self.done, self.errors = "", 0, 0, 0
        self._started = time.monotonic()
        self._drawn = 0.0

    def start(self, label: str, total: int | None) -> None:
        self.label, self.total, self.done, self.errors = label, total or 0, 0, 0
        self._started = time.monotonic()
        self._draw(force=True)

    def advance(self, error: bool = False) -> None:
        self.done += 1
        self.errors += error
        self._draw()

    def finish(self) -> None:
        if not self.enabled:
            return
        self._draw(force=True)
        if self.tty:
            self.stream.write("\n")
        else:
            self.stream.write(self._text() + "\n")
        self.stream.flush()

    def _text(self) -> str:
        elapsed = time.monotonic() - self._started
        if self.total:
            filled = min(self.WIDTH, self.WIDTH * self.done // self.total)
            bar = "#" * filled + "." * (self.WIDTH - filled)
            count = f"{self.done}/{self.total}"
        else:
            bar, count = "", f"{self.done}"
        errors = f"  {self.errors} errors" if self.errors else ""
        return f"{self.label:<28} [{bar}] {count} requests  {elapsed:6.1f}s{errors}"

    def _draw(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        self.stream.write("\r" + self._text())
        self.stream.flush()
