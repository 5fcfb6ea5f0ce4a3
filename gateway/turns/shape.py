"""`memory: auto`: which shape a pair runs in, from what its two servers report.

A turns pair needs SGLang's memory saver on both servers: a release on a server without it
frees nothing, and the other's resume then hangs (docs/turns.md). So `auto` is turns only
where both servers say `enable_memory_saver: true` in `/server_info`, and split as soon as
one says otherwise (off, or an engine that does not say); while a server has not answered
and the other is on, the shape waits for it. `split` and `turns` in the configuration force
their shape. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config import ROLES, MemorySetting, MemoryShape, Role
from gateway.upstream.engine.probe import SaverReport

_WHY_NOT = {"off": "runs without --enable-memory-saver",
            "unsaid": "does not say enable_memory_saver in /server_info"}


@dataclass(frozen=True, slots=True)
class ShapeChoice:
    setting: MemorySetting
    shape: MemoryShape | None  # None: not decided yet
    reason: str

    def describe(self) -> dict[str, str | None]:
        """For /admin/state."""
        return {"setting": self.setting, "shape": self.shape, "reason": self.reason}


def choose_shape(setting: MemorySetting, reports: Mapping[Role, SaverReport]) -> ShapeChoice:
    """The pair's shape: the configured one, or auto's from both servers' reports."""
    if setting != "auto":
        return ShapeChoice(setting, setting, f"memory: {setting} in the configuration")
    cannot = [f"{role} {_WHY_NOT[reports[role]]}" for role in ROLES if reports[role] in _WHY_NOT]
    if cannot:
        return ShapeChoice(setting, "split", "auto: " + "; ".join(cannot))
    silent = [role for role in ROLES if reports[role] == "silent"]
    if silent:
        return ShapeChoice(setting, None, f"auto: waiting for {' and '.join(silent)} to answer "
                           "/server_info (turns needs the memory saver on both servers)")
    return ShapeChoice(setting, "turns", "auto: both servers run with --enable-memory-saver")
